"""A random-batch soak: many random rounds through a backend, each checked like a kit case.

Each round draws the kind and model (among those the backend declares), dtype, KV dtype
(FP8 pools where the class serves them), topk, page size, tree mode, ragged lengths from 1,
and an engine-style layout (int32 index tensors and uint8 FP8 pools among them); one in
``graph_every`` rounds replays a captured graph with a padded batch instead. Every step is
compared with the reference and every pool with the kit's copy (``checks``). A failure prints
its seed; ``python -m specattn.testing.soak --backend NAME --seed S --rounds 1`` (with the
same ``--same-config``) replays exactly that round. Rounds the backend refuses as a case (a soft
cap it does not support, say) count as not applicable.

    python -m specattn.testing.soak --backend triton --rounds 5000 --workers 4 --same-config 50
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..fp8 import FP8_KV_DTYPES
from .checks import FP8_SCALES, Case, CaseFailed, CaseSkipped, Session, decode_graph, \
    decode_numerics, extend_graph, extend_numerics
from .plan import _DTYPE_NAMES, _dtypes, _pages, limit_for
from .rounds import EngineStyle
from .target import BackendSpec, Target

__all__ = ["SoakResult", "soak", "soak_parallel"]


@dataclass
class SoakResult:
    backend: str
    rounds: int = 0
    passed: int = 0
    skipped: int = 0
    failures: list[tuple[int, str, str]] = field(default_factory=list)  # (seed, case, why)
    seconds: float = 0.0

    def summary(self) -> str:
        return (f"soak {self.backend}: {self.rounds} random rounds, {self.passed} passed, "
                f"{len(self.failures)} mismatches, {self.skipped} not applicable "
                f"({self.seconds:.0f} s)")


def _kinds(target: Target, graph: bool = False) -> list[tuple[str, str]]:
    """``(kind, model)`` pairs the target has a class for (with CUDA-graph support), less
    those the class declares a known limit for as a whole (``"*/mha/*"``: not dense
    attention, so the reference does not apply)."""
    pairs = []
    for kind in ("decode", "extend"):
        for model in ("mha", "mla"):
            cls = target.class_for(kind, model)
            if (isinstance(cls, type) and (not graph or cls.supports_cuda_graph)
                    and not limit_for(cls, f"{kind}/{model}/soak")):
                pairs.append((kind, model))
    return pairs


@dataclass(frozen=True)
class _Config:
    """What a compiled kernel depends on: kind, model, dtype, page size, KV dtype, topk,
    tree mode."""

    kind: str
    model: str
    cls: type
    dtype: torch.dtype
    page: int
    kv: str
    topk: int
    tree: str


def _draw_config(rng: random.Random, later: random.Random, target: Target,
                 graph: bool) -> Optional[_Config]:
    """``later``: the stream of the draws added after seeds had been recorded (an MHA
    round's FP8 pools), so that ``rng`` draws what it always drew for a seed."""
    pairs = _kinds(target, graph=graph)
    if not pairs:
        return None
    kind, model = rng.choice(pairs)
    cls = target.class_for(kind, model)
    main, others = _dtypes(cls)
    dtype = main if graph else rng.choice([main] + others)
    p1, pbig = _pages(cls)
    page = rng.choice([p for p in (p1, pbig) if p])
    kv = rng.choice(cls.kv_cache_dtypes) if model == "mla" and not graph else "auto"
    fp8 = [d for d in cls.kv_cache_dtypes if d != "auto"]
    if model == "mha" and not graph and fp8 and dtype != torch.float32 and later.random() < 0.3:
        kv = later.choice(fp8)
    if kv != "auto" and dtype == torch.float32:
        dtype = (others or [torch.bfloat16])[0]
    topk, tree = 1, "lane"
    if kind == "decode":
        topk = rng.randint(1, min(8, cls.max_topk or 8))
        tree = rng.choice(sorted(cls.tree_modes)) if topk > 1 else "lane"
    return _Config(kind, model, cls, dtype, page, kv, topk, tree)


def _draw_case(rng: random.Random, cfg: _Config, seed: int, max_len: int) -> Case:
    later = random.Random(f"layout/{seed}")  # the layouts added after seeds were recorded
    style = EngineStyle(strided_index=rng.random() < 0.3, fused_qkv=rng.random() < 0.3,
                        sliced_req_to_token=rng.random() < 0.3,
                        shared_kv_buffer=cfg.model == "mha" and rng.random() < 0.3,
                        int32_index=later.random() < 0.3,
                        uint8_pools=cfg.kv != "auto" and later.random() < 0.3)
    params = {"style": style}
    if cfg.kv in FP8_KV_DTYPES:  # scales other than 1, as the kit's FP8 cases
        params["scales"] = FP8_SCALES
    if cfg.kind == "decode":
        params["lens"] = [rng.randint(1, max_len) for _ in range(rng.randint(1, 6))]
        body = decode_numerics
    else:
        new = [rng.randint(1, 8) for _ in range(rng.randint(1, 6))]
        params["lens"] = ([n + rng.randint(0, max_len) for n in new], new)
        body = extend_numerics
    cid = (f"soak/{seed}/{cfg.kind}/{cfg.model}/{_DTYPE_NAMES[cfg.dtype]}/k{cfg.topk}/"
           f"p{cfg.page}/{cfg.tree}/kv-{cfg.kv}/{style.label()}")
    return Case(cid, cfg.kind, cfg.model, body, cfg.dtype, cfg.topk, cfg.page, cfg.tree, cfg.kv,
                params)


def _graph_case(cfg: _Config, seed: int) -> Case:
    if cfg.kind == "decode":
        return Case(f"soak/{seed}/graph/decode/{cfg.model}/k{cfg.topk}/p{cfg.page}/{cfg.tree}",
                    cfg.kind, cfg.model, decode_graph, cfg.dtype, cfg.topk, cfg.page, cfg.tree)
    return Case(f"soak/{seed}/graph/extend/{cfg.model}/p{cfg.page}", cfg.kind, cfg.model,
                extend_graph, cfg.dtype, page_size=cfg.page)


def _round_case(target: Target, seed: int, graph_every: int, max_len: int,
                same_config: int) -> Optional[Case]:
    """Round ``seed``'s case. Its configuration comes from ``seed // same_config`` (runs of
    ``same_config`` seeds share one, so compiled kernels are reused), the rest (lengths,
    layout, whether it replays a graph) from ``seed`` itself: a seed alone replays it."""
    rng = random.Random(seed)
    graph = bool(graph_every) and rng.randrange(graph_every) == 0
    graph = graph and bool(_kinds(target, graph=True))  # else an eager round instead
    key = seed if same_config <= 1 else seed // same_config
    cfg_rng = rng if same_config <= 1 else random.Random(f"config/{key}")
    cfg = _draw_config(cfg_rng, random.Random(f"kv/{key}"), target, graph)
    if cfg is None:
        return None
    return _graph_case(cfg, seed) if graph else _draw_case(rng, cfg, seed, max_len)


def soak(backend: BackendSpec, *, rounds: int, seed: int = 0, graph_every: int = 20,
         max_len: int = 300, max_seconds: Optional[float] = None, same_config: int = 1,
         device=None, platform=None, setup=None, decode_options=None, extend_options=None,
         log=print) -> SoakResult:
    """Run ``rounds`` random rounds (fewer if ``max_seconds`` runs out first); round ``i``
    uses seed ``seed + i``. ``same_config > 1``: runs of that many seeds share a kernel
    configuration (fewer compiles for JIT backends; lengths and layouts still vary).
    ``decode_options`` / ``extend_options``: constructor keywords (as in ``check_backend``)."""
    target = Target.build(backend, platform=platform, device=device, setup=setup,
                          decode_options=decode_options, extend_options=extend_options)
    result = SoakResult(target.label)
    replay = f" (replay with --same-config {same_config})" if same_config > 1 else ""
    start = time.perf_counter()
    for i in range(rounds):
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            log(f"soak {target.label}: stopped after {i} rounds ({max_seconds:.0f} s limit)")
            break
        s = seed + i
        case = _round_case(target, s, graph_every, max_len, same_config)
        result.rounds += 1
        if case is None or limit_for(target.class_for(case.kind, case.model), case.id):
            result.skipped += 1  # nothing runs here, or a limit the class declares (as the kit)
            continue
        session = Session(target, seed=s)
        try:
            with target.environment():
                case.body(session, case)
            result.passed += 1
        except CaseSkipped:
            result.skipped += 1
        except CaseFailed as exc:
            result.failures.append((s, case.id, str(exc)))
            log(f"MISMATCH seed {s}{replay}: {case.id}: {exc}")
        except Exception as exc:  # noqa: BLE001 - a crash is a failure with its seed
            result.failures.append((s, case.id, f"{type(exc).__name__}: {exc}"))
            log(f"CRASH seed {s}{replay}: {case.id}: {type(exc).__name__}: {exc}")
    result.seconds = time.perf_counter() - start
    return result


def _soak_worker(kwargs: dict) -> SoakResult:
    return soak(**kwargs)


def soak_parallel(backend: str, *, rounds: int, seed: int = 0, workers: int = 1,
                  **kwargs) -> SoakResult:
    """``soak`` split over ``workers`` processes (seed ranges ``seed + w * rounds //
    workers ...``, so every round keeps its own seed); the counts are summed. Processes, not
    threads: each has its own CUDA context and compiles in parallel (Triton's disk cache is
    shared). ``kwargs`` go to every ``soak`` call, so ``log`` must be picklable (``print``)."""
    if workers <= 1:
        return soak(backend, rounds=rounds, seed=seed, **kwargs)
    import multiprocessing

    per = -(-rounds // workers)
    jobs = [dict(backend=backend, rounds=min(per, rounds - w * per), seed=seed + w * per,
                 **kwargs) for w in range(workers) if rounds > w * per]
    with multiprocessing.get_context("spawn").Pool(len(jobs)) as pool:
        parts = pool.map(_soak_worker, jobs)
    total = SoakResult(parts[0].backend)
    for part in parts:
        total.rounds += part.rounds
        total.passed += part.passed
        total.skipped += part.skipped
        total.failures += part.failures
        total.seconds = max(total.seconds, part.seconds)
    total.failures.sort()
    return total


def _options_for(name: str, options: list) -> tuple[dict, dict, list[str]]:
    """The decode and extend constructor keywords the options give backend ``name``, as a
    serving engine's ``DraftBackendFactory`` would (each keyword to every class that takes
    it: ``BackendOption.kwargs_taken_by``), and the option texts that applied."""
    from ..registry import active_registry

    kwargs: dict[str, dict] = {"decode": {}, "extend": {}}
    texts = []
    for opt in options:
        for cls in opt.classes(active_registry()):
            taken = opt.kwargs_taken_by(cls) if name in (cls.name, *cls.aliases) else {}
            if taken:
                kwargs[cls.kind].update(taken)
                if opt.text not in texts:
                    texts.append(opt.text)
    return kwargs["decode"], kwargs["extend"], texts


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specattn.testing.soak",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", action="append", required=True,
                        help="registered backend name (repeat for several)")
    parser.add_argument("--rounds", type=int, default=1000, help="random rounds per backend")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first round")
    parser.add_argument("--graph-every", type=int, default=20,
                        help="about one round in N replays a captured graph (0: never)")
    parser.add_argument("--max-len", type=int, default=300, help="longest prefix drawn")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop a backend's soak after this long (rounds done are reported)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes per backend, each with its own range of seeds")
    parser.add_argument("--same-config", type=int, default=1,
                        help="runs of N seeds share a kernel configuration (fewer JIT "
                             "compiles; replay with the same N)")
    parser.add_argument("--option", action="append", default=[], metavar="BACKEND:KEY=VALUE",
                        help="constructor keywords for a backend's classes, as in specattn "
                             "bench --option (e.g. 'triton:plan=gluon-split')")
    args = parser.parse_args(argv)
    from ..bench.options import parse_options

    options = parse_options(args.option)
    failed = 0
    for name in args.backend:
        decode, extend, texts = _options_for(name, options)
        result = soak_parallel(name, rounds=args.rounds, seed=args.seed, workers=args.workers,
                               graph_every=args.graph_every, max_len=args.max_len,
                               max_seconds=args.max_seconds, same_config=args.same_config,
                               decode_options=decode, extend_options=extend)
        if texts:
            result.backend += f"[{','.join(texts)}]"
        print(result.summary(), flush=True)
        for seed, case_id, why in result.failures:
            print(f"  seed {seed}: {case_id}: {why}", flush=True)
        failed += len(result.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
