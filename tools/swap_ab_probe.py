"""Prototype: FP8 GQA split-KV decode with swapped operands (keys as wgmma M, query rows as N).
Prefix only; partials (acc, m, l) per split. Times against a gather read floor."""
import itertools, sys, torch, triton, triton.language as tl


@triton.jit
def cvt16(x):
    return tl.inline_asm_elementwise(
        "{ .reg .b16 c<2>; mov.b32 {c0, c1}, $2; cvt.rn.f16x2.e4m3x2 $0, c0; "
        "cvt.rn.f16x2.e4m3x2 $1, c1; }", "=r,=r,r", [x], dtype=tl.float16,
        is_pure=True, pack=4)


@triton.jit
def swap_kernel(q, kp, vp, r2t, out, mo, lo, L, stride_r2t, sm_scale,
                H_KV: tl.constexpr, G: tl.constexpr, K_LANES: tl.constexpr, D: tl.constexpr,
                BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SWAP: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // (H_KV * SPLITS)
    h = (pid // SPLITS) % H_KV
    sp = pid % SPLITS
    ROWS: tl.constexpr = K_LANES * G
    r = tl.arange(0, ROWS)
    lane = r // G
    g = r % G
    d = tl.arange(0, D)
    qrow = (b * K_LANES + lane) * (H_KV * G) + h * G + g
    qt = tl.load(q + qrow[:, None] * D + d[None, :])
    qt = (qt.to(tl.float32) * 0.00390625).to(tl.float16)
    per = tl.cdiv(tl.cdiv(L, BLOCK_N), SPLITS) * BLOCK_N
    lo_k = sp * per
    hi_k = tl.minimum(lo_k + per, L)
    n = tl.arange(0, BLOCK_N)
    LOG2E: tl.constexpr = 1.4426950408889634
    scale = sm_scale * 256.0 * LOG2E
    if SWAP:
        qT = tl.trans(qt)  # [D, ROWS]
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([D, ROWS], tl.float32)
        for start in range(lo_k, hi_k, BLOCK_N):
            ok = start + n < hi_k
            slots = tl.load(r2t + b * stride_r2t + start + n, mask=ok, other=0)
            base = (slots.to(tl.int64) * H_KV + h) * D
            k = tl.load(kp + base[:, None] + d[None, :])
            s = tl.dot(cvt16(k), qT) * scale  # [BLOCK_N, ROWS]
            s = tl.where(ok[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            v = tl.load(vp + base[:, None] + d[None, :])
            vT = tl.trans(cvt16(v))  # [D, BLOCK_N]
            acc = acc * alpha[None, :] + tl.dot(vT, p.to(tl.float16))
            m_i = m_new
        o = tl.trans(acc)
    else:
        m_i = tl.full([ROWS], float("-inf"), tl.float32)
        l_i = tl.zeros([ROWS], tl.float32)
        o = tl.zeros([ROWS, D], tl.float32)
        for start in range(lo_k, hi_k, BLOCK_N):
            ok = start + n < hi_k
            slots = tl.load(r2t + b * stride_r2t + start + n, mask=ok, other=0)
            base = (slots.to(tl.int64) * H_KV + h) * D
            k = tl.load(kp + base[:, None] + d[None, :])
            s = tl.dot(qt, tl.trans(cvt16(k))) * scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vp + base[:, None] + d[None, :])
            o = o * alpha[:, None] + tl.dot(p.to(tl.float16), cvt16(v))
            m_i = m_new
    orow = (pid * ROWS + r)
    tl.store(out + orow[:, None] * D + d[None, :], o)
    tl.store(mo + orow, m_i)
    tl.store(lo + orow, l_i)


@triton.jit
def read_kernel(kp, vp, r2t, out, L, stride_r2t, H_KV: tl.constexpr, D: tl.constexpr,
                BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // (H_KV * SPLITS)
    h = (pid // SPLITS) % H_KV
    sp = pid % SPLITS
    per = tl.cdiv(tl.cdiv(L, BLOCK_N), SPLITS) * BLOCK_N
    lo_k = sp * per
    hi_k = tl.minimum(lo_k + per, L)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], tl.int32)
    for start in range(lo_k, hi_k, BLOCK_N):
        ok = start + n < hi_k
        slots = tl.load(r2t + b * stride_r2t + start + n, mask=ok, other=0)
        base = (slots.to(tl.int64) * H_KV + h) * D
        acc ^= tl.load(kp + base[:, None] + d[None, :]).to(tl.int32)
        acc ^= tl.load(vp + base[:, None] + d[None, :]).to(tl.int32)
    tl.store(out + pid * D + d, tl.sum(acc, 0))


def main():
    B, L, HQ, HKV, D, KL = [int(x) for x in (sys.argv[1:7] or [32, 4096, 32, 8, 128, 4])]
    G = HQ // HKV
    dev = "cuda"
    torch.manual_seed(0)
    slots_total = B * L
    layers = max(1, int(4e9 // (slots_total * HKV * D * 2)))
    layers = min(layers, 8)
    kps = [torch.randn(slots_total, HKV, D, device=dev).to(torch.float8_e4m3fn) for _ in range(layers)]
    vps = [torch.randn(slots_total, HKV, D, device=dev).to(torch.float8_e4m3fn) for _ in range(layers)]
    r2t = torch.randperm(slots_total, device=dev, dtype=torch.int32).view(B, L).contiguous()
    q = torch.randn(B * KL, HQ, D, device=dev, dtype=torch.bfloat16)
    sm = D ** -0.5
    ku8 = [k.view(torch.uint8) for k in kps]
    # reference for one layer, one split, float64
    kf = kps[0].double()[r2t.long()]  # B, L, HKV, D
    vf = vps[0].double()[r2t.long()]
    qd = q.double().view(B, KL, HKV, G, D)
    s = torch.einsum("bkhgd,blhd->bkhgl", qd, kf) * sm
    ref = torch.einsum("bkhgl,blhd->bkhgd", s.softmax(-1), vf)
    print(f"B {B} L {L} HQ {HQ} HKV {HKV} D {D} K {KL} layers {layers}")
    import os
    for SPLITS in [int(x) for x in os.environ.get('SPLITS', '1 2 3').split()]:
        grid = (B * HKV * SPLITS,)
        out = torch.empty(grid[0] * KL * G, D, device=dev, dtype=torch.float32)
        mo = torch.empty(grid[0] * KL * G, device=dev)
        lo = torch.empty_like(mo)
        ro = torch.empty(grid[0], D, device=dev, dtype=torch.int32)
        cyc = itertools.cycle(range(layers))
        rf = lambda: (lambda i: read_kernel[grid](ku8[i], vps[i].view(torch.uint8), r2t, ro, L, L, HKV, D, 128, SPLITS, num_warps=4, num_stages=3))(next(cyc))
        t_rf = triton.testing.do_bench(rf, warmup=50, rep=300)
        print(f"splits {SPLITS} read floor {t_rf*1e3:.1f} us")
        for SWAP in (True, False):
            for BN in (64, 128):
                for nw in (4, 8):
                    for st in (2, 3, 4):
                        if not SWAP and nw == 8:
                            continue
                        try:
                            f = lambda: (lambda i: swap_kernel[grid](q, kps[i], vps[i], r2t, out, mo, lo, L, L, sm, HKV, G, KL, D, BN, SPLITS, SWAP, num_warps=nw, num_stages=st))(next(cyc))
                            swap_kernel[grid](q, kps[0], vps[0], r2t, out, mo, lo, L, L, sm, HKV, G, KL, D, BN, SPLITS, SWAP, num_warps=nw, num_stages=st)
                            torch.cuda.synchronize()
                            o = out.view(B, HKV, SPLITS, KL, G, D).double()
                            m = mo.view(B, HKV, SPLITS, KL, G).double() * 0.6931471805599453
                            l = lo.view(B, HKV, SPLITS, KL, G).double()
                            w = torch.exp(m - m.amax(2, keepdim=True))
                            full = (o * w[..., None]).sum(2) / (l * w).sum(2)[..., None]
                            full = full.permute(0, 2, 1, 3, 4)
                            err = (full - ref).abs().max().item()
                            t = triton.testing.do_bench(f, warmup=50, rep=300)
                            print(f"  swap {int(SWAP)} BN {BN} warps {nw} stages {st}: {t*1e3:.1f} us ({t/t_rf:.2f}x RF) err {err:.2e}", flush=True)
                        except Exception as e:  # noqa
                            print(f"  swap {int(SWAP)} BN {BN} warps {nw} stages {st}: {type(e).__name__} {str(e)[:120]}", flush=True)


if __name__ == "__main__":
    main()
