"""The call protocol the base classes run around every backend's hooks (``specattn.base``):
call order, validation before any write, the KV-write policy, soft caps, extra keywords, and
the CUDA-graph round buffers (padding, ``parents`` kept per captured batch size).

Backends here are ``torch_ref`` (its ``_attend`` is the reference itself) and small test
subclasses; outputs are compared with ``torch_ref``'s functions on the caller's batch.
"""

from __future__ import annotations

import pytest
import torch

from helpers import decode_sizes, place_decode_round, random_qkv, randomize_pools
from specattn import DraftDecodeBackend, DraftExtendBackend
from specattn.backends.torch_ref import (TorchRefDecode, TorchRefExtend, reference_decode,
                                         reference_extend)
from specattn.data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner
from specattn.errors import CallOrderError, InvalidInputError, RegistrationError

LAYER = AttentionLayer(0, 0.25)


def _decode_case(seq_lens, topk=2, steps=3, tree_mode="lane", seed=0):
    torch.manual_seed(seed)
    slots, ctx = decode_sizes(seq_lens, topk, steps, 1)
    runner = randomize_pools(DraftRunner.mha(4, 2, 16, num_layers=1, num_slots=slots + 64,
                                             max_reqs=8, max_context_len=ctx,
                                             dtype=torch.float32))
    return runner, place_decode_round(runner, seq_lens, topk, steps, 1, tree_mode)


def _pools(runner):
    return [runner.k_buffer[0].clone(), runner.v_buffer[0].clone()]


def test_call_order_is_one_error_type():
    runner, batch = _decode_case([5, 7])
    for backend, call in ((TorchRefDecode(runner, 2, 3),
                           lambda b: b.forward(0, LAYER, *random_qkv(runner, 4))),
                          (TorchRefExtend(runner), lambda b: b.forward(LAYER, *random_qkv(
                              runner, 2)))):
        with pytest.raises(CallOrderError, match="^init_forward_metadata: expected a call "
                           r"before forward\(\)") as info:
            call(backend)
        assert isinstance(info.value, RuntimeError) and isinstance(info.value,
                                                                   InvalidInputError)
        assert info.value.argument == "init_forward_metadata"
    decode = TorchRefDecode(runner, 2, 3)
    with pytest.raises(CallOrderError, match="^init_cuda_graph_state: "):
        decode.init_forward_metadata_capture_cuda_graph(batch)
    with pytest.raises(CallOrderError, match="^init_cuda_graph_state: "):
        TorchRefExtend(runner).init_forward_metadata_replay_cuda_graph(batch, 2)


def test_bad_calls_are_refused_before_anything_is_written(scoped_registry):
    class NoCap(TorchRefDecode, name="protocol_no_cap"):
        soft_cap_models = frozenset()

    runner, batch = _decode_case([5, 7])
    backend = NoCap(runner, 2, 3)
    backend.init_forward_metadata(batch)
    q, k, v = random_qkv(runner, 4)
    before = _pools(runner)
    with pytest.raises(InvalidInputError, match=r"^layer\.logit_cap: .*no logit soft cap "
                       "for MHA"):
        backend.forward(0, AttentionLayer(0, 0.25, logit_cap=5.0), q, k, v)
    with pytest.raises(InvalidInputError, match="^step: "):
        backend.forward(3, LAYER, q, k, v)
    with pytest.raises(InvalidInputError, match="^q: "):
        backend.forward(0, LAYER, q[:3], k, v)
    with pytest.raises(TypeError, match="attn_sink"):
        backend.forward(0, LAYER, q, k, v, attn_sink=torch.zeros(4))
    for old, new in zip(before, _pools(runner)):
        assert torch.equal(old.nan_to_num(7.0), new.nan_to_num(7.0))


@pytest.mark.parametrize("fused", [False, True])
def test_kv_write_policy(scoped_registry, fused):
    """``forward`` writes the new KV before ``_attend`` unless the kernel does it."""
    seen = {}

    class Probe(DraftDecodeBackend, name="protocol_probe"):
        def _kernel_writes_kv(self):
            return fused

        def _attend(self, step, layer, q, k, v):
            slots = self.batch.out_cache_loc[:, :, step].reshape(-1)
            seen["written"] = torch.equal(self.runner.k_buffer[0][slots], k)
            return torch.zeros(q.shape[0], q.shape[1], self.runner.v_head_dim)

    runner, batch = _decode_case([4, 6])
    backend = Probe(runner, 2, 3)
    backend.init_forward_metadata(batch)
    backend.forward(1, LAYER, *random_qkv(runner, 4))
    assert seen["written"] is not fused


@pytest.mark.parametrize("fused", [False, True])
def test_write_kv_hook_stores_the_steps_kv(scoped_registry, fused):
    """``_write_kv(layer, loc, k, v)`` is the write ``forward`` makes (decode: the step's
    slots, extend: the round's), once, before ``_attend``; never when the kernel writes."""
    calls = []

    class Writer:
        def _kernel_writes_kv(self):
            return fused

        def _write_kv(self, layer, loc, k, v):
            calls.append((layer.layer_id, loc.clone()))
            self.runner.write_kv(layer.layer_id, loc, k * 2, v * 2)  # its own way

    class Decode(Writer, TorchRefDecode, name="protocol_writer_decode"):
        pass

    class Extend(Writer, TorchRefExtend, name="protocol_writer_extend"):
        pass

    runner, batch = _decode_case([4, 6])
    decode = Decode(runner, 2, 3)
    decode.init_forward_metadata(batch)
    q, k, v = random_qkv(runner, 4)
    decode.forward(1, LAYER, q, k, v)
    slots = batch.out_cache_loc[:, :, 1]
    if fused:
        assert calls == []
    else:
        ((layer_id, loc),) = calls
        assert layer_id == 0 and torch.equal(loc, slots)
        assert torch.equal(runner.k_buffer[0][slots.reshape(-1)], (k * 2).reshape(4, 2, 16))

    calls.clear()
    ext = DraftExtendBatch(batch.req_pool_indices, batch.seq_lens, torch.tensor([1, 1]),
                           batch.out_cache_loc[:, 0, 0])
    runner.req_to_token[ext.req_pool_indices, ext.seq_lens - 1] = ext.out_cache_loc.to(
        runner.req_to_token.dtype)  # each request's last token is the new one
    extend = Extend(runner)
    extend.init_forward_metadata(ext)
    q, k, v = random_qkv(runner, 2)
    extend.forward(LAYER, q, k, v)
    assert len(calls) == (0 if fused else 1)
    if not fused:
        assert torch.equal(calls[0][1], ext.out_cache_loc)
        assert torch.equal(runner.v_buffer[0][ext.out_cache_loc], (v * 2).reshape(2, 2, 16))


def test_a_registered_backend_implements_attend(scoped_registry):
    with pytest.raises(RegistrationError, match="neither _attend"):
        class Empty(DraftExtendBackend, name="protocol_empty"):
            pass


@pytest.mark.parametrize("base,batch", [(DraftDecodeBackend, DraftBatch),
                                        (DraftExtendBackend, DraftExtendBatch)])
def test_attend_docstring_lists_what_it_may_read(base, batch):
    """A backend author learns the inputs from ``_attend``'s docstring: every field of the
    batch, the runner's table, pools and shape, and the layer's fields."""
    import dataclasses

    doc = " ".join(base._attend.__doc__.split())
    assert "What it may read" in doc and "reference" in doc
    for name in [f.name for f in dataclasses.fields(batch)] + [
            "self.runner", "req_to_token", "page_size", "layer.scaling", "layer.logit_cap"]:
        assert name in doc, name


def test_padded_replay_matches_the_eager_reference():
    """A replay with fewer requests than captured: padded lanes (request 0, seq_lens 1,
    slot 0) leave the real lanes exactly as an eager call computes them."""
    runner, small = _decode_case([6, 9], seed=3)
    backend = TorchRefDecode(runner, 2, 3)
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=8)
    backend.init_forward_metadata_capture_cuda_graph(DraftBatch(
        *(torch.cat([t, t[:1]]) for t in (small.req_pool_indices, small.seq_lens,
                                          small.out_cache_loc))))
    with pytest.raises(InvalidInputError, match=r"^bs: expected an int in \[2, 4\]"):
        backend.init_forward_metadata_replay_cuda_graph(small, 5)
    backend.init_forward_metadata_replay_cuda_graph(small, 3)
    assert backend.batch.batch_size == 3 and backend.num_lanes == 6
    assert backend.batch.seq_lens[2] == 1 and not backend.batch.out_cache_loc[2].any()
    q, k, v = random_qkv(runner, 6)
    out = backend.forward(0, LAYER, q, k, v)
    runner.write_kv(0, small.out_cache_loc[:, :, 0], k[:4], v[:4])
    torch.testing.assert_close(out[:4], reference_decode(runner, LAYER, q[:4], small, 0))


def test_path_replay_reads_the_parents_given_at_capture():
    """The graph reads the ``parents`` tensor of its capture; a replay's values go into it
    (per captured batch size), and forward computes with them."""
    runner, batch = _decode_case([5, 8], tree_mode="path", seed=5)
    backend = TorchRefDecode(runner, 2, 3, tree_mode="path")
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=4)
    captured = batch.parents.clone()
    backend.init_forward_metadata_capture_cuda_graph(
        DraftBatch(batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, captured))
    replay = DraftBatch(batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc,
                        torch.tensor([[[0, 0], [0, 0]], [[1, 1], [0, 1]], [[0, 1], [1, 0]]]))
    backend.init_forward_metadata_replay_cuda_graph(replay, 2)
    assert torch.equal(captured, replay.parents) and backend.batch.parents is captured
    q, k, v = random_qkv(runner, 4)
    out = backend.forward(2, LAYER, q, k, v)
    torch.testing.assert_close(out, reference_decode(runner, LAYER, q, replay, 2, "path"))


def test_path_rows_written_to_a_replays_own_parents_are_refused():
    """The draft loop fills ``parents`` row by row after the replay call: rows written to a
    replay's own tensor (copied into the capture's, or padded, at the call) would be unseen,
    so forward refuses them; the capture's tensor filled in place is read."""
    runner, batch = _decode_case([5, 8], tree_mode="path", seed=7)
    q, k, v = random_qkv(runner, 4)
    for captured_bs in (2, None):  # a size captured, and one never captured (padded to 3)
        backend = TorchRefDecode(runner, 2, 3, tree_mode="path")
        backend.init_cuda_graph_state(max_bs=3, max_num_tokens=6)
        fixed = torch.zeros(3, 2, 2, dtype=torch.long)
        if captured_bs:
            backend.init_forward_metadata_capture_cuda_graph(
                DraftBatch(batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, fixed))
        own = torch.zeros(3, 2, 2, dtype=torch.long)
        backend.init_forward_metadata_replay_cuda_graph(
            DraftBatch(batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, own),
            captured_bs or 3)
        rows = 4 if captured_bs else 6
        backend.forward(0, LAYER, *random_qkv(runner, rows))
        own[1] = torch.tensor([[1, 0], [0, 1]])
        with pytest.raises(InvalidInputError, match=r"^batch\.parents: expected each row "
                           r"filled in place in the tensor given at capture .*got row 1 of "
                           r"the replay's tensor written after init_forward_metadata_replay"):
            backend.forward(1, LAYER, *random_qkv(runner, rows))
    backend = TorchRefDecode(runner, 2, 3, tree_mode="path")
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=4)
    fixed = torch.zeros(3, 2, 2, dtype=torch.long)
    capture = DraftBatch(batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, fixed)
    backend.init_forward_metadata_capture_cuda_graph(capture)
    backend.init_forward_metadata_replay_cuda_graph(capture, 2)
    backend.forward(0, LAYER, q, k, v)
    fixed[1] = torch.tensor([[1, 0], [0, 1]])
    q, k, v = random_qkv(runner, 4)
    out = backend.forward(1, LAYER, q, k, v)
    torch.testing.assert_close(out, reference_decode(runner, LAYER, q, capture, 1, "path"))


def test_a_padded_replay_refuses_a_request_token_in_slot_0():
    """The padding lanes of a replay write pool slot 0 at every step: a prefix token or a
    draft slot of a real request there would be overwritten (and read back by its lanes)."""
    runner, batch = _decode_case([5, 8])
    backend = TorchRefDecode(runner, 2, 3)
    backend.init_cuda_graph_state(max_bs=3, max_num_tokens=6)
    backend.init_forward_metadata_replay_cuda_graph(batch, 2)  # not padded: slot 0 unused
    row = int(batch.req_pool_indices[1])
    kept = runner.req_to_token[row, 3].item()
    runner.req_to_token[row, 3] = 0
    with pytest.raises(InvalidInputError, match=rf"^runner\.req_to_token: expected no prefix "
                       rf"token in slot 0 in a replay padded to the captured size .*got "
                       rf"req_to_token\[{row}, 3\] = 0 \(request 1\)$"):
        backend.init_forward_metadata_replay_cuda_graph(batch, 3)
    backend.init_forward_metadata_replay_cuda_graph(batch, 2)  # no padding lane writes it
    runner.req_to_token[row, 3] = kept
    loc = batch.out_cache_loc.clone()
    loc[0, 1, 2] = 0
    with pytest.raises(InvalidInputError, match=r"^batch\.out_cache_loc: expected no slot 0 "
                       r"in a replay padded .*got slot 0 at out_cache_loc\[0, 1, 2\]$"):
        backend.init_forward_metadata_replay_cuda_graph(
            DraftBatch(batch.req_pool_indices, batch.seq_lens, loc), 3)


def test_an_extend_replay_padded_by_the_engine_with_fewer_tokens_runs():
    """An engine pads an extend round to the captured requests with requests of row 0 whose
    tokens write slot 0; with fewer new tokens than the capture the backend pads the rest to
    slot 0 too. The engine's padding tokens in slot 0 are not a request token there: the
    replay runs and the real request matches the reference, while a real request's token in
    slot 0 is still refused."""
    runner, _ = _decode_case([5])
    runner.req_to_token[1, :6] = torch.arange(1, 7, dtype=torch.int32)
    runner.req_to_token[0, :4] = torch.arange(10, 14, dtype=torch.int32)  # another request
    backend = TorchRefExtend(runner)
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=8)
    backend.init_forward_metadata_capture_cuda_graph(DraftExtendBatch(
        torch.zeros(2, dtype=torch.long), torch.full((2,), 4), torch.full((2,), 4),
        torch.zeros(8, dtype=torch.long)))
    padded = DraftExtendBatch(torch.tensor([1, 0]), torch.tensor([6, 1]), torch.tensor([3, 1]),
                              torch.tensor([4, 5, 6, 0]))
    backend.init_forward_metadata_replay_cuda_graph(padded, 2)
    q, k, v = random_qkv(runner, 4)
    out = backend.forward(LAYER, q, k, v)
    real = DraftExtendBatch(torch.tensor([1]), torch.tensor([6]), torch.tensor([3]),
                            torch.tensor([4, 5, 6]))
    torch.testing.assert_close(out[:3], reference_extend(runner, LAYER, q[:3], real))
    runner.req_to_token[1, 5] = 0
    stray = DraftExtendBatch(torch.tensor([1, 0]), torch.tensor([6, 1]), torch.tensor([3, 1]),
                             torch.tensor([4, 5, 0, 0]))
    with pytest.raises(InvalidInputError, match=r"^batch\.out_cache_loc: expected no slot 0 "
                       r"in a replay padded .*got slot 0 at out_cache_loc\[2\]$"):
        backend.init_forward_metadata_replay_cuda_graph(stray, 2)


@pytest.mark.parametrize("max_num_tokens", [0, -5, 2.0])
def test_decode_graph_state_bounds(max_num_tokens):
    runner, _ = _decode_case([5])
    with pytest.raises(InvalidInputError, match="^max_num_tokens: expected an int >= 1"):
        TorchRefDecode(runner, 2, 3).init_cuda_graph_state(2, max_num_tokens)


def test_extend_graph_round_bounds():
    runner, _ = _decode_case([5])
    backend = TorchRefExtend(runner)
    with pytest.raises(InvalidInputError, match="^max_num_tokens: "):
        backend.init_cuda_graph_state(max_bs=2, max_num_tokens=1)
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=3)
    runner.req_to_token[0, :6] = torch.arange(1, 7, dtype=torch.int32)
    big = DraftExtendBatch(torch.tensor([0]), torch.tensor([6]), torch.tensor([4]),
                           torch.arange(3, 7))
    with pytest.raises(InvalidInputError, match="^batch: expected at most 2 requests and 3 "
                       "tokens"):
        backend.init_forward_metadata_capture_cuda_graph(big)
    ok = DraftExtendBatch(torch.tensor([0]), torch.tensor([6]), torch.tensor([3]),
                          torch.arange(4, 7))
    backend.init_forward_metadata_capture_cuda_graph(ok)
    assert backend.num_tokens == 3 and torch.equal(backend.batch.out_cache_loc,
                                                   torch.arange(4, 7))


def test_a_batch_of_the_other_kind_is_refused_by_name():
    runner, batch = _decode_case([5, 7])
    ext = DraftExtendBatch(batch.req_pool_indices, batch.seq_lens, torch.tensor([1, 1]),
                           batch.out_cache_loc[:, 0, 0])
    with pytest.raises(InvalidInputError, match=r"^batch: expected a specattn\.DraftBatch"):
        TorchRefDecode(runner, 2, 3).init_forward_metadata(ext)
    with pytest.raises(InvalidInputError,
                       match=r"^batch: expected a specattn\.DraftExtendBatch"):
        TorchRefExtend(runner).init_forward_metadata(batch)


def test_a_path_replay_at_a_size_never_captured_pads_the_parents():
    runner, batch = _decode_case([5, 8], tree_mode="path", seed=6)
    batch.parents[1:] = torch.tensor([[1, 0], [0, 1]])
    backend = TorchRefDecode(runner, 2, 3, tree_mode="path")
    backend.init_cuda_graph_state(max_bs=3, max_num_tokens=6)
    backend.init_forward_metadata_replay_cuda_graph(batch, 3)
    assert tuple(backend.batch.parents.shape) == (3, 3, 2)
    q, k, v = random_qkv(runner, 6)
    out = backend.forward(2, LAYER, q, k, v)
    runner.write_kv(0, batch.out_cache_loc[:, :, 2], k[:4], v[:4])
    torch.testing.assert_close(out[:4], reference_decode(runner, LAYER, q[:4], batch, 2, "path"))
