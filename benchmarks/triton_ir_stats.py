"""Compile the Triton stage-1 kernel for sm90 on any machine (no GPU needed) and count what
decides its speed: asynchronous copies (software-pipelined loads), plain global loads, MMAs.

Why: on the H200 the ``kv_write="tail"``/``"first"`` variants of the generic kernel were
+15 us at gqa-long (``results/2026-11-29-h200/triton-fusion-ab-*.md``); compiling them here
showed the tail loop losing its ``cp.async`` pipeline when its K/V row pointers come from a
``tl.where`` (async copies 14 -> 7, global loads 7 -> 167). Check a kernel change here first,
then spend device time on the variants that keep their pipelines.

Usage: ``python benchmarks/triton_ir_stats.py [--new-kv 0 1 2] [--dump DIR]`` (gqa-long
shape: 32 q heads, 8 KV heads, head dim 128, K = 8 -> 32-row tiles, block_n 64, 4 warps,
3 stages; the same specialisation of pointers and strides as at run time).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

_PTR = {"Q": "*bf16", "Kb": "*bf16", "Vb": "*bf16", "Kin": "*bf16", "Vin": "*bf16",
        "Out": "*bf16", "MidO": "*fp32", "MidLse": "*fp32", "Counter": "*i32",
        "ReqToToken": "*i32", "Meta": "*i32", "Hist": "*i32", "Parents": "*i64"}


def compile_stage1(new_kv: int, mode: int = 0):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from specattn.backends.triton import _attn_kernels as K

    fn = K._partial_attn_kernel
    const = dict(NUM_KV_HEADS=8, GROUP=4, MODE=mode, D_MAIN=128, D_PE=0, D_V=128,
                 BLOCK_D=128, BLOCK_DPE=16, BLOCK_DV=128, V_IS_K=False, BLOCK_M=32,
                 BLOCK_N=64, USE_CAP=False, NEW_KV=new_kv, BLOCK_KW=128, FUSE_MERGE=False,
                 BLOCK_P=8, DOT_PREC="tf32", DOT_F32=False)
    names = fn.arg_names
    sig = {a: "constexpr" if a in const else _PTR.get(a, "fp32" if a in ("sm_scale", "logit_cap")
                                                     else "i32") for a in names}
    # Pointers and strides divisible by 16, as Triton specialises them at run time.
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
             if sig[a].startswith("*") or a.startswith("stride")}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, num_stages=3))


def stats(kernel) -> dict:
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    return {"async copies (ttgir)": ttgir.count("async_copy_global_to_local"),
            "cp.async (ptx)": ptx.count("cp.async."),
            "ld.global (ptx)": len(re.findall(r"ld\.global", ptx)),
            "mma.sync / wgmma (ptx)": f"{ptx.count('mma.sync')} / {ptx.count('wgmma.mma_async')}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-kv", type=int, nargs="+", default=[0, 1, 2],
                    help="NEW_KV codes: 0 pool (kv_write torch/kernel), 1 tail, 2 first")
    ap.add_argument("--dump", default=None, help="also write each variant's TTGIR and PTX here")
    args = ap.parse_args()
    for nk in args.new_kv:
        k = compile_stage1(nk)
        print(f"NEW_KV={nk}: " + ", ".join(f"{n} {v}" for n, v in stats(k).items()), flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                with open(os.path.join(args.dump, f"stage1-newkv{nk}.{ext}"), "w") as f:
                    f.write(k.asm[ext])


if __name__ == "__main__":
    main()
