"""Which cases the kit runs for a backend, read from the class's declared capabilities.

Case ids read like paths: ``decode/mha/numerics/bf16/k3/p1/path/ragged``,
``extend/mla/engine/strided_index``, ``decode/refuses/step_out_of_range``. A class's
``known_limits`` (``{fnmatch pattern: why}``) turn matching cases into declared limits.

``quick`` (the default, and what CI runs on the CPU): every contract point once per model and
dtype. ``full`` adds the grid of topk 1/2/4/8 x page sizes x tree modes x dtypes (GPU runs).

Each declared ``kv_cache_dtype`` other than ``"auto"`` gets a decode round and an extend
(``.../kv-<name>/...``); a per-tensor FP8 one (``"fp8_e4m3"``, ``"fp8_e5m2"``) runs them with
``k_scale`` / ``v_scale`` != 1 (``checks.FP8_SCALES``), adds a decode round on ``uint8`` pool
storage, and a decode and an extend graph case whose scales are one-element device tensors
that change value between capture and every replay (``scale_change``); a backend without
``supports_cuda_graph`` gets two eager rounds of that kind instead
(``numerics/.../scale_change``).
"""

from __future__ import annotations

import fnmatch
from typing import Iterator, Optional

import torch

from ..fp8 import FP8_KV_DTYPES
from . import checks
from .checks import Case
from .refusals import DECODE_REFUSALS, EXTEND_REFUSALS, run_refusal
from .rounds import EngineStyle
from .target import Target

__all__ = ["plan_cases", "limit_for", "LEVELS"]

LEVELS = ("quick", "full")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_ENGINE = {
    "strided_index": EngineStyle(strided_index=True),
    "fused_qkv": EngineStyle(fused_qkv=True),
    "sliced_req_to_token": EngineStyle(sliced_req_to_token=True),
    "shared_kv_buffer": EngineStyle(shared_kv_buffer=True),
    "int32_index": EngineStyle(int32_index=True),
}


def limit_for(cls: type, case_id: str) -> Optional[str]:
    """The declared reason when ``case_id`` matches one of ``cls.known_limits``."""
    for pattern, why in getattr(cls, "known_limits", {}).items():
        if fnmatch.fnmatchcase(case_id, pattern):
            return why
    return None


def _dtypes(cls: type) -> tuple[torch.dtype, list[torch.dtype]]:
    """(main dtype: float32 when declared, for the tightest check; the 16-bit dtypes)."""
    declared = [d for d in (torch.bfloat16, torch.float16, torch.float32) if d in cls.dtypes]
    if not declared:
        return torch.float32, []
    half = [d for d in declared if d != torch.float32]
    main = torch.float32 if torch.float32 in declared else half[0]
    return main, [d for d in half if d != main]


def _kv_dtype_model(cls: type, main: torch.dtype, others: list[torch.dtype]) -> torch.dtype:
    """The model dtype of the quantized-KV cases: bf16 where declared (what FP8 serving
    runs), else the first 16-bit dtype."""
    return torch.bfloat16 if torch.bfloat16 in cls.dtypes else (others or [main])[0]


def _pages(cls: type) -> tuple[int, Optional[int]]:
    """(the page size for ``p1`` cases, a page size > 1 or None)."""
    sizes = cls.page_sizes
    if sizes is None:
        return 1, 16
    small = 1 if 1 in sizes else min(sizes)
    bigger = sorted(p for p in sizes if p > 1)
    return small, (16 if 16 in bigger else bigger[0]) if bigger else None


def _case(kind: str, model: str, check: str, body, dtype=torch.float32, topk=1, page=1,
          tree="lane", kv="auto", tail: str = "", **params) -> Case:
    parts = [kind, model, check, _DTYPE_NAMES[dtype]]
    if kind == "decode":
        parts += [f"k{topk}"]
    parts += [f"p{page}"]
    if kind == "decode":
        parts += [tree]
    if kv != "auto":
        parts += [f"kv-{kv}"]
    if tail:
        parts += [tail]
    return Case("/".join(parts), kind, model, body, dtype, topk, page, tree, kv, params)


def _decode_cases(cls: type, model: str, level: str) -> Iterator[Case]:
    main, others = _dtypes(cls)
    p1, pbig = _pages(cls)
    kmax = cls.max_topk or 8
    k = min(3, kmax)
    k2 = min(2, kmax)
    path = "path" if "path" in cls.tree_modes else "lane"
    num = checks.decode_numerics
    yield _case("decode", model, "numerics", num, main, 1, p1, "lane", tail="ragged")
    yield _case("decode", model, "numerics", num, main, k, p1, path, tail="ragged",
                both_layers=True)
    if pbig:
        yield _case("decode", model, "numerics", num, main, k2, pbig, "lane", tail="ragged")
        yield _case("decode", model, "numerics", num, main, k2, pbig, path, tail="uniform",
                    ragged=False)
    for dt in others:
        yield _case("decode", model, "numerics", num, dt, k2, p1, path, tail="ragged")
    yield _case("decode", model, "numerics", num, main, k2, p1, "lane", tail="softcap",
                logit_cap=2.5)
    if model == "mha":
        yield _case("decode", model, "numerics", num, main, k2, p1, path,
                    tail="one_kv_head", one_kv=True)
        yield _case("decode", model, "numerics", num, main, k2, p1, path,
                    tail="narrow_v", narrow_v=True)
    kv_dt = _kv_dtype_model(cls, main, others)
    for kv in cls.kv_cache_dtypes:
        if kv == "auto":
            continue
        fp8 = {"scales": checks.FP8_SCALES} if kv in FP8_KV_DTYPES else {}
        yield _case("decode", model, "numerics", num, kv_dt, k2, pbig or p1, path, kv,
                    tail="ragged", **fp8)
        if fp8:
            yield _case("decode", model, "engine/uint8_pools", num, kv_dt, k2, p1, path, kv,
                        style=EngineStyle(uint8_pools=True), **fp8)
            yield _case("decode", model, "graph", checks.decode_graph, kv_dt, k2, pbig or p1,
                        path, kv, tail="scale_change", tensor_scales=True)
            if not cls.supports_cuda_graph:  # the graph case above is a skip: eager rounds
                yield _case("decode", model, "numerics", checks.decode_scale_change, kv_dt,
                            k2, p1, path, kv, tail="scale_change", tensor_scales=True)
    for name, style in _ENGINE.items():
        if name == "shared_kv_buffer" and model == "mla":
            continue
        yield _case("decode", model, f"engine/{name}", num, main, k2, p1, path, style=style)
    if pbig:  # a pool of whole pages and one slot, the last draft slot in that slot
        yield _case("decode", model, "engine/partial_last_page", num, main, 1, pbig, "lane",
                    style=EngineStyle(partial_last_page=True),
                    lens=checks.partial_page_prefixes(pbig))
    yield _case("decode", model, "isolation", num, main, k, p1, path, poison=True)
    yield _case("decode", model, "numerics", num, main, k2, pbig or p1, path, tail="long",
                lens=[300, 7])  # past a sliding window's default width, several pages
    # A request with no prefix yet (validation allows seq_lens 0): only its lanes' history.
    yield _case("decode", model, "numerics", num, main, k2, pbig or p1, path,
                tail="empty_prefix", lens=[0, 9])
    yield _case("decode", model, "graph", checks.decode_graph, main, k2, pbig or p1, path)
    # topk 1 (plain decode, often its own kernel path): a K = 1 MLA graph replay gave NaN on
    # the H200 once (soak seed 364, flashinfer).
    yield _case("decode", model, "graph", checks.decode_graph, main, 1, p1, "lane")
    # Step S-1 captured too: outside the serving loop, so a backend may refuse it, but a
    # stale plan replayed there must not pass silently (one did: flashinfer, topk 1).
    yield _case("decode", model, "graph", checks.decode_graph, main, 1, p1, "lane",
                tail="last_step", last_step=True)
    yield _case("decode", model, "determinism", checks.decode_determinism, main, k2, p1, path)
    if level == "full":
        for dt in [main] + others:
            for topk in sorted({1, 2, 4, min(8, kmax)}):
                for page in [p for p in (p1, pbig) if p]:
                    for tree in sorted(cls.tree_modes):
                        if topk == 1 and tree == "path":
                            continue
                        yield _case("decode", model, "grid", num, dt, topk, page, tree)


def _extend_cases(cls: type, model: str, level: str) -> Iterator[Case]:
    main, others = _dtypes(cls)
    p1, pbig = _pages(cls)
    num = checks.extend_numerics
    yield _case("extend", model, "numerics", num, main, page=p1, tail="ragged",
                both_layers=True)
    if pbig:
        yield _case("extend", model, "numerics", num, main, page=pbig, tail="uniform",
                    ragged=False)
    for dt in others:
        yield _case("extend", model, "numerics", num, dt, page=p1, tail="ragged")
    yield _case("extend", model, "numerics", num, main, page=p1, tail="softcap",
                logit_cap=2.5)
    if model == "mha":
        yield _case("extend", model, "numerics", num, main, page=p1, tail="narrow_v",
                    narrow_v=True)
    for kv in cls.kv_cache_dtypes:
        if kv == "auto":
            continue
        fp8 = {"scales": checks.FP8_SCALES} if kv in FP8_KV_DTYPES else {}
        kv_dt = _kv_dtype_model(cls, main, others)
        yield _case("extend", model, "numerics", num, kv_dt, page=pbig or p1, kv=kv,
                    tail="ragged", **fp8)
        if fp8:
            yield _case("extend", model, "graph", checks.extend_graph, kv_dt, page=pbig or p1,
                        kv=kv, tail="scale_change", tensor_scales=True)
            if not cls.supports_cuda_graph:
                yield _case("extend", model, "numerics", checks.extend_scale_change, kv_dt,
                            page=p1, kv=kv, tail="scale_change", tensor_scales=True)
    for name, style in _ENGINE.items():
        if name == "shared_kv_buffer" and model == "mla":
            continue
        yield _case("extend", model, f"engine/{name}", num, main, page=p1, style=style)
    if pbig:  # a pool of whole pages and one slot, a new token in that slot
        yield _case("extend", model, "engine/partial_last_page", num, main, page=pbig,
                    style=EngineStyle(partial_last_page=True),
                    lens=checks.partial_page_lengths(pbig))
    yield _case("extend", model, "isolation", num, main, page=p1, poison=True)
    yield _case("extend", model, "graph", checks.extend_graph, main, page=pbig or p1)
    yield _case("extend", model, "determinism", checks.extend_determinism, main, page=p1)
    if level == "full":
        for dt in [main] + others:
            for page in [p for p in (p1, pbig) if p]:
                yield _case("extend", model, "grid", num, dt, page=page)


def _refusal_cases(cls: type, kind: str, model: str) -> Iterator[Case]:
    main, others = _dtypes(cls)
    p1, _ = _pages(cls)
    path = "path" in cls.tree_modes if kind == "decode" else False
    topk = min(2, cls.max_topk or 2)
    fp8 = next((kv for kv in FP8_KV_DTYPES if kv in cls.kv_cache_dtypes), None)
    for refusal in (DECODE_REFUSALS if kind == "decode" else EXTEND_REFUSALS):
        if (refusal.path and not path) or (refusal.graph and not cls.supports_cuda_graph) or (
                refusal.fp8 and fp8 is None):
            continue
        tree = "path" if path else "lane"
        dtype, kv = (_kv_dtype_model(cls, main, others), fp8) if refusal.fp8 else (main, "auto")
        yield Case(f"{kind}/refuses/{refusal.name}", kind, model, run_refusal, dtype,
                   topk if kind == "decode" else 1, p1, tree, kv, {"refusal": refusal})


def plan_cases(target: Target, *, kinds=("decode", "extend"), models=("mha", "mla"),
               level: str = "quick") -> list[tuple[Case, Optional[str]]]:
    """Every case for ``target`` with ``None`` or the reason it is not run (a skip or a
    declared limit, told apart by ``limit_for``)."""
    planned: list[tuple[Case, Optional[str]]] = []
    for kind in kinds:
        refusals_done = False
        for model in models:
            cls = target.class_for(kind, model)
            if isinstance(cls, str):
                planned.append((Case(f"{kind}/{model}", kind, model, _never), cls))
                continue
            cases = list((_decode_cases if kind == "decode" else _extend_cases)(
                cls, model, level))
            if not refusals_done:
                cases += list(_refusal_cases(cls, kind, model))
                refusals_done = True
            planned += [(c, _undeclared_soft_cap(cls, c)) for c in cases]
    return planned


def _undeclared_soft_cap(cls: type, case: Case) -> Optional[str]:
    """The skip of a soft-cap case the class declares no soft cap for (``soft_cap_models``);
    a class that declares it and refuses it fails the case."""
    if case.params.get("logit_cap") and case.model not in cls.soft_cap_models:
        return f"declares no logit soft cap for {case.model.upper()} (soft_cap_models)"
    return None


def _never(session, case):  # pragma: no cover - planned as a skip, never run
    raise AssertionError("not runnable")
