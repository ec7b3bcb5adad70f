"""Hashes of the CuTe-DSL MLA decode kernel's sm90a PTX for five variants, compiled here
without a GPU. A source change whose hashes match the last H200-verified ones compiles to
the same kernel, so the GPU record still holds for it (``gpu-check-s10.md``, "After the last
device call").

Variants: bf16 H16 lane mode, a cluster of 3; fp16 H128 path mode, logit cap, 1 split,
int64 parents; bf16 H16 path mode, a cluster of 8, int64 tables; bf16 H16 lane mode, 2
clusters of 2 (partials merged by a second launch); fp16 H16 lane mode, 4 clusters of 1.

    PYTHONPATH=/tmp/cute-site/nvidia_cutlass_dsl/dsl_packages:/tmp/cute-site \\
        /tmp/cute-venv/bin/python tools/cute_ptx_hashes.py

(The CuTe-DSL setup is in ``tools/cute_cluster_probe.py``; this one also needs torch in that
environment.) The H200-verified versions: ``cute-notes.md`` of each session.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
os.environ.setdefault("CUTE_DSL_DUMP_DIR", os.path.join(tempfile.gettempdir(), "specattn-cute"))
os.makedirs(os.environ["CUTE_DSL_DUMP_DIR"], exist_ok=True)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    import torch

    from specattn.backends.triton import cute_mla

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ptx-dir", default=None,
                    help="also write each variant's PTX there (variant-N.ptx)")
    args = ap.parse_args()
    variants = [(torch.bfloat16, 16, False, False, 3, 1, torch.int32, torch.int32),
                (torch.float16, 128, True, True, 1, 1, torch.int32, torch.int64),
                (torch.bfloat16, 16, True, False, 8, 1, torch.int64, torch.int64),
                (torch.bfloat16, 16, False, False, 2, 2, torch.int32, torch.int32),
                (torch.float16, 16, False, False, 1, 4, torch.int32, torch.int32)]
    hashes = []
    for n, (dtype, heads, path, cap, cluster, groups, r2t, parent) in enumerate(variants):
        compiled = cute_mla._compiled(dtype, heads, path, cap, True, cluster, groups, r2t,
                                      parent, options="--keep-ptx")
        hashes.append(hashlib.sha1(compiled.__ptx__.encode()).hexdigest()[:12])
        if args.ptx_dir:
            os.makedirs(args.ptx_dir, exist_ok=True)
            with open(os.path.join(args.ptx_dir, f"variant-{n}.ptx"), "w") as f:
                f.write(compiled.__ptx__)
    print(" ".join(hashes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
