"""FlashAttention backends (``fa4``, and ``fa3`` through FA4 or FA3) on the GPU vs ``torch_ref``.

For the H200 run: the CPU tests' case builders (page-aligned allocations, NaN pools except
readable slots) with the real ``flash_attn.cute`` / ``flash_attn_interface`` at the
``performance.md`` GQA shape (32 q heads, 8 kv heads, head dim 128). Covers draft decode
(topk 1/4/8, page size 1/16/64, lane/path trees, shared / per-branch / split-prefix / auto
modes, the Triton history+merge kernel and the torch-merge fallback, bf16/fp16, ragged and
uniform, random shapes), draft extend (one pass and split prefix, one request of 32k keys),
the fa3 fallback, and CUDA
graph capture + replay with a changed, padded batch. Also pins the installed signatures.
"""

from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from test_flash_attn import (assert_close_rel, make_case_on, make_decode_case,  # noqa: E402
                             make_extend_case, qkv, run_decode_round, run_extend)

from specattn.backends import flash_attn as fa  # noqa: E402
from specattn.backends.flash_attn import _library  # noqa: E402
from specattn.backends.torch_ref import reference_decode, reference_extend  # noqa: E402
from specattn.data import DraftBatch, DraftExtendBatch  # noqa: E402
from specattn.platforms._probes import module_available  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not module_available("flash_attn.cute"),
                                 reason="needs flash-attn-4 (pip install -e '.[fa]')")]

GQA = (32, 8, 128)
DTYPES = [torch.bfloat16, torch.float16]


def _name(dt):
    return str(dt).replace("torch.", "")


def test_installed_signatures_have_the_keywords_the_glue_passes():
    import flash_attn.cute as cute

    params = inspect.signature(cute.flash_attn_varlen_func).parameters
    for kw in ("cu_seqlens_q", "max_seqlen_q", "seqused_k", "page_table", "softmax_scale",
               "causal", "softcap", "return_lse"):
        assert kw in params, kw
    if module_available("flash_attn_interface"):
        import flash_attn_interface as fa3

        params = inspect.signature(fa3.flash_attn_with_kvcache).parameters
        for kw in ("cache_seqlens", "page_table", "cu_seqlens_q", "max_seqlen_q",
                   "softmax_scale", "causal", "softcap", "return_softmax_lse"):
            assert kw in params, kw


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("topk,page_size,tree_mode,mode,split,fused", [
    (1, 1, "lane", "shared", 1, None), (1, 16, "path", "shared", 1, None),
    (4, 1, "lane", "shared", 1, None), (4, 16, "path", "shared", 1, None),
    (4, 64, "lane", "shared", 1, None), (8, 1, "path", "shared", 1, None),
    (4, 16, "path", "shared", 1, False), (4, 1, "lane", "shared", 4, False),
    (4, 1, "path", "per-branch", 1, None), (4, 16, "lane", "per-branch", 1, None),
    (4, 1, "lane", "shared", 4, None), (1, 16, "path", "shared", 3, None),
    (4, 16, "path", "auto", 1, None)])
def test_fa4_decode(dtype, topk, page_size, tree_mode, mode, split, fused):
    """fused None: prefix pass + the Triton history+merge kernel; False: FA4 history pass +
    torch merge (the non-Triton path)."""
    case = make_decode_case(bs=5, topk=topk, steps=4, page_size=page_size, dtype=dtype,
                            device="cuda", seed=topk * 31 + page_size, max_len=300,
                            heads=GQA)
    backend = fa.FA4Decode(case.runner, topk, 4, tree_mode=tree_mode, mode=mode,
                           split_prefix=split, fused_merge=fused)
    assert backend.fused == (fused is None)
    run_decode_round(backend, case)
    run_decode_round(backend, make_case_on(case, seed=3))


def test_fa4_auto_route_follows_the_rule():
    """auto mode runs the route ``choose_route`` gives for this GPU's SM count."""
    from specattn.backends.flash_attn._route import choose_route

    for bs in (1, 5):
        case = make_decode_case(bs=bs, topk=4, steps=3, page_size=16, device="cuda",
                                seed=40 + bs, max_len=300, heads=GQA)
        backend = fa.FA4Decode(case.runner, 4, 3, tree_mode="path")
        run_decode_round(backend, case)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert backend._route == choose_route(
            bs=bs, topk=4, prefix_len=case.runner.max_context_len, num_kv_heads=8,
            num_sms=sms, head_dim=128)


@pytest.mark.parametrize("seed", range(4))
def test_fa4_decode_random_shapes(seed):
    gen = torch.Generator().manual_seed(seed)
    hkv = int(torch.randint(1, 5, (1,), generator=gen))
    group = int(torch.randint(1, 9, (1,), generator=gen))
    topk = int(torch.randint(1, 7, (1,), generator=gen))
    steps = int(torch.randint(2, 6, (1,), generator=gen))
    page = [1, 16, 64][seed % 3]
    case = make_decode_case(bs=int(torch.randint(1, 9, (1,), generator=gen)), topk=topk,
                            steps=steps, page_size=page, device="cuda", seed=seed,
                            max_len=int(torch.randint(10, 900, (1,), generator=gen)),
                            heads=(hkv * group, hkv, 64 if seed == 3 else 128))
    run_decode_round(fa.FA4Decode(case.runner, topk, steps, tree_mode="path"), case)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("page_size,ragged", [(1, True), (16, True), (64, False)])
def test_fa4_extend(dtype, page_size, ragged):
    case = make_extend_case(bs=6, page_size=page_size, ragged=ragged, dtype=dtype,
                            device="cuda", seed=page_size, max_len=500, max_ext=6, heads=GQA)
    run_extend(fa.FA4Extend(case.runner), case)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("page_size,ragged,chunks", [(1, True, 3), (16, True, 8), (64, False, 2)])
def test_fa4_extend_split_prefix(dtype, page_size, ragged, chunks):
    case = make_extend_case(bs=6, page_size=page_size, ragged=ragged, dtype=dtype,
                            device="cuda", seed=40 + page_size, max_len=700, max_ext=6,
                            heads=GQA)
    run_extend(fa.FA4Extend(case.runner, split_prefix=chunks), case)


@pytest.mark.parametrize("page_size", [1, 16])
def test_fa4_extend_one_long_request_routes_to_a_split(page_size):
    """One request of ~32k keys: the auto route splits the prefix over the SMs."""
    case = make_extend_case(bs=1, page_size=page_size, ragged=False, device="cuda",
                            seed=page_size, max_len=32768, max_ext=6, heads=GQA)
    backend = fa.FA4Extend(case.runner)
    assert backend.chunks_for(1) > 1
    run_extend(backend, case)


def test_fa4_extend_split_cuda_graph_replay():
    """A split extend captured in a CUDA graph, replayed with the tokens split otherwise."""
    case = make_extend_case(bs=3, page_size=16, ragged=True, device="cuda", seed=9,
                            max_len=900, max_ext=4, heads=GQA)
    b, runner = case.batch, case.runner
    tokens = int(b.extend_lens.sum())
    backend = fa.FA4Extend(runner, split_prefix=4)
    run_extend(backend, case)  # eager warm-up: compiles every kernel variant
    backend.init_cuda_graph_state(3, tokens)
    backend.init_forward_metadata_capture_cuda_graph(b)
    gen = torch.Generator().manual_seed(0)
    static = qkv(runner, tokens, gen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(case.layer, *static)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = backend.forward(case.layer, *static)
    ext = b.extend_lens.roll(1)
    rows = runner.req_to_token[b.req_pool_indices].long()
    loc = torch.cat([rows[i, int(b.seq_lens[i] - ext[i]):int(b.seq_lens[i])] for i in range(3)])
    other = DraftExtendBatch(b.req_pool_indices, b.seq_lens, ext, loc)
    backend.init_forward_metadata_replay_cuda_graph(other, 3)
    for dst, src in zip(static, qkv(runner, tokens, gen)):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    assert_close_rel(out, reference_extend(runner, case.layer, static[0], other), runner.dtype)


def test_fa3_runs_here():
    """fa3 on this GPU: FlashAttention-3 if installed, else FA4's sm90 kernel (the fallback)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("fa3's sm90 flavour needs a Hopper GPU")
    case = make_decode_case(bs=4, topk=4, steps=3, page_size=16, device="cuda", seed=5,
                            max_len=200, heads=GQA)
    backend = fa.FA3DecodeSM90(case.runner, 4, 3, tree_mode="path")
    expected = _library.FA3Kernel if module_available("flash_attn_interface") \
        else _library.FA4Kernel
    assert isinstance(backend.kernel, expected)
    run_decode_round(backend, case)
    ext = make_extend_case(bs=4, page_size=16, device="cuda", seed=6, max_len=200, heads=GQA)
    run_extend(fa.FA3ExtendSM90(ext.runner), ext)


@pytest.mark.parametrize("topk,page_size,tree_mode,mode,split", [
    (4, 16, "path", "shared", 1), (1, 1, "lane", "shared", 1), (4, 1, "lane", "per-branch", 1),
    (4, 16, "path", "shared", 3), (4, 1, "path", "auto", 1)])
def test_fa4_cuda_graph_replay(topk, page_size, tree_mode, mode, split):
    steps = 4
    case = make_decode_case(bs=3, topk=topk, steps=steps, page_size=page_size,
                            device="cuda", seed=17, max_len=300, heads=GQA)
    backend = fa.FA4Decode(case.runner, topk, steps, tree_mode=tree_mode, mode=mode,
                           split_prefix=split)
    run_decode_round(backend, case)  # eager warm-up: compiles every kernel variant
    backend.init_cuda_graph_state(4, 4 * topk)
    backend.init_forward_metadata_capture_cuda_graph(case.batch)
    lanes = 3 * topk
    gen = torch.Generator().manual_seed(0)
    static = [qkv(case.runner, lanes, gen) for _ in range(steps - 1)]
    graphs, outs = [], []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step in range(steps - 1):  # warm the graph buffers' path once, then capture
            backend.forward(step, case.layer, *static[step])
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(steps - 1):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(backend.forward(step, case.layer, *static[step]))
        graphs.append(g)
    # Replay with another round of two requests, padded to the captured three.
    other = make_case_on(case, seed=4)
    b = other.batch
    two = DraftBatch(b.req_pool_indices[:2], b.seq_lens[:2], b.out_cache_loc[:2],
                     b.parents[:, :2].contiguous())
    backend.init_forward_metadata_replay_cuda_graph(two, 3)
    for step in range(steps - 1):
        q, k, v = qkv(case.runner, lanes, gen)
        for dst, src in zip(static[step], (q, k, v)):
            dst.copy_(src)
        graphs[step].replay()
        torch.cuda.synchronize()
        real = 2 * topk
        ref = reference_decode(case.runner, case.layer, q[:real], two, step, tree_mode)
        assert_close_rel(outs[step][:real], ref, case.runner.dtype)
