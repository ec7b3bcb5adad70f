"""Same-run A/B of the two history + merge kernels on the H200 (issue #16), then delete
the loser.

``specattn.kernels.history_merge`` is now the one history + merge kernel (flashinfer,
flashmla and fa3/fa4 use it). fa3/fa4 used to run their own (``flash_attn/_fused.py``,
parked below unchanged as ``legacy_history_merge``): H200 notes measured the shared one at
7.9 us (flashinfer, gqa-long) and the old one at 18.8 us (fa4, gqa-long), in different runs
and at different call sites. This script times both at the fa4 call site in one process:

1. kernel alone (graph-timed, rotating input sets so each call reads past L2), on fa4's
   inputs: natural-log head-major LSE, ``C`` prefix chunk states, no fused KV write;
2. (with flash-attn-4) the whole fa4 decode step ``FA4Decode.forward``, once per kernel.

Cases: gqa-long (B 32, K 8, 32/8 heads, d 128, step 2: 3 history keys, C 1) and gqa-small
split 4 (B 4, K 4, C 4). Every output is checked against a torch fp32 reference first.

Run on the H200 (repo root):  python tools/history_merge_ab.py [--out results.md]
CPU smoke test (tiny shapes, Triton interpreter, no timing):
    TRITON_INTERPRET=1 python tools/history_merge_ab.py --smoke

After the A/B: keep the faster kernel. If the shared one wins (expected), delete this file;
otherwise port the old kernel's whole-tile history read into ``kernels/history_merge.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from specattn.kernels.history_merge import history_merge  # noqa: E402


# --- the old fa3/fa4 kernel (flash_attn/_fused.py at 15e7525), unchanged --------------------


def _pow2(x: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(x, 1) - 1).bit_length())


_KERNEL = None


def _kernel():
    """Compile-on-first-use, so importing the backend never needs Triton."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def history_merge_kernel(
            Q, Kc, Vc, Hist, PO, PLse, Out,
            stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ht,
            stride_pot, stride_poh, stride_plt, stride_plh, stride_ot, stride_oh,
            n_hist, topk, chunks, scale, softcap,
            GROUP: tl.constexpr, D: tl.constexpr, D_V: tl.constexpr, BLOCK_G: tl.constexpr,
            BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            USE_CAP: tl.constexpr):
        lane = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        offs_g = tl.arange(0, BLOCK_G)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        g_ok = offs_g < GROUP
        s_ok = offs_s < n_hist
        dv_ok = offs_dv < D_V
        head = kvh * GROUP + offs_g

        q = tl.load(Q + lane * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=g_ok[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
        slot = tl.load(Hist + lane * stride_ht + offs_s, mask=s_ok, other=0).to(tl.int64)
        k = tl.load(Kc + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                    mask=s_ok[:, None] & (offs_d < D)[None, :], other=0.0).to(tl.float32)
        v = tl.load(Vc + slot[:, None] * stride_vs + kvh * stride_vh + offs_dv[None, :],
                    mask=s_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
        # [G, S] scores by broadcast: G and S are too small for tl.dot's 16-row minimum.
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        if USE_CAP:  # softcap * tanh(s / softcap), tanh through the sigmoid
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        s = tl.where(s_ok[None, :], s, float("-inf"))
        m = tl.max(s, axis=1)  # finite: every lane has >= 1 history key
        p = tl.exp(s - m[:, None])
        den = tl.sum(p, axis=1)
        acc = tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [G, D_v]

        b = lane // topk
        j = lane - b * topk
        for c in range(chunks):
            row = (b * chunks + c) * topk + j
            lse = tl.load(PLse + row * stride_plt + head * stride_plh, mask=g_ok,
                          other=float("-inf"))
            ok = (lse > float("-inf")) & (lse < float("inf"))  # empty chunk: no weight
            lse = tl.where(ok, lse, float("-inf"))
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            o = tl.load(PO + row * stride_pot + head[:, None] * stride_poh + offs_dv[None, :],
                        mask=(g_ok & ok)[:, None] & dv_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + w[:, None] * o.to(tl.float32)
            den = den * alpha + w
            m = m_new

        out = acc / den[:, None]
        tl.store(Out + lane * stride_ot + head[:, None] * stride_oh + offs_dv[None, :],
                 out.to(Out.dtype.element_ty), mask=g_ok[:, None] & dv_ok[None, :])

    _KERNEL = history_merge_kernel
    return _KERNEL


def legacy_history_merge(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  hist_pt: torch.Tensor, n_hist: int, prefix_o: torch.Tensor,
                  prefix_lse: torch.Tensor, *, topk: int, chunks: int, scale: float,
                  softcap: float) -> torch.Tensor:
    """The old FA kernel's launcher (unchanged): attend each lane's ``n_hist`` history slots
    and merge with the prefix states.

    q: ``[N, H_q, D]``; k_pool/v_pool: ``[num_slots, H_kv, D | D_v]``; hist_pt: ``[N, >= n]``
    int; prefix_o: ``[N * C, H_q, D_v]``; prefix_lse: ``[N * C, H_q]`` (any strides).
    Returns ``[N, H_q, D_v]``. One launch, no host sync (CUDA-graph safe).
    """
    lanes, hq, d = q.shape
    hkv, dv = k_pool.shape[1], v_pool.shape[-1]
    group = hq // hkv
    out = torch.empty(lanes, hq, dv, dtype=q.dtype, device=q.device)
    if lanes == 0:
        return out
    for name, t in (("q", q), ("k_pool", k_pool), ("v_pool", v_pool), ("prefix_o", prefix_o)):
        if t.stride(-1) != 1:  # internal invariant: the glue passes unit-stride views
            raise ValueError(f"history_merge: {name} needs unit stride in its last dim")
    _kernel()[(lanes, hkv)](
        q, k_pool, v_pool, hist_pt, prefix_o, prefix_lse, out,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0),
        v_pool.stride(1), hist_pt.stride(0), prefix_o.stride(0), prefix_o.stride(1),
        prefix_lse.stride(0), prefix_lse.stride(1), out.stride(0), out.stride(1),
        n_hist, topk, chunks, float(scale), float(softcap) if softcap > 0 else 1.0,
        GROUP=group, D=d, D_V=dv, BLOCK_G=_pow2(group), BLOCK_S=_pow2(hist_pt.shape[1]),
        BLOCK_D=_pow2(d, 16), BLOCK_DV=_pow2(dv, 16), USE_CAP=softcap > 0, num_warps=4)
    return out


# --- inputs, reference, timing ---------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    bs: int
    topk: int
    hq: int
    hkv: int
    d: int
    n_hist: int
    chunks: int


CASES = [Case("gqa-long", 32, 8, 32, 8, 128, 3, 1),
         Case("gqa-small-split4", 4, 4, 32, 8, 128, 3, 4)]
SMOKE = [Case("smoke", 2, 3, 4, 2, 16, 3, 1), Case("smoke-split2", 2, 3, 4, 2, 16, 2, 2)]


def make_inputs(case: Case, dev: str, gen: torch.Generator, slots: int = 1 << 16):
    """One call's inputs as fa4 passes them: q ``[N, H_q, D]``, pools ``[slots, H_kv, D]``,
    hist ``[N, S]`` (first ``n_hist`` columns used), prefix o ``[N*C, H_q, D]`` and its LSE
    as a token-major view of a head-major ``[H_q, N*C]`` tensor (one chunk in five empty:
    -inf, one +inf as FA3 marks it)."""
    lanes, rows = case.bs * case.topk, case.bs * case.topk * case.chunks
    bf = torch.bfloat16
    q = torch.randn(lanes, case.hq, case.d, generator=gen).to(bf).to(dev)
    k = torch.randn(slots, case.hkv, case.d, generator=gen).to(bf).to(dev)
    v = torch.randn(slots, case.hkv, case.d, generator=gen).to(bf).to(dev)
    hist = torch.randint(0, slots, (lanes, 5), generator=gen, dtype=torch.int32).to(dev)
    po = torch.randn(rows, case.hq, case.d, generator=gen).to(bf).to(dev)
    lse_hm = (torch.randn(case.hq, rows, generator=gen) * 3 + 4).to(dev)
    if case.chunks > 1:
        lse_hm[:, ::5] = float("-inf")
        lse_hm[:, 1] = float("inf")
    return q, k, v, hist, po, lse_hm.t()


def reference(case: Case, q, k, v, hist, po, lse, scale) -> torch.Tensor:
    """fp32: softmax over the chunk states (by LSE) and the history keys together."""
    lanes = q.shape[0]
    group = case.hq // case.hkv
    b, j = torch.arange(lanes) // case.topk, torch.arange(lanes) % case.topk
    slots = hist[:, :case.n_hist].long()
    kk = k[slots].float().repeat_interleave(group, 2)  # [N, n, H_q, D]
    vv = v[slots].float().repeat_interleave(group, 2)
    s = torch.einsum("nhd,nthd->nht", q.float(), kk) * scale
    lse_h = torch.logsumexp(s, -1)
    o_h = torch.einsum("nht,nthd->nhd", torch.softmax(s, -1), vv)
    outs, lses = [o_h], [lse_h]
    for c in range(case.chunks):
        row = ((b * case.chunks + c) * case.topk + j).to(q.device)
        lc = lse[row].float()
        outs.append(torch.where(torch.isfinite(lc)[..., None], po[row].float(), 0.0))
        lses.append(torch.where(torch.isfinite(lc), lc, float("-inf")))
    w = torch.softmax(torch.stack(lses), 0)
    return sum(w[i][..., None] * o for i, o in enumerate(outs))


def run_shared(case, q, k, v, hist, po, lse, scale):
    return history_merge(q, k, v, hist[:, :case.n_hist], po, lse, scale, 0.0, lse_base="e",
                         chunks=case.chunks, topk=case.topk, inf_is_empty=True)


def run_legacy(case, q, k, v, hist, po, lse, scale):
    return legacy_history_merge(q, k, v, hist, case.n_hist, po, lse, topk=case.topk,
                                chunks=case.chunks, scale=scale, softcap=0.0)


KERNELS = {"shared (kernels/history_merge.py)": run_shared,
           "legacy (flash_attn/_fused.py)": run_legacy}


def graph_us(fn, sets) -> float:
    """Median us of one call: a CUDA graph calls ``fn`` once per input set (together more
    than L2), replayed; median of ``triton.testing.do_bench``."""
    import triton

    for s in sets:
        fn(*s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for s in sets:
            fn(*s)
    return triton.testing.do_bench(g.replay, warmup=25, rep=200,
                                   return_mode="median") * 1e3 / len(sets)


def kernel_ab(cases, dev, timing: bool, rounds: int = 3) -> list[str]:
    lines = ["| case | kernel | max abs err vs fp32 ref | us per call (median of rounds) |",
             "|---|---|---|---|"]
    for case in cases:
        gen = torch.Generator().manual_seed(16)
        scale = case.d ** -0.5
        sets = [make_inputs(case, dev, gen) for _ in range(8 if timing else 1)]
        want = reference(case, *sets[0], scale)
        times = {name: [] for name in KERNELS}
        errs = {}
        for name, run in KERNELS.items():
            got = run(case, *sets[0], scale).float()
            assert torch.isfinite(got).all(), name
            errs[name] = (got - want).abs().max().item()
            assert errs[name] < 3e-2, f"{case.name} {name}: max abs err {errs[name]}"
        for _ in range(rounds if timing else 0):  # interleaved: A B A B ...
            for name, run in KERNELS.items():
                times[name].append(graph_us(lambda *s, r=run: r(case, *s, scale), sets))
        for name in KERNELS:
            t = f"{statistics.median(times[name]):.1f}" if times[name] else "-"
            lines.append(f"| {case.name} | {name} | {errs[name]:.2e} | {t} |")
    return lines


def fa4_step_ab(dev: str = "cuda", bs: int = 32, topk: int = 8, ctx: int = 4096,
                layers: int = 8, rounds: int = 3, timing: bool = True) -> list[str]:
    """The whole fa4 decode step (gqa-long: 32/8 heads, d 128, step 2 of 5) with each kernel
    (needs flash-attn-4: ``flash_attn.cute``)."""
    try:
        __import__("flash_attn.cute")
    except Exception as exc:  # noqa: BLE001
        return [f"fa4 step A/B skipped: flash_attn.cute does not import ({exc})"]
    import specattn.kernels.history_merge as shared_module
    from specattn import metadata
    from specattn.backends.flash_attn import FA4Decode
    from specattn.data import AttentionLayer, DraftBatch, DraftRunner

    steps = 5
    runner = DraftRunner.mha(32, 8, 128, num_layers=layers,
                             num_slots=bs * (ctx + topk * steps) + 64, max_reqs=bs,
                             max_context_len=ctx + topk * steps, device=dev)
    for p in runner.k_buffer + runner.v_buffer:
        p.normal_()
    seq = torch.full((bs,), ctx, device=dev)
    rpi = torch.arange(bs, device=dev)
    runner.req_to_token[:, :ctx] = torch.arange(bs * ctx, device=dev).view(bs, ctx).int()
    new = torch.arange(bs * ctx, bs * (ctx + topk * steps), device=dev)
    loc = metadata.assign_draft_cache_locs(runner.req_to_token, rpi, seq, new, topk, steps, 1)
    backend = FA4Decode(runner, topk, steps, mode="shared")
    backend.init_forward_metadata(DraftBatch(rpi, seq, loc))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(bs * topk, h, 128, generator=gen).bfloat16().to(dev)
               for h in (32, 8, 8))
    lyr = [(AttentionLayer(i, 128 ** -0.5),) for i in range(layers)]

    def legacy_adapter(q, k_pool, v_pool, hist, o_p, lse_p, scale, cap, lse_base="e", *,
                       chunks=1, topk=1, inf_is_empty=True):
        return legacy_history_merge(q, k_pool, v_pool, hist, hist.shape[1], o_p, lse_p,
                                    topk=topk, chunks=chunks, scale=scale, softcap=cap)

    variants = {"shared (kernels/history_merge.py)": shared_module.history_merge,
                "legacy (flash_attn/_fused.py)": legacy_adapter}
    outs, times = {}, {name: [] for name in variants}
    original = shared_module.history_merge
    try:
        for name, fn in variants.items():
            shared_module.history_merge = fn  # fa4 imports it at each call
            for step in range(3):
                outs[name] = backend.forward(step, lyr[0][0], q, k, v).float()
        for _ in range(rounds if timing else 0):
            for name, fn in variants.items():
                shared_module.history_merge = fn
                times[name].append(graph_us(lambda lay: backend.forward(2, lay, q, k, v), lyr))
    finally:
        shared_module.history_merge = original
    a, b = outs.values()
    lines = ["", f"fa4 decode step (B {bs}, K {topk}, L {ctx}), step 2: outputs agree to "
             f"{(a - b).abs().max().item():.2e}", "",
             "| kernel | us per step (median of rounds) |", "|---|---|"]
    lines += [f"| {n} | {statistics.median(t):.1f} |" if t else f"| {n} | - |"
              for n, t in times.items()]
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument("--out", help="also write the tables to this markdown file")
    args = ap.parse_args()
    if args.smoke:
        lines = kernel_ab(SMOKE, "cpu", timing=False)
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --smoke)", file=sys.stderr)
            return 2
        lines = [f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", ""]
        lines += kernel_ab(CASES, "cuda", timing=True) + fa4_step_ab()
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
