"""Benchmark the Triton backend per ``performance.md`` (one step, one layer).

For each standard case (uniform and ragged lengths): time of one ``forward`` (KV write +
split-KV attention + merge) at draft step 2 (3 history tokens), median of
``triton.testing.do_bench``, with layers rotated so the KV read each call is larger than L2;
the copy-bandwidth floor measured in the same process; the ratio to the floor and to the
``per-branch`` mode. ``--sweep`` also tries block configurations on the long cases.

Usage: ``python benchmarks/bench_triton.py [--out DIR] [--sweep] [--cases a,b]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import copy_bandwidth, run_line, timed  # noqa: E402
from specattn import metadata  # noqa: E402
from specattn.data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner  # noqa: E402

DEV = "cuda"
CASES = {
    # name: (model, B, L, K, S, P)
    "gqa-long": ("mha", 32, 4096, 8, 5, 1),
    "gqa-long-k1": ("mha", 32, 4096, 1, 5, 1),
    "gqa-chain": ("mha", 64, 2048, 1, 4, 1),
    "gqa-paged": ("mha", 32, 4096, 4, 5, 16),
    "gqa-small": ("mha", 4, 1024, 4, 5, 1),
    "mla-long": ("mla", 32, 4096, 4, 5, 1),
    "mla-long-p64": ("mla", 32, 4096, 4, 5, 64),
    # Not a standard case: issue #4's ">= 3x vs per-branch at K = 8" for MLA.
    "mla-long-k8": ("mla", 32, 4096, 8, 5, 1),
    "extend": ("mha", 32, 4096, 0, 5, 1),
}
L2_BYTES = 50 * 2 ** 20


def row_bytes(r: DraftRunner) -> int:
    if r.use_mla_backend:
        return (r.kv_lora_rank + r.qk_rope_head_dim) * 2
    return r.num_kv_heads * (r.head_dim + r.v_head_dim) * 2


_CACHE: dict = {}


def build(model, B, lens, K, S, P, layers):
    """Runner + request rows, cached for the last key (sweeps reuse one setup)."""
    key = (model, B, tuple(lens), K, S, P, layers)
    if key not in _CACHE:
        _CACHE.clear()
        torch.cuda.empty_cache()
        _CACHE[key] = _build(model, B, lens, K, S, P, layers)
    return _CACHE[key]


def _build(model, B, lens, K, S, P, layers):
    extra = metadata.max_draft_extend_len(max(K, 1), S, P) if K else 0
    num_slots = sum(lens) + B * extra + 16
    max_ctx = max(lens) + extra + P
    if model == "mha":
        r = DraftRunner.mha(32, 8, 128, num_layers=layers, num_slots=num_slots, max_reqs=B,
                            max_context_len=max_ctx, page_size=P, device=DEV)
        pools = r.k_buffer + r.v_buffer
    else:
        r = DraftRunner.mla(16, 512, 64, num_layers=layers, num_slots=num_slots, max_reqs=B,
                            max_context_len=max_ctx, page_size=P, device=DEV)
        pools = r.kv_buffer
    for p in pools:
        p.normal_()
    # Page-granular slots (pages shuffled), as a paged allocator hands them out.
    pages = torch.randperm(triton_cdiv(num_slots, P), device=DEV)
    slots = (pages[:, None] * P + torch.arange(P, device=DEV)).reshape(-1)
    slots = slots[slots < num_slots].to(torch.int32)
    used = 0
    rpi = torch.randperm(B, device=DEV)
    for b, L in enumerate(lens):
        n = triton_cdiv(L, P) * P
        r.req_to_token[rpi[b], :L] = slots[used:used + L]
        used += n
    seq = torch.tensor(lens, device=DEV)
    return r, rpi, seq, slots, used


def triton_cdiv(a, b):
    return -(-a // b)


def decode_inputs(model, B, lens, K, S, P, layers):
    """A draft round of a standard case: ``(runner, batch, q, k, v, scale)`` (bf16; ``v``
    None for MLA), pools random, slots page-shuffled."""
    r, rpi, seq, slots, used = build(model, B, lens, K, S, P, layers)
    n_new = int(metadata.draft_extend_lens(seq, K, S, P).sum())
    # Idempotent: same slots written to the same rows on every call.
    loc = metadata.assign_draft_cache_locs(r.req_to_token, rpi, seq,
                                           slots[used:used + n_new].long(), K, S, P)
    batch = DraftBatch(rpi, seq, loc, None)
    N = B * K
    if model == "mha":
        q = torch.randn(N, 32, 128, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(N, 8, 128, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(N, 8, 128, device=DEV, dtype=torch.bfloat16)
        return r, batch, q, k, v, 128 ** -0.5
    q = torch.randn(N, 16, 576, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(N, 576, device=DEV, dtype=torch.bfloat16)
    return r, batch, q, k, None, 576 ** -0.5


def bench_decode(model, B, lens, K, S, P, mode, bw, config=None, waves=None, step=2):
    from specattn.backends.triton import TritonDecode

    per_layer = (sum(lens) + B * K * S) * (row_bytes_shape(model))
    layers = max(2, min(12, triton_cdiv(3 * L2_BYTES, per_layer)))
    r, batch, q, k, v, scale = decode_inputs(model, B, lens, K, S, P, layers)
    be = TritonDecode(r, K, S, mode=mode, config=config, split_waves=waves)
    be.init_forward_metadata(batch)
    N = B * K
    lyr = [AttentionLayer(i, scale) for i in range(layers)]
    for i in range(step):
        be.forward(i, lyr[0], q, k, v)
    t = _graph_time(lambda lay: be.forward(step, lay, q, k, v), lyr)
    kv_bytes = (sum(lens) + N * (step + 1)) * row_bytes(r)
    io_bytes = q.numel() * 2 + N * r.num_q_heads * r.v_head_dim * 2
    floor = (kv_bytes + io_bytes) / bw * 1e3
    plan = be._round_plan
    return t, floor, dict(splits=plan["num_splits"], cfg=plan["cfg"])


def row_bytes_shape(model):
    return 576 * 2 if model == "mla" else 8 * 256 * 2


def bench_extend(B, lens, S, bw, config=None, waves=None):
    from specattn.backends.triton import TritonExtend

    E = S + 1
    per_layer = sum(lens) * row_bytes_shape("mha")
    layers = max(2, min(12, triton_cdiv(3 * L2_BYTES, per_layer)))
    r, rpi, seq, slots, used = build("mha", B, lens, 0, S, 1, layers)
    loc = torch.cat([r.req_to_token[rpi[b], L - E:L].long() for b, L in enumerate(lens)])
    batch = DraftExtendBatch(rpi, seq, torch.full((B,), E, device=DEV), loc)
    be = TritonExtend(r, config=config, split_waves=waves)
    be.init_forward_metadata(batch)
    T = B * E
    q = torch.randn(T, 32, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(T, 8, 128, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(T, 8, 128, device=DEV, dtype=torch.bfloat16)
    t = _graph_time(lambda lay: be.forward(lay, q, k, v),
                    [AttentionLayer(i, 128 ** -0.5) for i in range(layers)])
    floor = (sum(lens) * row_bytes(r) + 2 * q.numel() * 2) / bw * 1e3
    return t, floor, dict(splits=be._round_plan["num_splits"], cfg=be._round_plan["cfg"])


def _graph_time(fn, layers) -> float:
    """``timed`` without its eager fallback: here a failed capture is an error."""
    return timed(fn, layers, eager_fallback=False)[0]


def lens_for(B, L, ragged, rng):
    return [rng.randint(L // 2, 3 * L // 2) if ragged else L for _ in range(B)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--mla-config", default=None,
                    help="file with 'block_m block_n warps stages dv_split v_reload waves' "
                         "(sweep_triton.py's best) for the shared-prefix MLA cases")
    args = ap.parse_args()
    from specattn.backends.triton.launchers import KernelConfig

    rng = random.Random(0)
    mla_cfg, mla_waves = None, None
    if args.mla_config and os.path.exists(args.mla_config):
        f = open(args.mla_config).read().split()
        mla_cfg = KernelConfig(*map(int, f[:4]), mla_v3=True, dv_split=int(f[4]),
                               v_reload=bool(int(f[5])))
        mla_waves = float(f[6])
    os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth()
    head = (f"# Triton backend benchmark\n\n{run_line(bw)}\n\n"
            "One step (step 2: 3 history tokens), one layer, bf16, median of do_bench, "
            "KV write included.\n\n"
            "| case | lengths | time us | floor us | x floor | per-branch us | shared speedup "
            "| splits | config |\n|---|---|---|---|---|---|---|---|---|\n")
    print(head, end="", flush=True)
    rows = []
    for name in args.cases.split(","):
        model, B, L, K, S, P = CASES[name]
        for ragged in (False, True):
            lens = lens_for(B, L, ragged, rng)
            try:
                if name == "extend":
                    t, floor, info = bench_extend(B, lens, S, bw)
                    pb = None
                else:
                    cfg_w = (mla_cfg, mla_waves) if model == "mla" else (None, None)
                    t, floor, info = bench_decode(model, B, lens, K, S, P, "shared", bw,
                                                  *cfg_w)
                    pb = bench_decode(model, B, lens, K, S, P, "per-branch", bw)[0]
            except Exception as e:  # keep going: report the failure in the table
                line = f"| {name} | {'ragged' if ragged else 'uniform'} | FAILED: {e!r} |\n"
                print(line, end="", flush=True)
                rows.append(line)
                continue
            cfg = info["cfg"]
            line = (f"| {name} | {'ragged' if ragged else 'uniform'} | {t * 1e3:.1f} | "
                    f"{floor * 1e3:.1f} | {t / floor:.2f} | "
                    f"{'-' if pb is None else f'{pb * 1e3:.1f}'} | "
                    f"{'-' if pb is None else f'{pb / t:.2f}x'} | {info['splits']} | "
                    f"{cfg.label()} |\n")
            print(line, end="", flush=True)
            rows.append(line)
            with open(os.path.join(args.out, "triton-bench-partial.md"), "a") as f:
                f.write(line)
    text = head + "".join(rows)
    if args.sweep:
        text += "\n## Sweep (uniform lengths)\n\n| case | config | waves | time us | x floor |\n"
        text += "|---|---|---|---|---|\n"
        print("\n## sweep", flush=True)
        sweeps = {
            "gqa-long": [KernelConfig(32, bn, w, s) for bn in (32, 64, 128) for w in (4, 8)
                         for s in (2, 3)],
            "mla-long": [KernelConfig(bm, bn, w, 2) for bm in (16, 32, 64) for bn in (16, 32, 64)
                         for w in (4, 8)],
            "extend": [KernelConfig(32, bn, w, s) for bn in (64, 128) for w in (4, 8)
                       for s in (2, 3)],
        }
        for name, cfgs in sweeps.items():
            model, B, L, K, S, P = CASES[name]
            lens = [L] * B
            for cfg, waves in itertools.product(cfgs, (2.0, 6.0)):
                try:
                    if name == "extend":
                        t, floor, _ = bench_extend(B, lens, S, bw, cfg, waves)
                    else:
                        t, floor, _ = bench_decode(model, B, lens, K, S, P, "shared", bw, cfg,
                                                   waves)
                except Exception as e:
                    line = f"| {name} | {cfg} | {waves} | FAILED {type(e).__name__} | |\n"
                else:
                    line = (f"| {name} | m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} "
                            f"s{cfg.num_stages} | {waves} | {t * 1e3:.1f} | "
                            f"{t / floor:.2f} |\n")
                print(line, end="", flush=True)
                text += line
                with open(os.path.join(args.out, "triton-sweep.md"), "a") as f:
                    f.write(line)
    with open(os.path.join(args.out, "triton-bench.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
