"""Where one launch of the CuTe-DSL MLA decode kernel spends its time, from timestamps that
every CTA writes (``MlaDecodeKernel`` diag 6: right results, a few extra stores): one bench
step of each case, on the last of the bench's rotating layers, after warm-up calls.

Per case, one row per point of a CTA's life (``_cute_mla_kernel.STAMP_SLOTS``, in the
order of their medians): the time since the CTA started (SM clock, converted with the clock
rate measured from the same stamps), as the median and the 90th percentile over the CTAs, and the step to the next
point; then the launch itself: how far apart the CTAs started and ended (``%globaltimer``),
the SMs used, and the call's device time (CUDA events); where CTAs walk different tile
counts, when each count's CTAs finished the loop and exited.

    python tools/cute_stamps.py [--case mla-long mla-small ...] [--prefix N ...]
                                [--config LABEL ...]

It answers what the call-level diag (``tools/gluon_diag.py``: "no tiles") cannot: which
part of a CTA's fixed cost is the prologue's chain of loads, the first tile's wait, the
epilogue and the on-chip merge, and whether the CTAs start together.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _quantiles(values, qs=(0.5, 0.9)):
    ordered = sorted(values)
    return [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in qs]


def main() -> None:
    from gluon_diag import case_setups  # this folder

    from specattn.bench.options import kernel_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", nargs="+", default=["mla-long", "mla-small"])
    ap.add_argument("--prefix", type=int, nargs="+", default=None)
    ap.add_argument("--config", nargs="+", default=["m64 n64 w8 s2 kv-first gluon cute"])
    args = ap.parse_args()
    configs = [kernel_config(label) for label in args.config]
    for cfg in configs:
        if not cfg.cute:
            raise SystemExit(f"--config {cfg.label()}: a CuTe-DSL kernel config ('... cute')")
    for name, case, setup in case_setups(args.case, args.prefix):
        for cfg in configs:
            _stamp_run(f"{name}, {cfg.label()}", case, setup, cfg)


def _stamp_run(name, case, setup, cfg) -> None:
    """One warm call of ``cfg``'s kernel at ``case`` with diag 6, reported."""
    import torch

    from specattn.backends.triton import TritonDecode, cute_mla
    from specattn.backends.triton._cute_mla_kernel import STAMP_SLOTS, STAMPS
    from specattn.bench.harness import _step_call, timed_step_fn

    backend = TritonDecode(setup.runner, case.topk, case.steps, config=cfg)
    backend.init_forward_metadata(setup.batch)
    stamps = torch.zeros(1 << 20, dtype=torch.int32, device="cuda")
    real = cute_mla.attention
    cute_mla.attention = functools.partial(real, diag=6, stamps=stamps)
    try:
        all_layers = timed_step_fn(backend, setup)
        for _ in range(3):
            all_layers()  # compile, then warm
        call = _step_call(backend, setup)
        torch.cuda.synchronize()
        stamps.zero_()
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        call(setup.layers[-1])
        end.record()
        torch.cuda.synchronize()
    finally:
        cute_mla.attention = real
    _report(name, stamps, start.elapsed_time(end) * 1e3, STAMP_SLOTS, STAMPS)


def _report(name, stamps, event_us, slots, width) -> None:
    words = stamps.view(-1, width).cpu().tolist()
    ctas = [w for w in words if w[slots.index("end")] > 0]
    ns_at = {s: i for i, s in enumerate(slots)}
    # The timer's low 32 bits wrap every 4.3 s: times are differences modulo 2^32, and the
    # first start is the one the others follow (by less than half the range).
    wrap = 1 << 32

    def since(x, ref):
        return (x - ref) % wrap

    ref = ctas[0][ns_at["entry ns"]]
    t0 = ref + min(since(w[ns_at["entry ns"]], ref) - (wrap if since(
        w[ns_at["entry ns"]], ref) >= wrap // 2 else 0) for w in ctas)

    def rel(x):
        return since(x, t0)

    ghz = _quantiles([w[ns_at["end"]] / max(1, since(w[ns_at["exit ns"]], w[ns_at["entry ns"]]))
                      for w in ctas])[0]
    print(f"## {name}: {len(ctas)} CTAs on {len({w[ns_at['sm']] for w in ctas})} SMs, "
          f"tiles per CTA {sorted({w[ns_at['tiles']] for w in ctas})}, SM clock "
          f"{ghz:.2f} GHz, device time {event_us:.1f} us (CUDA events, one call)")
    starts = [rel(w[ns_at["entry ns"]]) / 1e3 for w in ctas]
    ends = [rel(w[ns_at["exit ns"]]) / 1e3 for w in ctas]
    print(f"CTA start after the first: median {_quantiles(starts)[0]:.2f} us, 90% "
          f"{_quantiles(starts)[1]:.2f}, last {max(starts):.2f}; CTA end: first "
          f"{min(ends):.2f} us, median {_quantiles(ends)[0]:.2f}, last {max(ends):.2f}")
    print("| point | median us since CTA start | 90% | step from previous (median) |")
    print("|---|---|---|---|")
    points, missing = [], []
    for slot in slots[4:]:
        i = ns_at[slot]
        vals = [w[i] / ghz / 1e3 for w in ctas if w[i] > 0]
        if vals:
            points.append((slot, *_quantiles(vals)))
        else:
            missing.append(slot)
    prev = 0.0
    for slot, med, p90 in sorted(points, key=lambda p: p[1]):  # in the order CTAs pass them
        print(f"| {slot} | {med:.2f} | {p90:.2f} | {med - prev:+.2f} |")
        prev = med
    for slot in missing:
        print(f"| {slot} | - | - | - |")
    by_tiles = {}
    for w in ctas:
        by_tiles.setdefault(w[ns_at["tiles"]], []).append(w)
    if len(by_tiles) > 1:  # the splits' imbalance: when CTAs of each tile count finished
        print("by tiles per CTA, median us: loop done (since the CTA's start) / exit (since "
              "the first CTA's start): " + ", ".join(
            f"{n} tiles ({len(ws)} CTAs): "
            f"{_quantiles([w[ns_at['loop done']] / ghz / 1e3 for w in ws])[0]:.2f} / "
            f"{_quantiles([rel(w[ns_at['exit ns']]) / 1e3 for w in ws])[0]:.2f}"
            for n, ws in sorted(by_tiles.items())))
    tiles = [w for w in ctas if w[ns_at["tiles"]] > 1]
    if tiles:
        per = [(w[ns_at["last landed"]] - w[ns_at["landed"]]) / (w[ns_at["tiles"]] - 1)
               / ghz / 1e3 for w in tiles]
        print(f"tile to tile (landed, first to last): median {_quantiles(per)[0]:.2f} us, "
              f"90% {_quantiles(per)[1]:.2f}")
    print(flush=True)


if __name__ == "__main__":
    main()
