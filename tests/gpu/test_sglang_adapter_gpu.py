"""The SGLang adapter's engine-neutral half (``specattn.integrations.sglang.adapter``) on a GPU,
over specattn's GPU backends, with stand-ins for SGLang's objects (SGLang itself cannot be
installed on the GPU machine). Each backend, reached through the adapter exactly as the
SGLang plugin reaches it (flat ``out_cache_loc``, ``[rows, H * D]`` queries, a
``RadixAttention``-like layer, the model-stored-KV path), is compared with ``torch_ref``
through the same adapter; plus CUDA-graph capture/replay of the draft steps. Marked ``gpu``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specattn import DraftBackendFactory, SpecConfig
from specattn.errors import BackendUnavailableError, ModelMismatchError
from specattn.integrations.sglang.adapter import DecodeAdapter, ExtendAdapter, wrap_pools

pytestmark = pytest.mark.gpu
DEV = "cuda"
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
HQ, HKV, D = 8, 2, 128              # one rank's heads (tensor parallel split applied)
RANK, ROPE = 512, 64                # MLA latent
SEQ, TOPK, STEPS, PAGE = (37, 300, 5, 129), 4, 4, 16
MAX_CTX = 512


def _slot(b: int, pos: int) -> int:
    """SGLang-like contiguous, page-aligned slots; page 0 is the padding slot's page."""
    return PAGE + b * MAX_CTX + pos


def _draft_positions(seq_len: int) -> list[list[int]]:
    """Lane ``j``'s step-``t`` position in ``R_b`` as SGLang allocates it (per-branch pages
    after the last full prefix page when ``PAGE > 1 and TOPK > 1``)."""
    last = seq_len % PAGE
    base, pages = seq_len - last, (last + STEPS + PAGE - 1) // PAGE
    return [[base + j * pages * PAGE + last + t for t in range(STEPS)] for j in range(TOPK)]


def _model_runner(model: str, dtype: torch.dtype, device: str, seed: int = 0):
    """What the adapter reads off SGLang's model runner: pools, request table, page size.
    Each branch's first page starts with a copy of the partial prefix page, as SGLang makes
    it for paged kernels."""
    g = torch.Generator(device=device).manual_seed(seed)
    slots = PAGE + len(SEQ) * MAX_CTX
    if model == "mla":
        kv = [torch.randn(slots, 1, RANK + ROPE, generator=g, device=device).to(dtype)]
        pool = SimpleNamespace(kv_buffer=kv, kv_lora_rank=RANK, dtype=dtype, store_dtype=dtype)
        bufs = kv
    else:
        k = [torch.randn(slots, HKV, D, generator=g, device=device).to(dtype)]
        v = [torch.randn(slots, HKV, D, generator=g, device=device).to(dtype)]
        pool = SimpleNamespace(k_buffer=k, v_buffer=v, dtype=dtype, store_dtype=dtype)
        bufs = k + v
    r2t = torch.tensor([[_slot(b, x) for x in range(MAX_CTX)] for b in range(len(SEQ))],
                       dtype=torch.int32, device=device)
    for b, seq_len in enumerate(SEQ):
        last = seq_len % PAGE
        for lane in _draft_positions(seq_len)[1:]:
            for t in range(last):
                for buf in bufs:
                    buf[_slot(b, lane[0] - last + t)] = buf[_slot(b, seq_len - last + t)]
    return SimpleNamespace(token_to_kv_pool=pool,
                           req_to_token_pool=SimpleNamespace(req_to_token=r2t),
                           page_size=PAGE, use_mla_backend=model == "mla")


def _layer(model: str):
    """A ``RadixAttention``-like layer (absorbed MLA form for MLA)."""
    if model == "mla":
        return SimpleNamespace(layer_id=0, tp_q_head_num=HQ, tp_k_head_num=1,
                               qk_head_dim=RANK + ROPE, v_head_dim=RANK,
                               scaling=(RANK + ROPE) ** -0.5, logit_cap=0.0,
                               sliding_window_size=-1)
    return SimpleNamespace(layer_id=0, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D,
                           v_head_dim=D, scaling=D ** -0.5, logit_cap=0.0,
                           sliding_window_size=-1)


def _adapters(name: str, model: str, dtype: torch.dtype, device: str = DEV):
    mr = _model_runner(model, dtype, device)
    runner = wrap_pools(mr, HQ)
    factory = DraftBackendFactory(SpecConfig(attention_backend=name, page_size=PAGE), runner,
                                  TOPK, STEPS)
    try:
        return mr, DecodeAdapter(factory.create_decode_backend()), ExtendAdapter(
            factory.create_draft_extend_backend())
    except (BackendUnavailableError, ModelMismatchError) as err:
        pytest.skip(f"{name} cannot run here: {err}")


def _draft_batch(device: str, seq=SEQ):
    """A SGLang-like DECODE batch: ``out_cache_loc`` flat, laid out ``(B, K, S)``."""
    loc = [_slot(b, x) for b, n in enumerate(seq) for lane in _draft_positions(n) for x in lane]
    return SimpleNamespace(batch_size=len(seq), forward_mode=SimpleNamespace(name="DECODE"),
                           req_pool_indices=torch.arange(len(seq), device=device),
                           seq_lens=torch.tensor(seq, device=device),
                           out_cache_loc=torch.tensor(loc, device=device))


def _inputs(model, dtype, device, rows, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    width = RANK + ROPE if model == "mla" else D
    q = torch.randn(rows, HQ * width, generator=g, device=device).to(dtype)
    if model == "mla":
        return q, torch.randn(rows, 1, width, generator=g, device=device).to(dtype), None
    k = torch.randn(rows, HKV * D, generator=g, device=device).to(dtype)
    return q, k, torch.randn(rows, HKV * D, generator=g, device=device).to(dtype)


def _decode_round(adapter, model, dtype, device, begin=None):
    fb = _draft_batch(device)
    (begin or adapter.begin)(fb)
    rows, outs = fb.batch_size * TOPK, []
    for step in range(STEPS - 1):
        q, k, v = _inputs(model, dtype, device, rows, seed=10 + step)
        outs.append(adapter.forward(step, q, k, v, _layer(model)))
    return outs


@pytest.mark.parametrize("model", ["mha", "mla"])
@pytest.mark.parametrize("name", ["triton", "flashinfer", "fa3", "fa4", "flashmla",
                                  "trtllm_mha", "trtllm_mla"])
def test_adapter_decode_and_extend_match_torch_ref(name, model):
    dtype = torch.bfloat16
    _, adapter, ext = _adapters(name, model, dtype)
    _, ref, ref_ext = _adapters("torch_ref", model, dtype)
    for out, want in zip(_decode_round(adapter, model, dtype, DEV),
                         _decode_round(ref, model, dtype, DEV)):
        assert out.shape == want.shape and not torch.isnan(out).any()
        torch.testing.assert_close(out.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if ext is None:
        return
    lens = (3, 1, 5, 2)
    fb = SimpleNamespace(batch_size=len(SEQ), forward_mode=SimpleNamespace(name="EXTEND"),
                         req_pool_indices=torch.arange(len(SEQ), device=DEV),
                         seq_lens=torch.tensor(SEQ, device=DEV),
                         extend_seq_lens=torch.tensor(lens, device=DEV),
                         out_cache_loc=torch.tensor([_slot(b, n - e + t) for b, (n, e) in
                                                     enumerate(zip(SEQ, lens))
                                                     for t in range(e)], device=DEV))
    q, k, v = _inputs(model, dtype, DEV, sum(lens), seed=3)
    ext.begin(fb)
    ref_ext.begin(fb)
    got = ext.forward(q, k, v, _layer(model))
    want = ref_ext.forward(q, k, v, _layer(model))
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # The model stored the KV itself: the adapter hands the stored rows back.
    got_stored = ext.forward(q, None, None, _layer(model), save_kv_cache=False)
    torch.testing.assert_close(got_stored.float(), want.float(), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("model", ["mha", "mla"])
def test_adapter_cuda_graph_replay_matches_eager(model):
    """SGLang's graph runner: state, capture metadata, capture the steps, then replay after
    new lengths, with the batch padded by one request (seq_len 1, row 0, slot 0)."""
    dtype = torch.bfloat16
    _, adapter, _ = _adapters("triton", model, dtype)
    if not adapter.backend.supports_cuda_graph:
        pytest.skip("backend has no CUDA-graph support")
    bs = len(SEQ) + 1
    adapter.init_cuda_graph_state(bs, bs * TOPK)
    static = _padded_batch(SEQ)
    adapter.capture(static)
    rows = bs * TOPK
    q_in = [_inputs(model, dtype, DEV, rows, seed=20 + s) for s in range(STEPS - 1)]
    graph, outs = torch.cuda.CUDAGraph(), []
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for step, (q, k, v) in enumerate(q_in):  # warm-up
            adapter.forward(step, q, k, v, _layer(model))
        with torch.cuda.graph(graph, stream=stream):
            for step, (q, k, v) in enumerate(q_in):
                outs.append(adapter.forward(step, q, k, v, _layer(model)))
    # Shorter prefixes: what warm-up wrote (at positions >= the old lengths) stays unread.
    fresh = _padded_batch((30, 250, 3, 100))
    static.seq_lens.copy_(fresh.seq_lens)
    static.out_cache_loc.copy_(fresh.out_cache_loc)
    adapter.replay(static)
    graph.replay()
    torch.cuda.synchronize()
    _, ref, _ = _adapters("torch_ref", model, dtype)
    ref.begin(fresh)
    real = len(SEQ) * TOPK
    for step, (q, k, v) in enumerate(q_in):
        want = ref.forward(step, q, k, v, _layer(model))
        torch.testing.assert_close(outs[step][:real].float(), want[:real].float(),
                                   atol=TOL[dtype], rtol=TOL[dtype])


def _padded_batch(seq):
    """``seq`` plus one padded request, as SGLang's graph runner pads: seq_len 1 (the fill
    value), request row 0, slot 0."""
    fb = _draft_batch(DEV, seq=tuple(seq) + (1,))
    fb.out_cache_loc[-TOPK * STEPS:] = 0
    fb.req_pool_indices[-1] = 0
    return fb
