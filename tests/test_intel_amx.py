"""``intel_amx`` (the CPU backend) against ``torch_ref``.

Every case fills the whole KV pool with NaN first, then writes real KV only where the request
prefixes live: a backend that reads a slot it should not (padding, another lane's history, a
draft slot not written yet) returns NaN and fails. The new KV of each step is written by the
backend under test; ``reference_decode`` / ``reference_extend`` then read the same pool.

The contract checks (numerics against the reference, pools, graphs, refusals) live in the
conformance kit (``tests/conformance``); this file keeps the ones specific to intel_amx: an
empty prefix, topk 4 with a soft cap on paged uniform batches, backend reuse across rounds
(``cache_prefix``), the declaration and its runtime note.
"""

from __future__ import annotations

import pytest
import torch

from specattn import AttentionLayer, DraftBatch, DraftRunner
from specattn.allocator import PagedKVAllocator
from specattn.backends.intel_amx import IntelAMXDecode, IntelAMXExtend
from specattn.backends.torch_ref import reference_decode
from specattn.keys import BackendRequest
from specattn.platforms import Platform

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 2e-5}
LAYERS = 2
SCALE = 0.3


def _runner(mla: bool, dtype: torch.dtype, page_size: int, slots: int = 2048,
            max_context_len: int = 256) -> DraftRunner:
    if mla:
        runner = DraftRunner.mla(4, 32, 16, num_layers=LAYERS, num_slots=slots, max_reqs=8,
                                 max_context_len=max_context_len, page_size=page_size,
                                 dtype=dtype)
        pools = runner.kv_buffer
    else:  # GQA: 8 query heads over 2 KV heads, value width != key width
        runner = DraftRunner.mha(8, 2, 32, 24, num_layers=LAYERS, num_slots=slots,
                                 max_reqs=8, max_context_len=max_context_len,
                                 page_size=page_size, dtype=dtype)
        pools = runner.k_buffer + runner.v_buffer
    for pool in pools:
        pool.fill_(float("nan"))
    return runner


def _fill(runner: DraftRunner, slots: torch.Tensor) -> None:
    """Random KV at ``slots`` in every layer."""
    pools = runner.kv_buffer if runner.use_mla_backend else runner.k_buffer + runner.v_buffer
    for pool in pools:
        pool[slots] = torch.randn(slots.shape[0], *pool.shape[1:]).to(pool.dtype)


def _requests(runner: DraftRunner, alloc: PagedKVAllocator, lens: list[int]) -> torch.Tensor:
    reqs = []
    for n in lens:
        req = alloc.new_request()
        _fill(runner, alloc.extend(req, n))
        reqs.append(req)
    return torch.tensor(reqs, dtype=torch.int64)


def _qkv(runner: DraftRunner, rows: int, q_gain: float = 1.0):
    dt = runner.dtype
    if runner.use_mla_backend:
        width = runner.kv_lora_rank + runner.qk_rope_head_dim
        return ((torch.randn(rows, runner.num_heads, width) * q_gain).to(dt),
                torch.randn(rows, width).to(dt), None)
    return ((torch.randn(rows, runner.num_q_heads, runner.head_dim) * q_gain).to(dt),
            torch.randn(rows, runner.num_kv_heads, runner.head_dim).to(dt),
            torch.randn(rows, runner.num_kv_heads, runner.v_head_dim).to(dt))


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not ref.isnan().any(), "the reference read a NaN slot: the test setup is wrong"
    assert not out.isnan().any(), "intel_amx read a slot outside the visible set"
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.float().abs().max().item()), err


def _decode_round(backend: IntelAMXDecode, runner: DraftRunner, alloc: PagedKVAllocator,
                  reqs: torch.Tensor, logit_cap: float = 0.0) -> None:
    """One draft round through ``backend``, each step and layer checked against the ref."""
    topk, steps, mode = backend.topk, backend.num_steps, backend.tree_mode
    seq_lens = alloc.seq_lens(reqs.tolist())
    loc = alloc.alloc_draft(reqs, topk, steps)
    parents = torch.zeros(steps, len(reqs), topk, dtype=torch.int64) if mode == "path" else None
    batch = DraftBatch(reqs, seq_lens, loc, parents)
    backend.init_forward_metadata(batch)
    for step in range(steps):
        if parents is not None and step > 0:
            parents[step] = torch.randint(0, topk, (len(reqs), topk))  # filled in place
        for lid in range(LAYERS):
            layer = AttentionLayer(lid, SCALE, logit_cap)
            q, k, v = _qkv(runner, len(reqs) * topk)
            out = backend.forward(step, layer, q, k, v)
            _check(out, reference_decode(runner, layer, q, batch, step, mode), runner.dtype)
    alloc.release_draft()


@pytest.mark.parametrize("mla", (False, True))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("page_size", (1, 16))
def test_decode_with_an_empty_prefix(mla, dtype, page_size):
    """A request with no prefix (L = 0: only its draft history) next to ragged lengths that
    cross page borders, topk 4; the kit's shortest prefix is L = 1."""
    runner = _runner(mla, dtype, page_size)
    alloc = PagedKVAllocator(runner)
    reqs = _requests(runner, alloc, [37, 0, 1, 70])
    for mode in ("lane", "path"):
        backend = IntelAMXDecode(runner, 4, 3, tree_mode=mode)
        _decode_round(backend, runner, alloc, reqs)


@pytest.mark.parametrize("mla", (False, True))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_decode_logit_cap_uniform(mla, dtype):
    runner = _runner(mla, dtype, 16)
    alloc = PagedKVAllocator(runner)
    reqs = _requests(runner, alloc, [32, 32, 32])
    backend = IntelAMXDecode(runner, 4, 4, tree_mode="path")
    _decode_round(backend, runner, alloc, reqs, logit_cap=1.5)  # small cap: it matters


@pytest.mark.parametrize("cache_prefix", (True, False))
def test_decode_rounds_see_the_new_prefix(cache_prefix):
    """Rounds reuse the backend (and its per-layer buffers): round 2 has the same padded
    shape but request 1 gained tokens after round 1; round 3 re-shapes the buffers."""
    runner = _runner(False, torch.float32, 1)
    alloc = PagedKVAllocator(runner)
    reqs = _requests(runner, alloc, [20, 9])
    backend = IntelAMXDecode(runner, 2, 3, cache_prefix=cache_prefix)
    _decode_round(backend, runner, alloc, reqs)
    _fill(runner, alloc.extend(int(reqs[1]), 3))
    _decode_round(backend, runner, alloc, reqs)
    reqs = torch.cat([reqs, _requests(runner, alloc, [41])])
    _decode_round(backend, runner, alloc, reqs)


def test_declaration_and_runtime_note():
    request = BackendRequest(kind="decode", mla=True, topk=8, num_steps=5, page_size=64,
                             tree_mode="path", dtype=torch.float16)
    assert IntelAMXDecode.validate(request, Platform("cpu")) == []
    assert IntelAMXDecode.validate(request, Platform("cuda", (9, 0)))
    assert "AMX tiles" in IntelAMXDecode.runtime_note(Platform("cpu", cpu_has_amx=True))
    assert "no AMX" in IntelAMXExtend.runtime_note(Platform("cpu", cpu_has_amx=False))
