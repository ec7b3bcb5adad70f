"""Triton backend on the CPU interpreter (TRITON_INTERPRET=1, set by conftest) vs torch_ref.

Tiny shapes (the interpreter is slow): B = 2, L <= 40, head dim 16/32, MLA rank 32 + rope 16.
Scratch buffers are NaN-poisoned before every call, so an unwritten partial shows up.

The contract checks (numerics against the reference, pools, graphs, refusals) live in the
conformance kit (``tests/conformance``); this file keeps the ones specific to Triton: the
``mode``, ``config``, ``num_splits`` and ``max_extend_len`` options, kernel variants and the
fused KV write / merge, split planning, an empty prefix, the sm90 compile check.
"""

from __future__ import annotations

import pytest
import torch

from helpers import (DEV, close, decode_sizes, place_decode_round, place_extend_round,
                     randomize_pools, require_triton_interpret)
from specattn.backends.torch_ref import reference_decode, reference_extend
from specattn.data import AttentionLayer, DraftRunner
from specattn.errors import InvalidInputError

require_triton_interpret()

from specattn.backends.triton import TritonDecode, TritonExtend, launchers  # noqa: E402
from specattn.backends.triton.launchers import KernelConfig  # noqa: E402


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    close(out, ref, dtype, "NaN in the output (unwritten partial?)")


def make_runner(model: str, dtype, *, page: int, num_slots: int, max_reqs: int,
                max_ctx: int) -> DraftRunner:
    if model == "mha":
        runner = DraftRunner.mha(4, 2, 32, num_layers=2, num_slots=num_slots,
                                 max_reqs=max_reqs, max_context_len=max_ctx, page_size=page,
                                 dtype=dtype, device=DEV)
    else:
        runner = DraftRunner.mla(4, 32, 16, num_layers=2, num_slots=num_slots,
                                 max_reqs=max_reqs, max_context_len=max_ctx, page_size=page,
                                 dtype=dtype, device=DEV)
    return randomize_pools(runner)


def make_decode(model, dtype, *, topk, steps, page, seq_lens, tree_mode="lane"):
    num_slots, max_ctx = decode_sizes(seq_lens, topk, steps, page)
    runner = make_runner(model, dtype, page=page, num_slots=num_slots,
                         max_reqs=len(seq_lens) + 3, max_ctx=max_ctx)
    return runner, place_decode_round(runner, seq_lens, topk, steps, page, tree_mode)


def new_qkv(runner: DraftRunner, rows: int, dtype):
    if runner.use_mla_backend:
        w = runner.kv_lora_rank + runner.qk_rope_head_dim
        return (torch.randn(rows, runner.num_heads, w, device=DEV).to(dtype),
                torch.randn(rows, w, device=DEV).to(dtype), None)
    return (torch.randn(rows, runner.num_q_heads, runner.head_dim, device=DEV).to(dtype),
            torch.randn(rows, runner.num_kv_heads, runner.head_dim, device=DEV).to(dtype),
            torch.randn(rows, runner.num_kv_heads, runner.v_head_dim, device=DEV).to(dtype))


def _poison(backend) -> None:
    backend._active.mid_o.fill_(float("nan"))
    backend._active.mid_lse.fill_(float("nan"))


def run_decode_round(runner, batch, backend, dtype, layer, tree_mode):
    bs, topk, steps = batch.out_cache_loc.shape
    backend.init_forward_metadata(batch)
    for step in range(steps):
        if tree_mode == "path" and step > 0:
            batch.parents[step] = torch.randint(0, topk, (bs, topk), device=DEV)
        q, k, v = new_qkv(runner, bs * topk, dtype)
        _poison(backend)
        out = backend.forward(step, layer, q, k, v)
        ref = reference_decode(runner, layer, q, batch, step, tree_mode)
        assert out.shape == ref.shape
        _close(out, ref, dtype)


PER_BRANCH_CASES = [
    # model, dtype, topk, page, tree_mode, seq_lens (the default mode="shared" is the kit's)
    ("mha", torch.bfloat16, 4, 16, "lane", [24, 24]),
    ("mha", torch.float16, 4, 1, "path", [9, 40]),
    ("mla", torch.bfloat16, 4, 16, "lane", [29, 11]),
]


@pytest.mark.parametrize("model,dtype,topk,page,tree_mode,seq_lens", PER_BRANCH_CASES)
def test_per_branch_decode_matches_reference(model, dtype, topk, page, tree_mode, seq_lens):
    runner, batch = make_decode(model, dtype, topk=topk, steps=3, page=page,
                                seq_lens=seq_lens, tree_mode=tree_mode)
    backend = TritonDecode(runner, topk, 3, tree_mode=tree_mode, mode="per-branch")
    layer = AttentionLayer(layer_id=1, scaling=runner.head_dim ** -0.5)
    run_decode_round(runner, batch, backend, dtype, layer, tree_mode)


MLA_VARIANTS = [
    # topk, tree_mode, seq_lens, config (v3 MLA kernel variants; rows = topk * 4 heads)
    (8, "path", [23, 40], KernelConfig(16, 16, 4, 2, mla_v3=True, dv_split=2)),
    (4, "lane", [40, 9], KernelConfig(16, 32, 4, 2, mla_v3=True, v_reload=True)),
    (2, "path", [31, 0], KernelConfig(16, 16, 4, 2, mla_v3=True, dv_split=2, v_reload=True)),
]


@pytest.mark.parametrize("topk,tree_mode,seq_lens,config", MLA_VARIANTS)
def test_mla_kernel_variants(topk, tree_mode, seq_lens, config):
    """The MLA v3 stage-1 variants (V split over two programs, V reload, several row blocks;
    tail fused into the last split, so the last partial must hold it)."""
    runner, batch = make_decode("mla", torch.bfloat16, topk=topk, steps=3, page=1,
                                seq_lens=seq_lens, tree_mode=tree_mode)
    backend = TritonDecode(runner, topk, 3, tree_mode=tree_mode, config=config)
    layer = AttentionLayer(layer_id=0, scaling=0.15)
    run_decode_round(runner, batch, backend, torch.bfloat16, layer, tree_mode)


def test_config_and_split_count():
    """MLA with >= 64 rows per group takes the v3 kernel at one wave; below 2 waves the split
    count rounds down (one full wave, no stragglers); the generic kernel adds a tail part."""
    shape = launchers.AttnShape(16, 1, 512, 64, 512, True)
    cfg = launchers.choose_config(shape, 64)
    assert cfg.mla_v3 and not launchers.choose_config(shape, 16).mla_v3
    assert launchers.num_parts(cfg, 4) == 4
    assert launchers.num_parts(launchers.choose_config(shape, 16), 4) == 5
    cpu = torch.device("cpu")  # 4 "SMs" on the interpreter
    assert launchers.plan_splits(shape, cfg, 64, 3, cpu, 1.0, extend=False) == 1
    assert launchers.plan_splits(shape, cfg, 64, 1, cpu, 1.0, extend=False) == 4
    assert launchers.plan_splits(shape, cfg, 64, 3, cpu, 6.0, extend=False) == 8


@pytest.mark.parametrize("num_splits", [1, 7])
def test_decode_logit_cap_and_fixed_splits(num_splits):
    runner, batch = make_decode("mha", torch.float32, topk=2, steps=2, page=1,
                                seq_lens=[40, 3], tree_mode="path")
    backend = TritonDecode(runner, 2, 2, tree_mode="path", num_splits=num_splits)
    layer = AttentionLayer(layer_id=0, scaling=0.5, logit_cap=3.0)
    run_decode_round(runner, batch, backend, torch.float32, layer, "path")


def test_decode_zero_length_prefix():
    """seq_lens = 0: only the history contributes (every split of the prefix is empty)."""
    runner, batch = make_decode("mha", torch.float32, topk=2, steps=2, page=1,
                                seq_lens=[0, 19])
    backend = TritonDecode(runner, 2, 2)
    run_decode_round(runner, batch, backend, torch.float32,
                     AttentionLayer(layer_id=0, scaling=0.25), "lane")


def make_extend(model, dtype, *, page, seq_lens, ext_lens):
    bs = len(seq_lens)
    num_slots = sum(seq_lens) + 8
    runner = make_runner(model, dtype, page=page, num_slots=num_slots, max_reqs=bs + 2,
                         max_ctx=max(seq_lens) + page)
    return runner, place_extend_round(runner, seq_lens, ext_lens)


def test_extend_mla_v_split_config():
    """fp16 MLA extend through the V-split variant with several row blocks (6 tokens x 4
    heads > 16 rows)."""
    runner, batch = make_extend("mla", torch.float16, page=1, seq_lens=[36, 8], ext_lens=[6, 2])
    backend = TritonExtend(runner, config=KernelConfig(16, 16, 4, 2, mla_v3=True, dv_split=2))
    layer = AttentionLayer(layer_id=1, scaling=0.2)
    backend.init_forward_metadata(batch)
    q, k, v = new_qkv(runner, 8, torch.float16)
    _poison(backend)
    out = backend.forward(layer, q, k, v)
    _close(out, reference_extend(runner, layer, q, batch), torch.float16)


@pytest.mark.parametrize("ext_lens", [[3, 3, 3], [1, 3, 2]])
def test_extend_graph_grid_bounded_by_max_extend_len(ext_lens):
    """``max_extend_len`` sizes the graph grid for at most that many rows per request (the
    fixed ``S + 1`` slots of semantics.md): same result as the reference, fewer row blocks."""
    runner, batch = make_extend("mha", torch.float32, page=4, seq_lens=[20, 9, 13],
                                ext_lens=ext_lens)
    n = sum(ext_lens)
    loose, tight = TritonExtend(runner), TritonExtend(runner, max_extend_len=3)
    for backend in (loose, tight):
        backend.init_cuda_graph_state(max_bs=3, max_num_tokens=n)
        backend.init_forward_metadata_capture_cuda_graph(batch)
    assert tight._round_plan["rows_per_group"] < loose._round_plan["rows_per_group"]
    layer = AttentionLayer(layer_id=0, scaling=0.2)
    q, k, v = new_qkv(runner, n, torch.float32)
    _poison(tight)
    _close(tight.forward(layer, q, k, v), reference_extend(runner, layer, q, batch),
           torch.float32)


def test_extend_max_extend_len_is_checked():
    runner, batch = make_extend("mha", torch.float32, page=1, seq_lens=[20, 9], ext_lens=[4, 1])
    backend = TritonExtend(runner, max_extend_len=3)
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=5)
    with pytest.raises(InvalidInputError, match=r"batch.extend_lens.*max_extend_len=3.*4"):
        backend.init_forward_metadata_capture_cuda_graph(batch)
    with pytest.raises(InvalidInputError, match="max_extend_len"):
        TritonExtend(runner, max_extend_len=0)


def test_bad_mode_and_order():
    runner, batch = make_decode("mha", torch.float32, topk=1, steps=1, page=1, seq_lens=[4])
    with pytest.raises(InvalidInputError, match="mode"):
        TritonDecode(runner, 1, 1, mode="cascade")
    backend = TritonDecode(runner, 1, 1)
    with pytest.raises(InvalidInputError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_replay_cuda_graph(batch, 1)


def _check_fusion_state(runner, backend, layer_id: int, slots: torch.Tensor, k, v) -> None:
    """After a forward: the new KV is in the pool at its slots, the counters are re-armed."""
    slots = slots.reshape(-1).long()
    if runner.use_mla_backend:
        torch.testing.assert_close(runner.kv_buffer[layer_id][slots], k, rtol=0, atol=0)
    else:
        torch.testing.assert_close(runner.k_buffer[layer_id][slots], k, rtol=0, atol=0)
        torch.testing.assert_close(runner.v_buffer[layer_id][slots], v, rtol=0, atol=0)
    assert int(backend._active.counter.abs().sum()) == 0


FUSION_CASES = [
    # model, topk, tree_mode, mode, config: every KV write (in the kernel's first split or
    # tail, one launch, torch) and the fused merge; MLA with topk 8 = 32 rows -> two 16-row
    # blocks per request
    ("mha", 4, "path", "shared", KernelConfig(16, 16, 4, 2, fuse_merge=True)),
    ("mha", 2, "lane", "per-branch", KernelConfig(16, 16, 4, 2, kv_write="tail",
                                                  fuse_merge=True)),
    ("mha", 4, "lane", "shared", KernelConfig(16, 16, 4, 2, kv_write="torch")),
    ("mha", 4, "path", "shared", KernelConfig(16, 16, 4, 2, kv_write="kernel")),
    ("mla", 8, "lane", "shared", KernelConfig(16, 16, 4, 2, kv_write="tail", fuse_merge=True)),
    ("mla", 8, "path", "shared", KernelConfig(16, 16, 4, 2, mla_v3=True, fuse_merge=True)),
    ("mla", 4, "path", "shared", KernelConfig(16, 32, 4, 2, mla_v3=True, kv_write="tail")),
    ("mla", 2, "lane", "shared", KernelConfig(16, 32, 4, 2, kv_write="kernel")),
]


@pytest.mark.parametrize("model,topk,tree_mode,mode,config", FUSION_CASES)
def test_fused_write_and_merge(model, topk, tree_mode, mode, config):
    dtype, steps = torch.bfloat16, 3
    runner, batch = make_decode(model, dtype, topk=topk, steps=steps, page=4,
                                seq_lens=[26, 37], tree_mode=tree_mode)
    backend = TritonDecode(runner, topk, steps, tree_mode=tree_mode, mode=mode, config=config,
                           num_splits=3)
    layer = AttentionLayer(layer_id=1, scaling=0.2)
    backend.init_forward_metadata(batch)
    for step in range(steps):
        if tree_mode == "path" and step > 0:
            batch.parents[step] = torch.randint(0, topk, (2, topk), device=DEV)
        q, k, v = new_qkv(runner, 2 * topk, dtype)
        _poison(backend)
        out = backend.forward(step, layer, q, k, v)
        _close(out, reference_decode(runner, layer, q, batch, step, tree_mode), dtype)
        _check_fusion_state(runner, backend, 1, batch.out_cache_loc[:, :, step], k, v)


@pytest.mark.parametrize("model,config", [
    ("mha", KernelConfig(16, 16, 4, 2, fuse_merge=True)),
    ("mha", KernelConfig(16, 16, 4, 2, kv_write="tail")),
    ("mha", KernelConfig(16, 16, 4, 2, kv_write="torch")),
    ("mla", KernelConfig(16, 16, 4, 2, mla_v3=True, fuse_merge=True)),
    ("mla", KernelConfig(16, 16, 4, 2, mla_v3=True, kv_write="kernel")),
])
def test_extend_fused_write_and_merge(model, config):
    runner, batch = make_extend(model, torch.bfloat16, page=1, seq_lens=[30, 19],
                                ext_lens=[6, 3])
    backend = TritonExtend(runner, config=config)
    layer = AttentionLayer(layer_id=0, scaling=0.2)
    backend.init_forward_metadata(batch)
    q, k, v = new_qkv(runner, 9, torch.bfloat16)
    _poison(backend)
    out = backend.forward(layer, q, k, v)
    _close(out, reference_extend(runner, layer, q, batch), torch.bfloat16)
    _check_fusion_state(runner, backend, 0, batch.out_cache_loc, k, v)


def test_fuse_merge_needs_one_output_program():
    with pytest.raises(InvalidInputError, match="config.fuse_merge"):
        KernelConfig(64, 64, 8, 2, mla_v3=True, dv_split=2, fuse_merge=True)
    with pytest.raises(InvalidInputError, match="config.dv_split"):
        KernelConfig(32, 32, 4, 2, dv_split=2)
    with pytest.raises(InvalidInputError, match="config.kv_write"):
        KernelConfig(32, 32, 4, 2, kv_write="later")

