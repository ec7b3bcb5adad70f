"""Sweep the Triton backend's v3 kernel variants on a GPU (one call, time-boxed).

Every variant is first checked against ``torch_ref`` at a ragged real-shape batch (same
compiled kernel as the timed case: bf16, lane mode, no logit cap), then timed like
``bench_triton.py`` (one ``forward`` at draft step 2, CUDA-graph replay over rotated layers,
ratio to the copy-bandwidth floor measured in the same run). Phases stop starting new
variants past their time box; rows are appended to ``$OUT/triton-sweep-v3.md`` as they come.

Usage: ``python benchmarks/sweep_triton.py [--out DIR] [--budget-s 150]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from bench_triton import CASES, bench_decode, bench_extend, decode_inputs, lens_for  # noqa: E402
from _common import copy_bandwidth  # noqa: E402
from specattn.backends.torch_ref import reference_decode  # noqa: E402
from specattn.data import AttentionLayer  # noqa: E402

DEV = "cuda"


def mla_variants():
    from specattn.backends.triton.launchers import KernelConfig as C

    # Most promising first: the phase is time-boxed.
    v3 = dict(mla_v3=True)
    return [
        C(64, 32, 8, 2, **v3), C(64, 32, 4, 2, dv_split=2, **v3),
        C(64, 64, 8, 2, dv_split=2, **v3), C(64, 32, 8, 2, dv_split=2, **v3),
        C(64, 64, 8, 2, **v3), C(64, 32, 8, 3, **v3), C(64, 32, 8, 2, v_reload=True, **v3),
        C(64, 64, 4, 2, dv_split=2, **v3), C(32, 32, 4, 2, **v3),
        C(64, 16, 4, 3, dv_split=2, **v3),
    ]


def check_decode(model, cfg, K=4, S=5, step=2, B=3, seed=0):
    """Max error of the step-``step`` output vs ``torch_ref`` (ragged lengths, lane mode)."""
    from specattn.backends.triton import TritonDecode

    rng = random.Random(seed)
    lens = [rng.randint(1500, 4500) for _ in range(B)]
    r, batch, *_ = decode_inputs(model, B, lens, K, S, 1, 1)
    be = TritonDecode(r, K, S, config=cfg)
    be.init_forward_metadata(batch)
    N, dt = B * K, torch.bfloat16
    lay = AttentionLayer(0, 576 ** -0.5 if model == "mla" else 128 ** -0.5)
    for i in range(step + 1):
        if model == "mla":
            q = torch.randn(N, 16, 576, device=DEV, dtype=dt)
            k, v = torch.randn(N, 576, device=DEV, dtype=dt), None
        else:
            q = torch.randn(N, 32, 128, device=DEV, dtype=dt)
            k = torch.randn(N, 8, 128, device=DEV, dtype=dt)
            v = torch.randn(N, 8, 128, device=DEV, dtype=dt)
        be._active.mid_o.fill_(float("nan"))
        out = be.forward(i, lay, q, k, v)
    ref = reference_decode(r, lay, q, batch, step, "lane")
    # Error relative to the output's scale (outputs are small: averages over ~3k keys).
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    if not torch.isfinite(out).all() or not err < 2e-2:
        raise AssertionError(f"mismatch vs torch_ref: max err / max |ref| = {err:.3g}")
    return err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=150.0)
    args = ap.parse_args()
    t0 = time.time()
    path = os.path.join(args.out, "triton-sweep-v3.md")
    bw = copy_bandwidth()

    def emit(line):
        print(line, flush=True)
        with open(path, "a") as f:
            f.write(line + "\n")

    import triton

    emit(f"# Triton v3 sweep\n\n{torch.cuda.get_device_name()} | torch {torch.__version__} | "
         f"triton {triton.__version__} | copy bandwidth {bw / 1e12:.2f} TB/s\n")
    emit("check err: max |out - torch_ref| / max |torch_ref| at a ragged batch (B 3).\n")
    emit("| case | config | waves | check err | time us | x floor | splits |")
    emit("|---|---|---|---|---|---|---|")
    model, B, L, K, S, P = CASES["mla-long"]
    lens = [L] * B
    best = None
    for cfg in mla_variants():
        if time.time() - t0 > 0.65 * args.budget_s:
            emit(f"| mla-long | {cfg.label()} | - | skipped (time box) | | | |")
            continue
        try:
            err = check_decode("mla", cfg)
            for waves in (1.0, 2.0):
                t, floor, info = bench_decode(model, B, lens, K, S, P, "shared", bw, cfg,
                                              waves)
                emit(f"| mla-long | {cfg.label()} | {waves} | {err:.1e} | {t * 1e3:.1f} | "
                     f"{t / floor:.2f} | {info['splits']} |")
                if best is None or t < best[0]:
                    best = (t, cfg, waves)
                    with open(os.path.join(args.out, "best_mla.txt"), "w") as f:
                        f.write(f"{cfg.block_m} {cfg.block_n} {cfg.num_warps} "
                                f"{cfg.num_stages} {cfg.dv_split} {int(cfg.v_reload)} "
                                f"{waves}\n")
        except Exception as e:  # report and go on
            emit(f"| mla-long | {cfg.label()} | - | FAILED {type(e).__name__}: "
                 f"{str(e).splitlines()[0][:80]} | | | |")
    if best is not None:
        t_pb, floor, info = bench_decode(model, B, lens, K, S, P, "per-branch", bw)
        emit(f"| mla-long per-branch | {info['cfg'].label()} | default | - | "
             f"{t_pb * 1e3:.1f} | {t_pb / floor:.2f} | {info['splits']} |")
        emit(f"\nbest mla-long: {best[1].label()} waves {best[2]}: {best[0] * 1e3:.1f} us, "
             f"{t_pb / best[0]:.2f}x vs per-branch\n")
    # GQA decode (tail fused into the last split): split waves around the default.
    model, B, L, K, S, P = CASES["gqa-long"]
    try:
        err = f"{check_decode('mha', None, K=8):.1e}"
    except Exception as e:
        err = f"FAILED {e}"
    for waves in (4.0, 6.0, 8.0):
        if time.time() - t0 > 0.85 * args.budget_s:
            break
        t, floor, info = bench_decode(model, B, [L] * B, K, S, P, "shared", bw, None, waves)
        emit(f"| gqa-long | {info['cfg'].label()} | {waves} | {err} | {t * 1e3:.1f} | "
             f"{t / floor:.2f} | {info['splits']} |")
    _, B, L, _, S, _ = CASES["extend"]
    for waves in (1.0, 2.0, 3.0):
        if time.time() - t0 > args.budget_s:
            break
        t, floor, info = bench_extend(B, lens_for(B, L, False, random.Random(0)), S, bw,
                                      None, waves)
        emit(f"| extend | {info['cfg'].label()} | {waves} | - | {t * 1e3:.1f} | "
             f"{t / floor:.2f} | {info['splits']} |")
    emit(f"\nsweep wall time {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
