"""``sglang/<name>`` rows of ``specattn bench``: SGLang's own EAGLE draft round for a case, with
SGLang's draft backend of that name and with specattn's through the plugin
(``specattn.integrations.sglang.draft_round.time_pair``; docs/sglang.md).

When SGLang 0.5.23 is importable and the run is on a GPU, every decode case with pools in the
activation dtype gets, per SGLang name (``triton``, ``flashinfer``; those named with
``--backend`` when it is given, or all for ``--backend sglang``), two rows:
``sglang/<name>`` (SGLang's backend) and ``sglang/<name>+specattn``. ``round graph us``:
``EAGLEDraftCudaGraphRunner.execute`` (host preparation + replay of one layer's ``S - 1``
steps, host wall time, median); ``time us``: one step's attention call in SGLang's loop
(eager, CUDA events, mean over the steps), not the standard step of the other rows (a CUDA
graph over rotated layers). The specattn row's check is the round against SGLang's (draft
tokens, attention, KV). TorchDynamo is off (SGLang's compiled top-k selection runs eagerly
on both sides).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
from typing import Any, Optional, Sequence

import torch

from .cases import Case
from .harness import short_error, tolerance
from .run import case_fields

__all__ = ["SGLANG_VERSION", "SGLANG_NAMES", "sglang_missing", "sglang_names", "sglang_rows",
           "merge_rows"]

log = logging.getLogger("specattn.bench")

SGLANG_VERSION = "0.5.23"
SGLANG_NAMES = ("triton", "flashinfer")


def sglang_missing() -> str:
    """Why the SGLang rows cannot run here ("" when they can)."""
    try:
        if importlib.util.find_spec("sglang") is None:
            return "SGLang is not importable"
        version = importlib.metadata.version("sglang")
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return "SGLang is not importable"
    if version != SGLANG_VERSION:
        return f"the SGLang rows pin SGLang {SGLANG_VERSION}, found {version}"
    return ""


def sglang_names(wanted: Optional[Sequence[str]]) -> list[str]:
    """SGLang's names the rows run for: all without ``--backend``; else those named (as
    ``NAME``, ``sglang/NAME``) or all for ``sglang``."""
    if wanted is None:
        return list(SGLANG_NAMES)
    w = set(wanted)
    return [n for n in SGLANG_NAMES if {"sglang", n, f"sglang/{n}"} & w]


def _row(case: Case, lengths: list[int], variant: str, name: str, **kw) -> dict[str, Any]:
    return {**case_fields(case, lengths), "variant": variant, "backend": variant,
            "mode": "sglang", "kernel_library": f"sglang {SGLANG_VERSION}", **kw}


def _side(case, lengths, variant, name, side, **kw) -> dict[str, Any]:
    steps = [t for t in side["step_us"] if t is not None]
    return _row(case, lengths, variant, name, status="ok",
                time_us=sum(steps) / len(steps) if steps else None,
                timing="eager step, CUDA events (SGLang's loop)",
                round_graph_us=side["round_wall_us"], round_layers=1,
                notes=[f"served by {side['served_by']}; round = EAGLEDraftCudaGraphRunner."
                       f"execute (host + replay), CUDA-event span "
                       f"{side['round_event_us'] or 0:,.0f} us"], **kw)


def sglang_rows(cases: Sequence[Case], device: torch.device, *, seed: int = 0,
                backends: Optional[Sequence[str]] = None) -> list[dict[str, Any]]:
    """The SGLang rows of every decode case (none, with a log line, when SGLang cannot run
    here). A case SGLang refuses gets an ``unsupported`` stock row; a crash a ``failed`` one.
    ``specattn bench`` asks for them on a GPU; on a CPU (tests) the graph runner runs with
    an eager stand-in for its CUDA graph."""
    reason = sglang_missing()
    names = sglang_names(backends)
    if reason or not names:
        if reason:
            log.info("no sglang/<name> rows: %s", reason)
        return []
    from ..integrations.sglang import draft_round as R

    R.install_stubs(gpu=device.type == "cuda")
    rows: list[dict[str, Any]] = []
    for case in cases:
        if case.kind != "decode" or case.fp8:  # the fixture's pools are bf16
            continue
        lengths = case.lengths(seed)
        fx = None
        try:
            with torch._dynamo.config.patch(disable=True), torch.no_grad():
                fx = R.build_fixture(case.model, lengths, shape=case.shape,
                                     page_size=case.page_size, steps=case.steps,
                                     topk_max=case.topk, graph_bs=case.batch,
                                     dtype=case.dtype, device=device.type, seed=seed)
                for name in names:
                    rows += _case_rows(R, fx, case, lengths, name, device)
        except Exception as exc:  # the fixture (e.g. out of memory): every row fails
            rows += [_row(case, lengths, f"sglang/{n}", n, status="failed",
                          error=f"setup failed: {short_error(exc)}") for n in names]
        del fx
        _free(device)
    return rows


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _case_rows(R, fx, case: Case, lengths: list[int], name: str,
               device: torch.device) -> list[dict[str, Any]]:
    rc = R.RoundCase(case.model, tuple(lengths), case.topk, case.steps, case.page_size,
                     case.shape, fx.hidden, fx.vocab, capture_bs=case.batch)
    try:
        # On a CPU (tests) the rows are checked, not timed: one timed call each.
        res = R.time_pair(fx, rc, name, tolerance(case.dtype), reps=30 if device.type ==
                          "cuda" else 1, free=lambda: _free(device))
    except Exception as exc:
        return [_row(case, lengths, f"sglang/{name}+specattn", name, status="failed",
                     error=short_error(exc))]
    out = []
    if res["stock"] is None:
        out.append(_row(case, lengths, f"sglang/{name}", name, status="unsupported",
                        error=f"SGLang: {res['stock_error']}"))
    else:
        out.append(_side(case, lengths, f"sglang/{name}", name, res["stock"]))
    verdict = res["verdict"]
    spec = _side(case, lengths, f"sglang/{name}+specattn", name, res["specattn"])
    if verdict is not None:
        spec["max_err"] = max(verdict.out_err, verdict.kv_err)
        spec["notes"].append(f"against sglang/{name}: {verdict.summary}; graph tokens "
                             f"{res['graph_tokens_equal']}/{case.batch}")
        if not verdict.ok:
            spec.update(status="failed", error="; ".join(verdict.problems[:2]))
    elif res["upstream"]:
        spec["notes"].append(f"not checked against sglang/{name}: {res['upstream']}")
    out.append(spec)
    return out


def merge_rows(rows: list[dict[str, Any]], extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with each of ``extra`` placed after the last row of its case."""
    out = list(rows)
    for row in extra:
        key = (row["case"], row["lengths"])
        last = max((i for i, r in enumerate(out) if (r.get("case"), r.get("lengths")) == key),
                   default=len(out) - 1)
        out.insert(last + 1, row)
    return out
