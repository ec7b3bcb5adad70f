"""Benchmark the FlashAttention backends (``fa4``; ``fa3`` = the same glue) per ``performance.md``.

For each case (uniform lengths, and ragged in [L/2, 3L/2] for ``gqa-long``): the time of one
draft-decode ``forward`` at step 2 (3 history tokens: KV write + passes + merge) in the
variants ``shared-v1`` (the previous design: FA4 history pass + torch LSE merge),
``shared`` (FA4 prefix pass + the Triton history+merge kernel), ``auto`` (the routing rule's
pick, named in the table), the ``per-branch`` baseline (FA4 varlen, one query per lane) and
``split2``/``split4`` (chunks of each prefix as extra sequences, FA4 having no split-KV on
sm90); the prefix pass alone; the floor from the copy bandwidth measured in the same
process; the host cost of ``init_forward_metadata``. Draft extend likewise. ``--profile``
adds the per-part breakdown of one ``gqa-long`` step (graph-timed parts, and the kernels
of one eager step from ``torch.profiler``) and FA4 prefix-pass options (``pack_gqa``,
``num_splits``). Timing: a CUDA graph over rotating layers
(KV read per call larger than L2), median of ``triton.testing.do_bench``; eager if capture
fails (reported).

Usage: ``python benchmarks/bench_flash_attn.py [--out DIR] [--cases a,b] [--backend fa4|fa3]
[--profile] [--signatures]``. Writes ``flash-attn-bench-v2.csv`` and prints a markdown
table.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import copy_bandwidth, timed  # noqa: E402
from specattn import metadata  # noqa: E402
from specattn.data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner  # noqa: E402

DEV = "cuda"
HQ, HKV, D = 32, 8, 128
CASES = {
    # name: (B, L, K, S, P)
    "gqa-long": (32, 4096, 8, 5, 1),
    "gqa-chain": (64, 2048, 1, 4, 1),
    "gqa-paged": (32, 4096, 4, 5, 16),
    "gqa-small": (4, 1024, 4, 5, 1),
    "extend": (32, 4096, 0, 5, 1),
}
L2_BYTES = 50 * 2 ** 20
ROW_BYTES = HKV * D * 2 * 2  # K and V of one token, bf16


def signatures() -> None:
    import flash_attn.cute as cute

    print("torch", torch.__version__, torch.cuda.get_device_name(),
          "cap", torch.cuda.get_device_capability())
    print("flash_attn.cute.flash_attn_varlen_func", inspect.signature(cute.flash_attn_varlen_func))
    try:
        import flash_attn_interface as fa3

        print("flash_attn_interface.flash_attn_with_kvcache",
              inspect.signature(fa3.flash_attn_with_kvcache))
    except ImportError:
        print("flash_attn_interface: not installed")


def build(lens, extra, page_size, layers):
    """Random pools; request ``b`` owns whole random pages covering ``lens[b] + extra[b]``
    positions (``R_b[x] = page[x // P] * P + x % P``), as a paged engine allocates."""
    need = [math.ceil((n + e) / page_size) for n, e in zip(lens, extra)]
    pages = sum(need) + 2
    ctx = max(n + e for n, e in zip(lens, extra)) + page_size
    r = DraftRunner.mha(HQ, HKV, D, num_layers=layers, num_slots=pages * page_size,
                        max_reqs=len(lens), max_context_len=ctx, page_size=page_size,
                        dtype=torch.bfloat16, device=DEV)
    for p in r.k_buffer + r.v_buffer:
        p.normal_()
    free = (torch.randperm(pages - 1) + 1).tolist()
    rpi = torch.randperm(len(lens))
    rows = torch.zeros(len(lens), ctx, dtype=torch.int32)
    for b, n in enumerate(need):
        own = torch.tensor([free.pop() for _ in range(n)])
        x = torch.arange(lens[b] + extra[b])
        rows[b, :len(x)] = (own[x // page_size] * page_size + x % page_size).int()
    r.req_to_token[rpi.to(DEV)] = rows.to(DEV)
    return r, rpi.to(DEV), rows


def layers_for(lens):
    return max(2, min(12, -(-3 * L2_BYTES // (sum(lens) * ROW_BYTES))))


def host_ms(fn, reps=10) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def decode_classes(backend):
    from specattn.backends import flash_attn as fa

    return (fa.FA4Decode, fa.FA4Extend) if backend == "fa4" else (fa.FA3DecodeSM90,
                                                                 fa.FA3ExtendSM90)


VARIANTS = {
    # name: constructor keywords
    "shared-v1": dict(mode="shared", fused_merge=False),
    "shared": dict(mode="shared"),
    "auto": dict(mode="auto"),
    "per-branch": dict(mode="per-branch"),
    "split2": dict(mode="shared", split_prefix=2),
    "split4": dict(mode="shared", split_prefix=4),
}


def decode_setup(backend, lens, K, S, P, variant, step=2):
    """A backend in ``variant`` with this round's metadata, steps ``< step`` run."""
    dec, _ = decode_classes(backend)
    B, N = len(lens), len(lens) * K
    layers = layers_for(lens)
    seq = torch.tensor(lens)
    ext = metadata.draft_extend_lens(seq, K, S, P)
    r, rpi, rows = build(lens, ext.tolist(), P, layers)
    new = torch.cat([rows[b, lens[b]:lens[b] + int(ext[b])] for b in range(B)]).long()
    loc = metadata.assign_draft_cache_locs(r.req_to_token, rpi, seq.to(DEV), new.to(DEV), K,
                                           S, P)
    batch = DraftBatch(rpi, seq.to(DEV), loc, None)
    q = torch.randn(N, HQ, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(N, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lyr = [AttentionLayer(i, D ** -0.5) for i in range(layers)]
    be = dec(r, K, S, **VARIANTS[variant])
    be.init_forward_metadata(batch)
    for i in range(step):
        be.forward(i, lyr[0], q, k, v)
    return be, batch, (q, k, v), lyr


def bench_decode(backend, lens, K, S, P, variant, bw, step=2):
    be, batch, (q, k, v), lyr = decode_setup(backend, lens, K, S, P, variant, step)
    B, N = len(lens), len(lens) * K
    t_meta = host_ms(lambda: be.init_forward_metadata(batch))
    t, how = timed(lambda lay: be.forward(step, lay, q, k, v), lyr)
    t_prefix = None
    if be.two_pass:
        common = dict(scale=D ** -0.5, softcap=0.0)
        t_prefix, _ = timed(lambda lay: be.prefix_pass(be._active, B, lay.layer_id, q,
                                                       common), lyr)
    floor = (sum(lens) + N * (step + 1)) * ROW_BYTES / bw * 1e3
    route = "/".join(map(str, be._route)) if variant == "auto" else ""
    return dict(ms=t, timing=how, floor_ms=floor, prefix_ms=t_prefix, meta_host_ms=t_meta,
                route=route)


def profile_parts(backend, lens, K, S, P, step=2) -> list[str]:
    """Per-part times of one two-pass step (graph-timed, us) and its eager kernels."""
    from specattn.backends.flash_attn import merge_states
    from specattn.backends.flash_attn._fused import history_merge
    from specattn.backends.flash_attn._tables import paged_pools

    be, batch, (q, k, v), lyr = decode_setup(backend, lens, K, S, P, "shared-v1", step)
    B, N = len(lens), len(lens) * K
    bufs, r = be._active, be.runner
    common = dict(scale=D ** -0.5, softcap=0.0)
    slot = bufs.loc[:B, :, step].reshape(-1)
    o_p, lse_p = be.prefix_pass(bufs, B, 0, q, common)
    k1, v1 = paged_pools(r, 0, 1)
    hist = dict(page_table=bufs.hist_pt[:N], seqused=bufs.hist_used[step, :N],
                cu_seqlens_q=bufs.cu_lane[:N + 1], max_seqlen_q=1, causal=False,
                with_lse=True, **common)
    o_h, lse_h = be.kernel(q, k1, v1, **hist)
    parts = {
        "KV write (write_kv)": lambda lay: r.write_kv(lay.layer_id, slot, k, v),
        "prefix pass (FA4)": lambda lay: be.prefix_pass(bufs, B, lay.layer_id, q, common),
        "v1: history pass (FA4)": lambda lay: be.kernel(q, *paged_pools(r, lay.layer_id, 1),
                                                        **hist),
        "v1: LSE merge (torch)": lambda lay: merge_states([o_p, o_h], [lse_p, lse_h],
                                                          q.dtype),
        "v1: whole step": lambda lay: be.forward(step, lay, q, k, v),
        "v2: history+merge (Triton)": lambda lay: history_merge(
            q, r.k_buffer[lay.layer_id], r.v_buffer[lay.layer_id], bufs.hist_pt, step + 1,
            o_p, lse_p, topk=K, chunks=1, **common),
    }
    lines = ["| part | us |", "|---|---|"]
    for name, fn in parts.items():
        t, how = timed(fn, lyr)
        lines.append(f"| {name} | {t * 1e3:.1f} ({how}) |")
    be.fused = True
    t, how = timed(lambda lay: be.forward(step, lay, q, k, v), lyr)
    lines.append(f"| v2: whole step | {t * 1e3:.1f} ({how}) |")
    for fused in (False, True):
        be.fused = fused
        be.forward(step, lyr[0], q, k, v)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                be.forward(step, lyr[0], q, k, v)
            torch.cuda.synchronize()
        lines.append(f"\nkernels of one eager step ({'v2 fused' if fused else 'v1'}), "
                     "device us per step:")
        for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:14]:
            if ev.device_time_total > 0:
                lines.append(f"  {ev.device_time_total / 5:8.1f}  x{ev.count // 5}  "
                             f"{ev.key[:90]}")
    return lines


def prefix_options(backend, lens, K, S, P) -> list[str]:
    """The prefix pass with FA4 options the glue does not set (pack_gqa, num_splits)."""
    be, batch, (q, k, v), lyr = decode_setup(backend, lens, K, S, P, "shared")
    B = len(lens)
    bufs = be._active
    fn = be.kernel.module.flash_attn_varlen_func
    lines = []
    from specattn.backends.flash_attn._tables import paged_pools

    for opts in (dict(), dict(pack_gqa=False), dict(num_splits=2)):
        def call(lay, opts=opts):
            kp, vp = paged_pools(be.runner, lay.layer_id, P)
            return fn(q, kp, vp, cu_seqlens_q=bufs.cu_req[:B + 1], max_seqlen_q=K,
                      seqused_k=bufs.seq[:B], page_table=bufs.prefix_pt[:B],
                      softmax_scale=D ** -0.5, causal=False, return_lse=True, **opts)
        try:
            t, how = timed(call, lyr, eager_fallback=False)
            lines.append(f"| prefix pass {opts or 'defaults'} | {t * 1e3:.1f} ({how}) |")
        except Exception as e:  # an option the sm90 kernel rejects
            msg = str(e).splitlines()[0][:100] if str(e) else ""
            lines.append(f"| prefix pass {opts} | rejected: {type(e).__name__}: {msg} |")
    return lines


def bench_extend(backend, lens, E, bw):
    _, ext_cls = decode_classes(backend)
    B = len(lens)
    layers = layers_for(lens)
    total = [n + E for n in lens]
    r, rpi, rows = build(total, [0] * B, 1, layers)
    loc = torch.cat([rows[b, lens[b]:total[b]] for b in range(B)]).long().to(DEV)
    batch = DraftExtendBatch(rpi, torch.tensor(total, device=DEV),
                             torch.full((B,), E, device=DEV), loc)
    T = B * E
    q = torch.randn(T, HQ, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(T, HKV, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    lyr = [AttentionLayer(i, D ** -0.5) for i in range(layers)]
    be = ext_cls(r)
    be.init_forward_metadata(batch)
    t_meta = host_ms(lambda: be.init_forward_metadata(batch))
    t, how = timed(lambda lay: be.forward(lay, q, k, v), lyr)
    floor = sum(total) * ROW_BYTES / bw * 1e3
    return dict(ms=t, timing=how, floor_ms=floor, prefix_ms=None, meta_host_ms=t_meta)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="gqa-long,gqa-small,gqa-paged,gqa-chain")
    ap.add_argument("--backend", default="fa4", choices=("fa4", "fa3"))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--signatures", action="store_true")
    args = ap.parse_args()
    if args.signatures:
        signatures()
        return
    random.seed(0)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {torch.cuda.get_device_name()}", flush=True)
    if args.profile:
        B, L, K, S, P = CASES["gqa-long"]
        print("\n".join(profile_parts(args.backend, [L] * B, K, S, P)), flush=True)
        for name in ("gqa-long",):
            B, L, K, S, P = CASES[name]
            print(f"{name}:\n" + "\n".join(prefix_options(args.backend, [L] * B, K, S, P)),
                  flush=True)
    results = []
    for name in args.cases.split(","):
        B, L, K, S, P = CASES[name]
        for lengths in ("uniform", "ragged") if name == "gqa-long" else ("uniform",):
            lens = [L] * B if lengths == "uniform" else [random.randint(L // 2, 3 * L // 2)
                                                         for _ in range(B)]
            if name == "extend":
                runs = {"extend": lambda: bench_extend(args.backend, lens, S + 1, bw)}
            else:
                variants = ["shared-v1", "shared", "auto", "per-branch", "split2"]
                if K == 1:
                    variants = ["shared", "per-branch"]
                elif lengths == "ragged":
                    variants = ["shared-v1", "shared", "per-branch"]
                elif name == "gqa-small":
                    variants.append("split4")
                runs = {v: (lambda v=v: bench_decode(args.backend, lens, K, S, P, v, bw))
                        for v in variants}
            base = None
            for variant, fn in runs.items():
                try:
                    res = fn()
                except Exception as e:  # one failing variant must not hide the others
                    print(f"{name} {lengths} {variant}: FAILED {type(e).__name__}: {e}")
                    continue
                if variant == "per-branch":
                    base = res["ms"]
                res.update(case=name, lengths=lengths, variant=variant)
                results.append(res)
                print(f"{name} {lengths} {variant}: {res['ms'] * 1e3:.1f} us", flush=True)
                torch.cuda.empty_cache()
            for res in results:
                if res["case"] == name and res["lengths"] == lengths and base:
                    res["vs_per_branch"] = base / res["ms"]
    print("| case | lengths | variant | us | x floor | speedup vs per-branch | prefix us | "
          "metadata host us | timing |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        pre = f"{r['prefix_ms'] * 1e3:.0f}" if r["prefix_ms"] else "-"
        vs = f"{r['vs_per_branch']:.2f}" if r.get("vs_per_branch") else "-"
        var = r["variant"] + (f" ({r['route']})" if r.get("route") else "")
        print(f"| {r['case']} | {r['lengths']} | {var} | {r['ms'] * 1e3:.0f} | "
              f"{r['ms'] / r['floor_ms']:.2f} | {vs} | {pre} | {r['meta_host_ms'] * 1e3:.0f} | "
              f"{r['timing']} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "flash-attn-bench-v2.csv")
        keys = ["case", "lengths", "variant", "route", "ms", "floor_ms", "prefix_ms",
                "meta_host_ms", "vs_per_branch", "timing"]
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(results)
        print("wrote", path)


if __name__ == "__main__":
    main()
