"""Compile the Triton stage-1 kernel for sm90 on any machine (no GPU needed) and count what
decides its speed: asynchronous copies (software-pipelined loads), plain global loads, MMAs.

Why: on the H200 the ``kv_write="tail"``/``"first"`` variants of the generic kernel were
+15 us at gqa-long (``benchmarks/results/2026-11-29-h200/triton-fusion-ab-*.md``); compiling
them here showed the tail loop losing its ``cp.async`` pipeline when its K/V row pointers
come from a ``tl.where`` (async copies 14 -> 7, global loads 7 -> 167). Check a kernel change
here first, then spend device time on the variants that keep their pipelines
(``specattn bench --option 'triton:config=...'``).

Usage: ``python tools/triton_ir_stats.py [--new-kv 0 1 2] [--mla [N,W,S ...]]
[--gluon [N,S[,ov][,pf][,ws][,wl] ...]] [--dump DIR]``; also prints registers, spills (local memory) and shared memory (gqa-long
shape: 32 q heads, 8 KV heads, head dim 128, K = 8 -> 32-row tiles, block_n 64, 4 warps,
3 stages; the same specialisation of pointers and strides as at run time).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

_PTR = {"Q": "*bf16", "Kb": "*bf16", "Vb": "*bf16", "Kin": "*bf16", "Vin": "*bf16", "KV": "*bf16",
        "Out": "*bf16", "MidO": "*fp32", "MidLse": "*fp32", "Counter": "*i32",
        "ReqToToken": "*i32", "Meta": "*i32", "Hist": "*i32", "Parents": "*i64", "Work": "*i32"}


def _compile(fn, const: dict, num_warps: int, num_stages: int, gluon: bool = False,
             ptrs: Optional[dict] = None, **options):
    """Compile ``fn`` for sm90 with ``const`` constexprs; argument types from ``_PTR`` (and
    ``ptrs``, which overrides it), pointers and strides 16-divisible; ``options`` go to the
    compiler (``maxnreg``, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    else:
        from triton.compiler import ASTSource

    names = fn.arg_names
    types = {**_PTR, **(ptrs or {})}
    sig = {a: "constexpr" if a in const else types.get(a, "fp32" if a in ("sm_scale", "logit_cap")
                                                      else "i32") for a in names}
    # Pointers and strides divisible by 16, as Triton specialises them at run time.
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
             if sig[a].startswith("*") or a.startswith("stride")}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages, **options))


def compile_stage1(new_kv: int, mode: int = 0):
    """The generic kernel at the gqa-long shape (m32 n64 w4 s3, the default config)."""
    from specattn.backends.triton import _attn_kernels as K

    const = dict(NUM_KV_HEADS=8, GROUP=4, MODE=mode, D_MAIN=128, D_PE=0, D_V=128,
                 BLOCK_D=128, BLOCK_DPE=16, BLOCK_DV=128, V_IS_K=False, BLOCK_M=32,
                 BLOCK_N=64, USE_CAP=False, NEW_KV=new_kv, BLOCK_KW=128, FUSE_MERGE=False,
                 BLOCK_P=8, DOT_PREC="tf32", DOT_F32=False)
    return _compile(K._partial_attn_kernel, const, 4, 3)


def compile_mla(new_kv: int, block_n: int = 64, num_warps: int = 8, num_stages: int = 2):
    """The MLA v3 kernel at the mla-long shape (16 heads x K 4 = one 64-row tile)."""
    from specattn.backends.triton import _attn_kernels as K

    const = dict(GROUP=16, MODE=0, D_HALF=256, D_PE=64, BLOCK_H=256, BLOCK_DPE=64,
                 ACC_B_W=256, DV_SPLIT=1, V_RELOAD=False, BLOCK_M=64, BLOCK_N=block_n,
                 USE_CAP=False, NEW_KV=new_kv, BLOCK_KW=1024, FUSE_MERGE=False, BLOCK_P=4,
                 DOT_PREC="tf32", DOT_F32=False)
    return _compile(K._mla_partial_kernel, const, num_warps, num_stages)


def compile_gluon(new_kv: int, block_n: int = 64, num_stages: int = 2, overlap: bool = False,
                  prefetch: bool = False, mode: int = 0, ws: bool = False, wl: bool = False):
    """The Gluon MLA kernel at the mla-long shape (16 heads x K 4, one 64-row tile); ``ws``:
    the warp-specialized one (4 warps + a 4-warp partition); ``wl``: the work-list one."""
    const = dict(H=16, MODE=mode, BLOCK_N=block_n, NUM_STAGES=num_stages, PREFETCH=prefetch,
                 USE_CAP=False, WRITE_NEW=new_kv == 2)
    if wl:
        from specattn.backends.triton import _gluon_mla_wl_kernel as L

        return _compile(L._gluon_mla_wl_kernel, const, 8, num_stages, gluon=True)
    const["DIRECT_OUT"] = False
    if ws:
        from specattn.backends.triton import _gluon_mla_ws_kernel as W

        return _compile(W._gluon_mla_ws_kernel, const, 4, num_stages, gluon=True)
    from specattn.backends.triton import _gluon_mla_kernel as G

    return _compile(G._gluon_mla_kernel, dict(const, OVERLAP=overlap, DIAG=0), 8, num_stages,
                    gluon=True)


def resources(kernel) -> str:
    """Registers per thread, local memory (spills) and shared memory of the cubin."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    regs = f"regs {found.group(1)}, stack {found.group(2)} B, local {found.group(3)} B" \
        if found else "regs ?"
    return f"{regs}, shared (dynamic) {kernel.metadata.shared} B"


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
    ap.add_argument("--mla", nargs="*", default=None, metavar="N,W,S",
                    help="the MLA v3 kernel instead, one config per block_n,warps,stages "
                         "(default: 64,8,2)")
    ap.add_argument("--gluon", nargs="*", default=None, metavar="N,S[,ov][,pf][,ws][,wl]",
                    help="the Gluon MLA kernel instead (NEW_KV 2 only), one config per "
                         "block_n,stages plus flags ov (overlap) / pf (prefetch) / ws (the "
                         "warp-specialized kernel) / wl (the work-list kernel); default 64,2")
    args = ap.parse_args()
    if args.gluon is not None:
        variants = []
        for c in args.gluon or ["64,2"]:
            n, st, *flags = c.split(",")
            variants.append((f"Gluon n{n} s{st} {' '.join(flags)}".strip(), compile_gluon,
                             (2, int(n), int(st), "ov" in flags, "pf" in flags, 0,
                              "ws" in flags, "wl" in flags)))
    elif args.mla is not None:
        variants = [(f"MLA n{n} w{w} s{st} NEW_KV={nk}", compile_mla, (nk, n, w, st))
                    for n, w, st in (tuple(map(int, c.split(","))) for c in args.mla or ["64,8,2"])
                    for nk in args.new_kv]
    else:
        variants = [(f"NEW_KV={nk}", compile_stage1, (nk,)) for nk in args.new_kv]
    for label, build, build_args in variants:
        k = build(*build_args)
        print(f"{label}: " + ", ".join(f"{n} {v}" for n, v in stats(k).items()) +
              f"; {resources(k)}", flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            for ext in ("ttgir", "ptx"):
                name = label.replace(" ", "_").replace("=", "")
                with open(os.path.join(args.dump, f"{name}.{ext}"), "w") as f:
                    f.write(k.asm[ext])


if __name__ == "__main__":
    main()
