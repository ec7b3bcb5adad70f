"""Eager forwards of one standard case for a profiler (Nsight Compute), on a CUDA GPU.

Usage, e.g. the MLA stage-1 kernel's stall reasons at mla-long:
``ncu --kernel-name regex:_mla_partial --launch-skip 2 --launch-count 1 --section
WarpStateStats python benchmarks/ncu_triton.py mla-long``. Same inputs as ``bench_triton.py``
(one layer, step 2), no CUDA graph (so the profiler sees each launch).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

import bench_triton as bt  # noqa: E402
from specattn.data import AttentionLayer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=[c for c in bt.CASES if c != "extend"])
    ap.add_argument("--steps", type=int, default=5, help="forwards to run (draft steps)")
    args = ap.parse_args()
    from specattn.backends.triton import TritonDecode

    model, B, L, K, S, P = bt.CASES[args.case]
    r, batch, q, k, v, scale = bt.decode_inputs(model, B, [L] * B, K, S, P, 1)
    be = TritonDecode(r, K, S)
    be.init_forward_metadata(batch)
    lay = AttentionLayer(0, scale)
    for step in range(min(args.steps, S)):
        be.forward(step, lay, q, k, v)
    torch.cuda.synchronize()
    print(f"{args.case}: {min(args.steps, S)} forwards, plan {be._round_plan['cfg'].label()}, "
          f"{be._round_plan['num_splits']} splits")


if __name__ == "__main__":
    main()
