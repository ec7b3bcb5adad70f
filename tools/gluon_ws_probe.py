"""Can Triton's Gluon express the warp-specialized MLA tile (issue #19's next step)? Compile
probes for sm90, no GPU needed.

The next Gluon MLA kernel splits the two consumer warpgroups' work by key tile instead of by
column (FlashMLA's "seesaw"): each warpgroup computes the whole ``[64, 64]`` S of its own
tile with one wgmma chain, and the two exchange P and their row statistics through shared
memory, signalled by mbarriers. That needs, inside ``gl.warp_specialize``:

1. ``warpgroup_mma`` in a worker partition as well as in the default one;
2. mbarrier signalling between the two (``mbarrier.arrive`` / ``mbarrier.wait``);
3. a P tile written by one partition (``shared_memory_descriptor.store``) and read as the A
   operand of the other's wgmma;
4. register budgets that hold a ``[64, 256]`` fp32 accumulator per consumer warpgroup
   (``worker_num_regs`` / ``maxnreg``).

``python tools/gluon_ws_probe.py`` (with a Triton 3.6 on the path, e.g.
``PYTHONPATH=/path/to/triton36``) compiles one kernel that does all four, at the MLA tile's
real sizes, and prints what the compiler made of it: wgmma and mbarrier counts in the PTX,
registers, spills and shared memory. The probe only shows that Gluon can express the pieces.
It does not compute attention, and it has not been run.

What it printed for sm90, with Triton 3.6.0 and with 3.9.0 (2026-11-30): 80 wgmma (40 per
warpgroup), 6 mbarrier ops, `setmaxnreg` in both partitions, 232 registers, no spills.
Shared memory is the limit. Q, two key tiles and two P buffers need 237,716 B, more than
sm90's 232,448 B per block. With one P buffer that the warpgroups take in turn, they need
229,524 B, which fits.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait)

N_KEYS = gl.constexpr(64)  # one key tile
D_MAIN = gl.constexpr(512)  # latent
D_PE = gl.constexpr(64)  # rope
D_HALF = gl.constexpr(256)  # each warpgroup's half of the 512-wide output


@gluon.jit
def _tile_product(q_smem, qpe_smem, k_smem, kpe_smem, p_smem, v_smem, bar_p, bar_back, Out,
                  out_col, HOLD_P: gl.constexpr):
    """One warpgroup's work on its tile: ``S = Q.K^T`` (N 64), P to shared memory for the
    other warpgroup, then ``O_half += P_other . V_half`` from the other's P."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    s = warpgroup_mma(q_smem, k_smem.permute((1, 0)),
                      gl.zeros([64, N_KEYS], gl.float32, s_layout), use_acc=False,
                      is_async=True)
    s = warpgroup_mma(qpe_smem, kpe_smem.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s])
    p = gl.exp2(s - gl.max(s, 1)[:, None])
    if HOLD_P:
        p_smem.index(0).store(p.to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(bar_p, count=1)
        mbarrier.wait(bar_back, 0)
        other = p_smem.index(1)
    else:
        p_smem.index(1).store(p.to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(bar_back, count=1)
        mbarrier.wait(bar_p, 0)
        other = p_smem.index(0)
    acc = warpgroup_mma(other, v_smem, gl.zeros([64, D_HALF], gl.float32, o_layout),
                        use_acc=False, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    cols = out_col + gl.arange(0, D_HALF, layout=gl.SliceLayout(0, o_layout))
    gl.store(Out + rows[:, None] * 512 + cols[None, :], acc)


@gluon.jit
def _default_wg(q_smem, qpe_smem, k_smem, kpe_smem, p_smem, bars, Out):
    _tile_product(q_smem, qpe_smem, k_smem.index(0), kpe_smem.index(0), p_smem,
                  k_smem.index(1).slice(0, D_HALF, dim=1), bars.index(0), bars.index(1), Out,
                  0, True)


@gluon.jit
def _worker_wg(q_smem, qpe_smem, k_smem, kpe_smem, p_smem, bars, Out):
    _tile_product(q_smem, qpe_smem, k_smem.index(1), kpe_smem.index(1), p_smem,
                  k_smem.index(0).slice(D_HALF, D_HALF, dim=1), bars.index(0), bars.index(1),
                  Out, 256, False)


@gluon.jit
def ws_probe_kernel(Q, K, Out):
    """4 + 4 warps: two consumer warpgroups at the MLA tile's sizes (Q ``[64, 512 + 64]``,
    two key tiles ``[64, 512 + 64]``, P ``[2, 64, 64]``; each warpgroup's V half is a column
    slice of the other's key tile, as in the real kernel). The inputs are put in shared memory
    with plain loads, so the probe is only about the partitions."""
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, D_MAIN], gl.bfloat16)
    pe_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, D_PE], gl.bfloat16)
    p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, N_KEYS], gl.bfloat16)
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, D_MAIN, layout=gl.SliceLayout(0, ld))
    pe_cols = D_MAIN + gl.arange(0, D_PE, layout=gl.SliceLayout(0, ld))
    row_w = D_MAIN + D_PE
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [64, D_MAIN], q_sl,
                                       gl.load(Q + rows[:, None] * row_w + cols[None, :]))
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [64, D_PE], pe_sl,
                                         gl.load(Q + rows[:, None] * row_w + pe_cols[None, :]))
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D_MAIN], q_sl)
    kpe_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D_PE], pe_sl)
    for t in gl.static_range(2):
        k_rows = K + (t * 64 + rows[:, None]) * row_w
        k_smem.index(t).store(gl.load(k_rows + cols[None, :]))
        kpe_smem.index(t).store(gl.load(k_rows + pe_cols[None, :]))
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, N_KEYS], p_sl)
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)
    fence_async_shared()
    args = (q_smem, qpe_smem, k_smem, kpe_smem, p_smem, bars, Out)
    gl.warp_specialize([(_default_wg, args), (_worker_wg, args)], [4], [232])


def compile_probe():
    from triton_ir_stats import _compile

    return _compile(ws_probe_kernel, {}, 4, 3, gluon=True, ptrs={"K": "*bf16", "Out": "*fp32"},
                    maxnreg=232)


def main() -> None:
    from triton_ir_stats import resources

    k = compile_probe()
    ptx = k.asm["ptx"]
    print("wgmma.mma_async:", ptx.count("wgmma.mma_async"),
          "| mbarrier ops:", ptx.count("mbarrier."),
          "| setmaxnreg:", ptx.count("setmaxnreg"),
          "|", resources(k))


if __name__ == "__main__":
    main()
