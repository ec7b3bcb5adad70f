"""The Gluon MLA decode kernel against the floor, the ``tl.dot`` kernel and FlashInfer's MLA,
all in one process (issue #19's cases; one step, step 2: 3 history keys, one layer, bf16).

Per case and lengths: the copy-bandwidth floor (KV bytes + q/out bytes), then each variant
checked against ``torch_ref`` on two requests (relative error) and timed (median of
``do_bench`` over a CUDA graph of one forward per layer, layers rotated past L2). ``mla-wide``
also reports TFLOP/s against torch's bf16 matmul rate measured in the same process.

Usage: ``python benchmarks/bench_gluon_mla.py [--out DIR] [--cases a,b] [--variants a,b]
[--no-flashinfer] [--small]``; ``--small``: one small ragged round per variant checked
against ``torch_ref``, no timing (the compute-sanitizer run).
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import copy_bandwidth, run_line, timed  # noqa: E402
from specattn import metadata  # noqa: E402
from specattn.data import AttentionLayer, DraftBatch, DraftRunner  # noqa: E402

DEV = "cuda"
L2_BYTES = 50 * 2 ** 20
STEP = 2
CASES = {
    # name: (H, B, L, K, S, P, ragged too)
    "mla-long": (16, 32, 4096, 4, 5, 1, True),
    "mla-long-p64": (16, 32, 4096, 4, 5, 64, True),
    "mla-k1": (16, 32, 4096, 1, 5, 1, False),
    "mla-small": (16, 4, 1024, 4, 5, 1, False),
    "mla-wide": (128, 32, 4096, 2, 5, 1, False),
    "mla-wide-p64": (128, 32, 4096, 2, 5, 64, False),
}


def variants():
    from specattn.backends.triton.launchers import KernelConfig

    g = dict(kv_write="first", gluon=True)
    return {
        "gluon": None,  # the backend's default (launchers.gluon_config)
        "gluon-n64s2": KernelConfig(64, 64, 8, 2, **g),
        "gluon-n32s3": KernelConfig(64, 32, 8, 3, **g),
        "gluon-n32s4": KernelConfig(64, 32, 8, 4, **g),
        "gluon-n32s3-ov": KernelConfig(64, 32, 8, 3, gluon_overlap=True, **g),
        "gluon-n32s4-ov": KernelConfig(64, 32, 8, 4, gluon_overlap=True, **g),
        "tl.dot": "tl.dot",  # launchers.choose_config (the kernel before this one)
    }


def build(H, lens, K, S, P, layers):
    """MLA runner with ``layers`` random pools, page-shuffled slots, one draft round."""
    B = len(lens)
    extra = metadata.max_draft_extend_len(K, S, P)
    num_slots = sum(-(-L // P) * P for L in lens) + B * extra + 2 * P
    r = DraftRunner.mla(H, 512, 64, num_layers=layers, num_slots=num_slots, max_reqs=B,
                        max_context_len=max(lens) + extra + P, page_size=P, device=DEV)
    for p in r.kv_buffer:
        p.normal_()
    pages = torch.randperm(-(-num_slots // P), device=DEV)
    slots = (pages[:, None] * P + torch.arange(P, device=DEV)).reshape(-1)
    slots = slots[slots < num_slots].to(torch.int32)
    rpi = torch.randperm(B, device=DEV)
    used = 0
    for b, L in enumerate(lens):
        r.req_to_token[rpi[b], :L] = slots[used:used + L]
        used += -(-L // P) * P
    seq = torch.tensor(lens, device=DEV)
    n_new = int(metadata.draft_extend_lens(seq, K, S, P).sum())
    loc = metadata.assign_draft_cache_locs(r.req_to_token, rpi, seq,
                                           slots[used:used + n_new].long(), K, S, P)
    q = torch.randn(B * K, H, 576, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(B * K, 576, device=DEV, dtype=torch.bfloat16)
    return r, DraftBatch(rpi, seq, loc, None), q, k


def rel_error(r, layer, q, batch, out, K) -> float:
    """``|out - ref| / |ref|`` over the first two requests (``torch_ref``)."""
    from specattn.backends.torch_ref import reference_decode

    n = min(2, batch.batch_size)
    sub = DraftBatch(batch.req_pool_indices[:n], batch.seq_lens[:n], batch.out_cache_loc[:n],
                     None)
    ref = reference_decode(r, layer, q[:n * K], sub, STEP).float()
    got = out[:n * K].float()
    if torch.isnan(got).any():
        return float("nan")
    return float((got - ref).norm() / ref.norm())


def make_backend(name, cfg, r, K, S):
    if name == "flashinfer":
        from specattn.backends.flashinfer import FlashInferMLADecode

        return FlashInferMLADecode(r, K, S)
    from specattn.backends.triton import TritonDecode
    from specattn.backends.triton.launchers import AttnShape, choose_config

    if cfg == "tl.dot":
        cfg = choose_config(AttnShape.of(r), K * r.num_heads)
    return TritonDecode(r, K, S, config=cfg)


def measure(name, cfg, r, batch, q, k, layers, K, S, timing=True):
    """``(ms or None, relative error, kernel label)`` of one step-2 forward."""
    be = make_backend(name, cfg, r, K, S)
    B = batch.batch_size
    lyr = [AttentionLayer(i, 576 ** -0.5) for i in range(layers)]
    if name == "flashinfer":
        be.init_cuda_graph_state(B, B * K)
        be.init_forward_metadata_capture_cuda_graph(batch)
        label = "flashinfer"
    else:
        be.init_forward_metadata(batch)
        label = be._round_plan["cfg"].label() + f" splits {be._round_plan['num_splits']}"
    for i in range(STEP):
        be.forward(i, lyr[0], q, k, None)
    out = be.forward(STEP, lyr[0], q, k, None)
    err = rel_error(r, lyr[0], q, batch, out, K)
    ms = timed(lambda lay: be.forward(STEP, lay, q, k, None), lyr,
               eager_fallback=False)[0] if timing else None
    return ms, err, label


def matmul_rate() -> float:
    """bf16 TFLOP/s of an 8192^3 torch matmul on random data (median)."""
    import triton

    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


def small_check(names) -> int:
    """One small ragged round per variant vs torch_ref (compute-sanitizer)."""
    bad = 0
    for name in names:
        cfg = variants()[name]
        r, batch, q, k = build(16, [5, 300, 77], 4, 3, 1, 1)
        _, err, label = measure(name, cfg, r, batch, q, k, 1, 4, 3, timing=False)
        ok = err < 2e-2
        bad += not ok
        print(f"{name} ({label}): rel err {err:.2e} {'ok' if ok else 'FAILED'}", flush=True)
    return bad


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--variants", default=",".join(variants()))
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    names = args.variants.split(",")
    if args.small:
        return small_check(names)
    if not args.no_flashinfer:
        names.append("flashinfer")
    rng = random.Random(0)
    bw = copy_bandwidth()
    mm = matmul_rate()
    head = (f"# Gluon MLA decode benchmark\n\n{run_line(bw)} | bf16 matmul {mm:.0f} TFLOP/s\n\n"
            "One step (step 2), one layer, bf16, median of do_bench over a CUDA graph.\n\n"
            "| case | lengths | variant | us | x floor | vs flashinfer | TFLOP/s | % matmul "
            "| rel err | kernel |\n|---|---|---|---|---|---|---|---|---|---|\n")
    print(head, end="", flush=True)
    lines = [head]
    for case in args.cases.split(","):
        H, B, L, K, S, P, ragged_too = CASES[case]
        for ragged in (False, True) if ragged_too else (False,):
            lens = [rng.randint(L // 2, 3 * L // 2) if ragged else L for _ in range(B)]
            kv = (sum(lens) + B * K * (STEP + 1)) * 576 * 2
            layers = max(2, min(12, -(-3 * L2_BYTES // kv)))
            r, batch, q, k = build(H, lens, K, S, P, layers)
            io = q.numel() * 2 + B * K * H * 512 * 2
            floor_ms = (kv + io) / bw * 1e3
            flop = 2 * B * K * H * (sum(lens) / B + STEP + 1) * (576 + 512)
            res = {}
            for name in names:
                cfg = variants().get(name)
                try:
                    res[name] = measure(name, cfg, r, batch, q, k, layers, K, S)
                except Exception as e:  # keep going: the table says what failed
                    res[name] = (None, float("nan"), f"FAILED {type(e).__name__}: {e}"[:160])
            fi = res.get("flashinfer", (None,))[0]
            lab = "ragged" if ragged else "uniform"
            row = f"| {case} | {lab} | floor | {floor_ms * 1e3:.1f} | 1.00 | | | | | |\n"
            print(row, end="", flush=True)
            lines.append(row)
            for name, (ms, err, label) in res.items():
                if ms is None:
                    row = f"| {case} | {lab} | {name} | - | | | | | | {label} |\n"
                else:
                    tf = flop / (ms * 1e-3) / 1e12
                    vs = f"{fi / ms:.2f}x" if fi else ""
                    row = (f"| {case} | {lab} | {name} | {ms * 1e3:.1f} | {ms / floor_ms:.2f} | "
                           f"{vs} | {tf:.0f} | {100 * tf / mm:.0f}% | {err:.1e} | {label} |\n")
                print(row, end="", flush=True)
                lines.append(row)
            del r, batch, q, k
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gluon-bench.md"), "w") as f:
        f.write("".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
