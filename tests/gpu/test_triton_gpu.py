"""Triton backend on a CUDA GPU at real shapes (performance.md) vs torch_ref; CUDA graphs;
a random-shape stress loop. Marked ``gpu`` (skipped without CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from helpers import check_replayed_lanes  # noqa: E402
from specattn import metadata  # noqa: E402
from specattn.backends.torch_ref import reference_decode, reference_extend  # noqa: E402
from specattn.data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner  # noqa: E402
from specattn.kernels.tiles import cvt_args, widen  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _close(out, ref, dtype):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def make_runner(model, dtype, page, num_slots, max_reqs, max_ctx, gqa=(32, 8, 128), kv="auto"):
    kw = dict(num_layers=1, num_slots=num_slots, max_reqs=max_reqs, max_context_len=max_ctx,
              page_size=page, dtype=dtype, device=DEV, kv_cache_dtype=kv)
    if model == "mha":
        r = DraftRunner.mha(*gqa, **kw)
        pools = r.k_buffer + r.v_buffer
    else:
        r = DraftRunner.mla(16, 512, 64, **kw)
        pools = r.kv_buffer
    for p in pools:
        if r.fp8:  # codes of standard-normal values (no normal_ for FP8 dtypes)
            p.copy_(torch.randn(p.shape, device=DEV).to(p.dtype))
        else:
            p.normal_()
    return r


def make_decode(model, dtype, topk, steps, page, seq_lens, tree_mode, gqa=(32, 8, 128),
                kv="auto"):
    bs = len(seq_lens)
    seq = torch.tensor(seq_lens, dtype=torch.int64, device=DEV)
    extra = metadata.max_draft_extend_len(topk, steps, page)
    num_slots = sum(seq_lens) + bs * extra + 16
    r = make_runner(model, dtype, page, num_slots, bs + 4, max(seq_lens) + extra + page, gqa,
                    kv)
    rpi = torch.randperm(bs + 4, device=DEV)[:bs]
    perm, used = fill_rows(r, rpi, seq_lens, num_slots)
    n_new = int(metadata.draft_extend_lens(seq, topk, steps, page).sum())
    loc = metadata.assign_draft_cache_locs(r.req_to_token, rpi, seq,
                                           perm[used:used + n_new].long(), topk, steps, page)
    parents = torch.zeros(steps, bs, topk, dtype=torch.int64, device=DEV) \
        if tree_mode == "path" else None
    return r, DraftBatch(rpi, seq, loc, parents)


def fill_rows(r, rpi, seq_lens, num_slots):
    perm = torch.randperm(num_slots, device=DEV).to(torch.int32)
    used = 0
    for b, L in enumerate(seq_lens):
        r.req_to_token[rpi[b], :L] = perm[used:used + L]
        used += L
    return perm, used


def make_extend(model, dtype, page, lens, ext):
    """A runner of page size ``page`` and an extend batch whose request ``b`` has ``lens[b]``
    tokens, its last ``ext[b]`` new (rows of a shuffled ``req_to_token``)."""
    B = len(lens)
    r = make_runner(model, dtype, page, sum(lens) + 16, B + 2, max(lens) + page)
    rpi = torch.randperm(B + 2, device=DEV)[:B]
    fill_rows(r, rpi, lens, sum(lens) + 16)
    loc = torch.cat([r.req_to_token[rpi[b], n - e:n].long() for b, (n, e) in
                     enumerate(zip(lens, ext))])
    return r, DraftExtendBatch(rpi, torch.tensor(lens, device=DEV),
                               torch.tensor(ext, device=DEV), loc)


def qkv(r, rows, dtype):
    if r.use_mla_backend:
        return (torch.randn(rows, 16, 576, device=DEV, dtype=dtype),
                torch.randn(rows, 576, device=DEV, dtype=dtype), None)
    return (torch.randn(rows, r.num_q_heads, r.head_dim, device=DEV, dtype=dtype),
            torch.randn(rows, r.num_kv_heads, r.head_dim, device=DEV, dtype=dtype),
            torch.randn(rows, r.num_kv_heads, r.v_head_dim, device=DEV, dtype=dtype))


def run_round(r, batch, backend, dtype, layer, tree_mode, steps_to_check=None, q_mul=1.0):
    bs, topk, steps = batch.out_cache_loc.shape
    backend.init_forward_metadata(batch)
    for step in range(steps):
        if tree_mode == "path" and step:
            batch.parents[step] = torch.randint(0, topk, (bs, topk), device=DEV)
        q, k, v = qkv(r, bs * topk, dtype)
        q = (q.float() * q_mul).to(dtype)
        backend._active.mid_o.fill_(float("nan"))
        out = backend.forward(step, layer, q, k, v)
        if steps_to_check is None or step in steps_to_check:
            _close(out, reference_decode(r, layer, q, batch, step, tree_mode), dtype)


CASES = [
    # model, dtype, B, L, K, S, P, tree_mode, ragged, mode
    ("mha", torch.bfloat16, 4, 4096, 8, 5, 1, "lane", False, "shared"),
    ("mha", torch.bfloat16, 6, 4096, 8, 5, 1, "path", True, "shared"),
    ("mha", torch.float16, 8, 2048, 1, 4, 1, "lane", True, "shared"),
    ("mha", torch.bfloat16, 4, 4096, 4, 5, 16, "path", True, "shared"),
    ("mha", torch.bfloat16, 1, 32768, 4, 3, 1, "lane", False, "shared"),  # dot-m16, 64 splits
    ("mha", torch.bfloat16, 1, 131072, 4, 3, 16, "path", False, "shared"),  # 128k, pages
    ("mla", torch.bfloat16, 1, 131072, 4, 3, 64, "lane", False, "shared"),
    ("mha", torch.float16, 4, 1024, 4, 5, 1, "lane", False, "per-branch"),
    ("mla", torch.bfloat16, 4, 4096, 4, 5, 1, "path", True, "shared"),
    ("mla", torch.bfloat16, 4, 4096, 4, 5, 64, "lane", False, "shared"),
    ("mla", torch.float16, 3, 2048, 1, 3, 1, "lane", True, "per-branch"),
]


@pytest.mark.parametrize("model,dtype,B,L,K,S,P,tree_mode,ragged,mode", CASES)
def test_decode_real_shapes(model, dtype, B, L, K, S, P, tree_mode, ragged, mode):
    from specattn.backends.triton import TritonDecode

    lens = [random.randint(L // 2, 3 * L // 2) if ragged else L for _ in range(B)]
    r, batch = make_decode(model, dtype, K, S, P, lens, tree_mode)
    backend = TritonDecode(r, K, S, tree_mode=tree_mode, mode=mode)
    scale = (576 if model == "mla" else 128) ** -0.5
    run_round(r, batch, backend, dtype, AttentionLayer(0, scale, 30.0 if ragged else 0.0),
              tree_mode, steps_to_check={0, S - 1})


@pytest.mark.parametrize("plan", ["dot-mla", "dot-wide"])
def test_mla_tl_dot_plans_real_shapes(plan):
    """The tl.dot MLA plans (the fallback off the sm90 kernels, forced here), ragged
    mla-long-like batch, path mode, logit cap."""
    from specattn.backends.triton import TritonDecode

    lens = [random.randint(2048, 6144) for _ in range(4)]
    r, batch = make_decode("mla", torch.bfloat16, 4, 5, 1, lens, "path")
    backend = TritonDecode(r, 4, 5, tree_mode="path", plan=plan)
    run_round(r, batch, backend, torch.bfloat16, AttentionLayer(0, 576 ** -0.5, 30.0), "path",
              steps_to_check={0, 4})


@pytest.mark.parametrize("model,kv,plan", [("mha", "fp8_e4m3", None), ("mha", "fp8_e5m2", None),
                                           ("mla", "fp8_e4m3", "dot-mla"),
                                           ("mla", "fp8_e5m2", "dot-mla")])
def test_fp8_default_plans_real_shapes(model, kv, plan, q_mul=1.0):
    """FP8 pools on the default ``tl.dot`` plans at gqa-long / mla-long-like shapes (``dot-fp8``
    as the table picks it; ``dot-mla`` forced past the sm90 kernels; fp16 dots under bf16):
    ragged batch, path mode, scales != 1, against torch_ref over the dequantized pool."""
    from specattn.backends.triton import TritonDecode

    topk = 4 if model == "mla" else 8
    lens = [random.randint(2048, 6144) for _ in range(4)]
    r, batch = make_decode(model, torch.bfloat16, topk, 5, 1, lens, "path", kv=kv)
    backend = TritonDecode(r, topk, 5, tree_mode="path", plan=plan)
    assert backend.plan.name == (plan or "dot-fp8")
    layer = AttentionLayer(0, (576 if model == "mla" else 128) ** -0.5 / q_mul, k_scale=0.37,
                           v_scale=1.9)
    run_round(r, batch, backend, torch.bfloat16, layer, "path", steps_to_check={0, 4},
              q_mul=q_mul)


def test_fp8_one_wave_of_many_requests():
    """dot-fp8 over 24 requests x 8 KV heads (192 programs: more than the SMs, within one
    wave of its slots) takes one prefix split (``plans.ONE_WAVE_PLANS``): ragged, path mode,
    scales != 1, against torch_ref over the dequantized pool."""
    from specattn.backends.triton import TritonDecode

    lens = [random.randint(512, 1536) for _ in range(24)]
    r, batch = make_decode("mha", torch.bfloat16, 8, 3, 1, lens, "path", kv="fp8_e4m3")
    backend = TritonDecode(r, 8, 3, tree_mode="path")
    assert backend.plan_for(24).name == "dot-fp8" and backend._make_plan(24)["num_splits"] == 1
    layer = AttentionLayer(0, 128 ** -0.5, k_scale=0.37, v_scale=1.9)
    run_round(r, batch, backend, torch.bfloat16, layer, "path", steps_to_check={0, 2})


@pytest.mark.parametrize("model,kv,plan", [("mha", "fp8_e4m3", None),
                                           ("mla", "fp8_e5m2", "dot-mla")])
def test_fp8_fp16_dots_of_queries_past_fp16_range(model, kv, plan):
    """Queries of |q| up to ~5e5 (past fp16's 65504; the fp16 dots' 2^-8 prescale keeps
    them), the softmax scale as much smaller."""
    test_fp8_default_plans_real_shapes(model, kv, plan, q_mul=1e5)


@pytest.mark.parametrize("model", ["mha", "mla"])
def test_extend_real_shapes(model):
    from specattn.backends.triton import TritonExtend

    dtype, B = torch.bfloat16, 8
    ext = [random.randint(1, 6) for _ in range(B)]
    r, batch = make_extend(model, dtype, 1, [random.randint(2048, 6144) for _ in range(B)], ext)
    backend = TritonExtend(r)
    layer = AttentionLayer(0, 0.08)
    backend.init_forward_metadata(batch)
    q, k, v = qkv(r, sum(ext), dtype)
    out = backend.forward(layer, q, k, v)
    _close(out, reference_extend(r, layer, q, batch), dtype)


# job, kv, B, L, K (extend: the longest request's new tokens), page, ragged, the plan the
# table picks for that few-request round (GQA 32 / 8 heads: 4 query heads per KV head).
FEW_REQUEST_PLANS = [
    ("decode", "auto", 1, 32768, 8, 1, False, "dot-m32"),
    ("decode", "auto", 3, 8192, 8, 16, True, "dot-m32"),
    ("extend", "auto", 1, 32768, 6, 1, False, "dot-extend"),
    ("extend", "auto", 8, 4096, 6, 16, True, "dot-extend"),
    ("decode", "fp8_e4m3", 1, 32768, 4, 1, False, "dot-fp8-m16"),
    ("decode", "fp8_e5m2", 4, 4096, 4, 16, True, "dot-fp8-m16"),
]


@pytest.mark.parametrize("job,kv,B,L,K,P,ragged,plan", FEW_REQUEST_PLANS)
def test_few_request_plans_real_shapes(job, kv, B, L, K, P, ragged, plan):
    """The five-stage plans of few-request rounds, as the table picks them, against torch_ref
    (FP8: over the dequantized pool, scales != 1), partials NaN-poisoned: B 1 at 32k keys
    (their most splits) and ragged batches over pages of 16."""
    from specattn.backends.triton import TritonDecode, TritonExtend

    dtype = torch.bfloat16
    lens = [random.randint(L // 2, 3 * L // 2) if ragged else L for _ in range(B)]
    scales = dict(k_scale=0.37, v_scale=1.9) if kv != "auto" else {}
    layer = AttentionLayer(0, 128 ** -0.5, **scales)
    if job == "decode":
        r, batch = make_decode("mha", dtype, K, 3, P, lens, "path", kv=kv)
        backend = TritonDecode(r, K, 3, tree_mode="path")
        assert backend.plan_for(B).name == plan
        run_round(r, batch, backend, dtype, layer, "path")
        return
    ext = [K] + [random.randint(1, K) for _ in range(B - 1)]
    r, batch = make_extend("mha", dtype, P, lens, ext)
    backend = TritonExtend(r)
    backend.init_forward_metadata(batch)
    assert backend._round_plan["plan"].name == plan
    q, k, v = qkv(r, sum(ext), dtype)
    _poison_partials(backend)
    _close(backend.forward(layer, q, k, v), reference_extend(r, layer, q, batch), dtype)


@pytest.mark.parametrize("tree_mode", ["lane", "path"])
def test_cuda_graph_capture_replay_padded(tree_mode):
    """Capture all steps at bs=8; replay with new seq_lens / rows / slots / parents and a
    real batch of 5 padded to 8; real lanes match torch_ref."""
    from specattn.backends.triton import TritonDecode

    dtype, K, S, max_bs = torch.bfloat16, 4, 4, 8
    r, batch = make_decode("mha", dtype, K, S, 1, [1600] * max_bs, tree_mode)
    backend = TritonDecode(r, K, S, tree_mode=tree_mode)
    backend.init_cuda_graph_state(max_bs, max_bs * K)
    layer = AttentionLayer(0, 0.088)
    qs = [qkv(r, max_bs * K, dtype) for _ in range(S)]
    outs = [None] * S
    backend.init_forward_metadata_capture_cuda_graph(batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step in range(S):  # warm-up (compiles)
            backend.forward(step, layer, *qs[step])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in range(S):
            outs[step] = backend.forward(step, layer, *qs[step])
    # New round: 5 real requests, padded to 8 (seq_len fill value, slot 0, row 0).
    real = 5
    lens = [random.randint(100, 1300) for _ in range(real)]
    r2, b2 = make_decode("mha", dtype, K, S, 1, lens, tree_mode)
    _pad_into(r, batch, r2, b2, real, backend.get_cuda_graph_seq_len_fill_value())
    backend.init_forward_metadata_replay_cuda_graph(batch, max_bs)
    for step in range(S):
        qs[step][0].normal_()
        for t in qs[step][1:]:
            t.normal_()
    if tree_mode == "path":
        batch.parents.copy_(torch.randint(0, K, batch.parents.shape, device=DEV))
    # Real lanes' KV slots must be unique for the reference: the padded lanes write slot 0.
    graph.replay()
    torch.cuda.synchronize()
    check_replayed_lanes(r, layer, batch, real, qs, outs, tree_mode, dtype)


def test_metadata_capturable():
    """The metadata launch has no host sync: it can be captured in a CUDA graph."""
    from specattn.backends.triton import launchers

    r, batch = make_decode("mha", torch.bfloat16, 4, 5, 16, [300, 700], "lane")
    meta = torch.zeros(2, 5, dtype=torch.int32, device=DEV)
    hist = torch.zeros(8, 5, dtype=torch.int32, device=DEV)
    launchers.decode_metadata(batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc,
                              meta, hist, 4, 64, r.num_slots)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launchers.decode_metadata(batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc,
                                  meta, hist, 4, 64, r.num_slots)
    batch.seq_lens.copy_(torch.tensor([512, 9], device=DEV))
    g.replay()
    torch.cuda.synchronize()
    assert meta[:, 1].tolist() == [512, 9]
    assert torch.equal(hist.view(2, 4, 5).long(), batch.out_cache_loc.long())


@pytest.mark.parametrize("model,K,tree_mode,mode,plan", [
    ("mha", 8, "path", "shared", "dot"), ("mha", 4, "lane", "per-branch", "dot"),
    ("mha", 4, "lane", "shared", "dot-d256"),
    ("mla", 4, "path", "shared", "dot-mla"), ("mla", 1, "lane", "shared", "dot-wide")])
def test_tl_dot_plans_write_and_attend(model, K, tree_mode, mode, plan):
    """Each tl.dot plan's KV write (the pool holds k/v afterwards) and attention; ragged
    lengths, logit cap."""
    from specattn.backends.triton import TritonDecode

    dtype, S = torch.bfloat16, 4
    lens = [random.randint(1000, 5000) for _ in range(5)]
    r, batch = make_decode(model, dtype, K, S, 16, lens, tree_mode)
    backend = TritonDecode(r, K, S, tree_mode=tree_mode, mode=mode, plan=plan)
    layer = AttentionLayer(0, (576 if model == "mla" else 128) ** -0.5, 30.0)
    backend.init_forward_metadata(batch)
    for step in range(S):
        if tree_mode == "path" and step:
            batch.parents[step] = torch.randint(0, K, (5, K), device=DEV)
        q, k, v = qkv(r, 5 * K, dtype)
        backend._active.mid_o.fill_(float("nan"))
        out = backend.forward(step, layer, q, k, v)
        _close(out, reference_decode(r, layer, q, batch, step, tree_mode), dtype)
        slots = batch.out_cache_loc[:, :, step].reshape(-1).long()
        pool = r.kv_buffer[0] if model == "mla" else r.k_buffer[0]
        assert torch.equal(pool[slots], k)


@pytest.mark.slow  # minutes: gpu.sh check runs it in its own step
def test_random_stress_100_batches():
    from specattn.backends.triton import TritonDecode

    rng = random.Random(1234)
    for it in range(100):
        model = "mla" if it % 5 == 4 else "mha"
        dtype = torch.bfloat16 if it % 2 else torch.float16
        K, S, P = rng.choice([1, 2, 4, 8]), rng.choice([2, 3, 5]), rng.choice([1, 16, 64])
        tree_mode = rng.choice(["lane", "path"])
        B = rng.randint(1, 12)
        lens = [rng.randint(0, 2500) for _ in range(B)]
        r, batch = make_decode(model, dtype, K, S, P, lens, tree_mode, gqa=(16, 4, 128))
        mode = "per-branch" if it % 7 == 0 else "shared"
        backend = TritonDecode(r, K, S, tree_mode=tree_mode, mode=mode)
        scale = (576 if model == "mla" else 128) ** -0.5
        run_round(r, batch, backend, dtype, AttentionLayer(0, scale), tree_mode,
                  steps_to_check={rng.randrange(S)})


# --- pdl=True: the tl.dot plans as programmatic dependent launches (sm90+) --------------------

def _require_pdl():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("pdl=True needs sm90+")


def _poison_partials(backend):
    backend._active.mid_o.fill_(float("nan"))
    backend._active.mid_lse.fill_(float("nan"))


# model, K, B, L, page, ragged: B 1 at a long prefix (the split cap's many programs) and B 8
# ragged, each model at K 1 and 4 and at page sizes 1 and 16.
PDL_DECODE = [
    ("mha", 4, 1, 32768, 1, False), ("mha", 1, 1, 32768, 16, False),
    ("mha", 4, 8, 4096, 16, True), ("mha", 1, 8, 4096, 1, True),
    ("mla", 4, 1, 32768, 16, False), ("mla", 1, 1, 32768, 1, False),
    ("mla", 4, 8, 4096, 1, True), ("mla", 1, 8, 4096, 16, True),
]


@pytest.mark.parametrize("pdl", [False, True], ids=["pdl-off", "pdl-on"])
@pytest.mark.parametrize("model,K,B,L,P,ragged", PDL_DECODE)
def test_pdl_decode_matches_reference(model, K, B, L, P, ragged, pdl):
    """Every step of a round with pdl off and on, each against torch_ref (GQA on dot, MLA on
    dot-mla), partials NaN-poisoned before each step."""
    from specattn.backends.triton import TritonDecode

    if pdl:
        _require_pdl()
    S, dtype = 4, torch.bfloat16
    lens = [random.randint(L // 2, 3 * L // 2) if ragged else L for _ in range(B)]
    r, batch = make_decode(model, dtype, K, S, P, lens, "lane")
    plan = "dot-mla" if model == "mla" else "dot"
    backend = TritonDecode(r, K, S, plan=plan, pdl=pdl)
    layer = AttentionLayer(0, (576 if model == "mla" else 128) ** -0.5)
    backend.init_forward_metadata(batch)
    for step in range(S):
        q, k, v = qkv(r, B * K, dtype)
        _poison_partials(backend)
        out = backend.forward(step, layer, q, k, v)
        _close(out, reference_decode(r, layer, q, batch, step, "lane"), dtype)


# model, B, L, page
PDL_EXTEND = [("mha", 1, 32768, 1), ("mha", 8, 4096, 16), ("mla", 1, 32768, 16),
              ("mla", 8, 4096, 1)]


def _extend_batch(model, B, L, P, dtype):
    """A runner of page size ``P`` and an extend batch (``E_b`` 6 at B 1, else 1..6; ragged
    above B 1) whose new tokens are the last ``E_b`` of each request."""
    lens = [L] if B == 1 else [random.randint(L // 2, 3 * L // 2) for _ in range(B)]
    ext = [6] if B == 1 else [random.randint(1, 6) for _ in range(B)]
    return make_extend(model, dtype, P, lens, ext)


@pytest.mark.parametrize("pdl", [False, True], ids=["pdl-off", "pdl-on"])
@pytest.mark.parametrize("model,B,L,P", PDL_EXTEND)
def test_pdl_extend_matches_reference(model, B, L, P, pdl):
    from specattn.backends.triton import TritonExtend

    if pdl:
        _require_pdl()
    dtype = torch.bfloat16
    r, batch = _extend_batch(model, B, L, P, dtype)
    backend = TritonExtend(r, plan="dot-mla" if model == "mla" else "dot", pdl=pdl)
    layer = AttentionLayer(0, 0.08)
    backend.init_forward_metadata(batch)
    q, k, v = qkv(r, int(batch.extend_lens.sum()), dtype)
    _poison_partials(backend)
    _close(backend.forward(layer, q, k, v), reference_extend(r, layer, q, batch), dtype)


@pytest.mark.parametrize("pdl", [False, True], ids=["pdl-off", "pdl-on"])
@pytest.mark.parametrize("model", ["mha", "mla"])
def test_pdl_cuda_graph_capture_replay_padded(model, pdl):
    """pdl off and on under a CUDA graph: all steps captured at bs 8, replayed with a real
    batch of 5 padded to 8 (new lengths, rows, slots), outputs NaN-filled before the replay;
    the real lanes match torch_ref."""
    from specattn.backends.triton import TritonDecode

    if pdl:
        _require_pdl()
    dtype, K, S, max_bs = torch.bfloat16, 4, 4, 8
    r, batch = make_decode(model, dtype, K, S, 16, [1600] * max_bs, "lane")
    plan = "dot-mla" if model == "mla" else "dot"
    backend = TritonDecode(r, K, S, plan=plan, pdl=pdl)
    backend.init_cuda_graph_state(max_bs, max_bs * K)
    layer = AttentionLayer(0, (576 if model == "mla" else 128) ** -0.5)
    qs = [qkv(r, max_bs * K, dtype) for _ in range(S)]
    backend.init_forward_metadata_capture_cuda_graph(batch)
    graph, outs = _capture_steps(backend, layer, qs)
    real = 5
    r2, b2 = make_decode(model, dtype, K, S, 16, [random.randint(100, 1300) for _ in
                                                  range(real)], "lane")
    _pad_into(r, batch, r2, b2, real, backend.get_cuda_graph_seq_len_fill_value())
    backend.init_forward_metadata_replay_cuda_graph(batch, max_bs)
    for step in range(S):
        for t in qs[step]:
            if t is not None:
                t.normal_()
        outs[step].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_replayed_lanes(r, layer, batch, real, qs, outs, "lane", dtype)


def _capture_steps(backend, layer, qs) -> tuple:
    """Warm up on a side stream (compiles), then capture every step of a round: ``(graph,
    outputs per step)``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step, q in enumerate(qs):
            backend.forward(step, layer, *q)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [backend.forward(step, layer, *q) for step, q in enumerate(qs)]
    return graph, outs


def _pad_into(r, batch, r2, b2, real, fill):
    """``b2`` (of runner ``r2``, the smaller) as the first ``real`` requests of the captured
    ``batch`` (of runner ``r``), padded: the fill length, request row 0, and the padded lanes'
    slot one no real request uses (``r2``'s pool is smaller than ``r``'s)."""
    r.req_to_token.zero_()
    r.req_to_token[:r2.max_reqs, :r2.max_context_len] = r2.req_to_token
    batch.seq_lens.fill_(fill)
    batch.seq_lens[:real] = b2.seq_lens
    batch.req_pool_indices.zero_()
    batch.req_pool_indices[:real] = b2.req_pool_indices
    batch.out_cache_loc.fill_(r.num_slots - 1)
    batch.out_cache_loc[:real] = b2.out_cache_loc


@pytest.mark.parametrize("pdl", [False, True], ids=["pdl-off", "pdl-on"])
@pytest.mark.parametrize("model", ["mha", "mla"])
def test_pdl_extend_cuda_graph_replay(model, pdl):
    """Extend captured once (B 6 ragged), replayed with the requests reordered and new
    inputs, output NaN-filled before the replay: torch_ref's numbers, pdl off and on."""
    from specattn.backends.triton import TritonExtend

    if pdl:
        _require_pdl()
    dtype = torch.bfloat16
    r, b = _extend_batch(model, 6, 2048, 16, dtype)
    tokens = int(b.extend_lens.sum())
    backend = TritonExtend(r, plan="dot-mla" if model == "mla" else "dot", pdl=pdl,
                           max_extend_len=6)
    backend.init_cuda_graph_state(max_bs=6, max_num_tokens=tokens)
    layer = AttentionLayer(0, 0.08)
    q, k, v = qkv(r, tokens, dtype)
    backend.init_forward_metadata_capture_cuda_graph(b)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        backend.forward(layer, q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(layer, q, k, v)
    order = [2, 0, 1, 5, 3, 4]
    starts = (torch.cumsum(b.extend_lens, 0) - b.extend_lens).tolist()
    lens = b.extend_lens.tolist()
    idx = torch.tensor(order, device=DEV)
    loc = torch.cat([b.out_cache_loc[starts[i]:starts[i] + lens[i]] for i in order])
    batch = DraftExtendBatch(b.req_pool_indices[idx], b.seq_lens[idx], b.extend_lens[idx], loc)
    for t in (q, k, v):
        if t is not None:
            t.normal_()
    backend.init_forward_metadata_replay_cuda_graph(batch, 6)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _close(out, reference_extend(r, layer, q, batch), dtype)


# --- FP8 value tiles widened by PTX ------------------------------------------------------------

@triton.jit
def _widen_cvt_kernel(X, Y, R: tl.constexpr, C: tl.constexpr):
    """An ``[R, C]`` code tile widened by ``widen``'s ``CVT``, stored as fp16."""
    offs = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    tl.store(Y + offs, widen(tl.load(X + offs), tl.float16, True))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_widen_by_ptx_gives_every_codes_value_in_place(fp8):
    """``widen(x, fp16, CVT=True)`` (the split-KV kernel's value tiles on sm89+): every code
    of a 64 x 128 tile (each of the 256 codes at 32 places, shuffled, so that a swap within
    a register's four codes shows) becomes torch's fp16 value, bit for bit (NaN as NaN)."""
    if not cvt_args(torch.device(DEV)):
        pytest.skip("the FP8 conversions need compute capability 8.9+")
    g = torch.Generator().manual_seed(5)
    codes = torch.arange(256, dtype=torch.int32).repeat(32)[torch.randperm(8192, generator=g)]
    x = codes.to(torch.uint8).view(fp8).view(64, 128).to(DEV)
    y = torch.empty(64, 128, dtype=torch.float16, device=DEV)
    _widen_cvt_kernel[(1,)](x, y, R=64, C=128)
    ref = x.to(torch.float16)
    same = (y.isnan() & ref.isnan()) | (y.view(torch.int16) == ref.view(torch.int16))
    assert bool(same.all()), (codes.view(64, 128)[~same.cpu()], y[~same], ref[~same])
