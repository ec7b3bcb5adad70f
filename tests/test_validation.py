"""Every bad-input error of specattn.validation, reached through the torch_ref backend (so the
wiring is tested too) or the runner constructor; each names its argument and the value."""

from __future__ import annotations

import pytest
import torch

from specattn import (AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner,
                      InvalidInputError)
from specattn import validation
from specattn.backends.torch_ref import TorchRefDecode, TorchRefExtend

B, K, S = 2, 2, 3
LAYER = AttentionLayer(0, 0.5)


def _expect(fn, argument, *fragments):
    """fn raises InvalidInputError for `argument`; the message names it and has fragments."""
    with pytest.raises(InvalidInputError) as info:
        fn()
    err = info.value
    assert err.argument == argument, str(err)
    msg = str(err)
    assert msg.startswith(f"{argument}: expected ")
    for f in fragments:
        assert f in msg, (f, msg)
    assert isinstance(err, ValueError)


def _mha(**kw):
    args = dict(num_layers=2, num_slots=64, max_reqs=4, max_context_len=16,
                dtype=torch.float16)
    args.update(kw)
    return DraftRunner.mha(4, 2, 8, **args)


def _mla(**kw):
    args = dict(num_layers=1, num_slots=64, max_reqs=4, max_context_len=16,
                dtype=torch.bfloat16)
    args.update(kw)
    return DraftRunner.mla(2, 8, 4, **args)


def _batch(path=False, **over):
    fields = dict(req_pool_indices=torch.tensor([0, 3]), seq_lens=torch.tensor([4, 9]),
                  out_cache_loc=torch.arange(B * K * S).reshape(B, K, S) + 20,
                  parents=torch.zeros(S, B, K, dtype=torch.int32) if path else None)
    fields.update(over)
    return DraftBatch(**fields)


def _qkv(runner, rows=B * K, dtype=None):
    dt = dtype or runner.dtype
    if runner.use_mla_backend:
        return torch.randn(rows, 2, 12, dtype=dt), torch.randn(rows, 12, dtype=dt), None
    return (torch.randn(rows, 4, 8, dtype=dt), torch.randn(rows, 2, 8, dtype=dt),
            torch.randn(rows, 2, 8, dtype=dt))


# --- draft parameters ----------------------------------------------------------------------


@pytest.mark.parametrize("topk,num_steps,tree_mode,argument,got", [
    (0, 3, "lane", "topk", "0"),
    (2.0, 3, "lane", "topk", "2.0"),
    (True, 3, "lane", "topk", "True"),
    (2, 0, "lane", "num_steps", "0"),
    (2, -1, "lane", "num_steps", "-1"),
    (2, 3, "tree", "tree_mode", "'tree'"),
])
def test_draft_params(topk, num_steps, tree_mode, argument, got):
    _expect(lambda: TorchRefDecode(_mha(), topk, num_steps, tree_mode=tree_mode), argument,
            f"got {got}")


# --- runner --------------------------------------------------------------------------------


def _k(n=64, h=2, d=8, dt=torch.float16):
    return torch.zeros(n, h, d, dtype=dt)


R2T = torch.zeros(4, 16, dtype=torch.int32)


@pytest.mark.parametrize("kwargs,argument,fragment", [
    (dict(page_size=0), "runner.page_size", "got 0"),
    (dict(page_size=1.5), "runner.page_size", "got 1.5"),
    (dict(dtype=torch.int8), "runner.dtype", "torch.int8"),
    (dict(num_layers=0, k_buffer=[], v_buffer=[]), "runner.num_layers", "got 0"),
    (dict(req_to_token=R2T.float()), "runner.req_to_token", "got float32"),
    (dict(req_to_token=R2T[0]), "runner.req_to_token", "2-D"),
    (dict(req_to_token=R2T.to("meta")), "runner.req_to_token", "meta"),
    (dict(num_q_heads=0), "runner.num_q_heads", "got 0"),
    (dict(num_q_heads=3), "runner.num_q_heads", "num_kv_heads=2"),
    (dict(head_dim=None), "runner.head_dim", "got None"),
    (dict(k_buffer=None), "runner.k_buffer", "a list of 1 tensors"),
    (dict(v_buffer=[_k(), _k()]), "runner.v_buffer", "got 2 tensors"),
    (dict(k_buffer=["x"]), "runner.k_buffer[0]", "a torch.Tensor"),
    (dict(k_buffer=[_k(dt=torch.int32)]), "runner.k_buffer[0]", "got int32"),
    (dict(k_buffer=[_k()[0]]), "runner.k_buffer[0]", "3-D"),
    (dict(k_buffer=[_k(d=4)]), "runner.k_buffer[0]", "shape (64, 2, 4)"),
    (dict(v_buffer=[_k().to("meta")]), "runner.v_buffer[0]", "meta"),
    (dict(k_buffer=[_k(d=16)[:, :, ::2]]), "runner.k_buffer[0]", "unit stride"),
    (dict(v_buffer=[_k(n=32)]), "runner.v_buffer[0]", "64 slots like layer 0"),
    (dict(v_buffer=[_k(dt=torch.bfloat16)]), "runner.v_buffer[0]",
     "dtype float16 like runner.k_buffer[0], got bfloat16"),
    (dict(k_buffer=[_k(n=0)], v_buffer=[_k(n=0)]), "runner.k_buffer[0]",
     "at least one slot, got 0 slots"),
    (dict(req_to_token=R2T[:0]), "runner.req_to_token", "got shape (0, 16)"),
])
def test_runner_mha(kwargs, argument, fragment):
    args = dict(use_mla_backend=False, dtype=torch.float16, device="cpu", page_size=1,
                num_layers=1, req_to_token=R2T, num_q_heads=4, num_kv_heads=2, head_dim=8,
                v_head_dim=8, k_buffer=[_k()], v_buffer=[_k()])
    args.update(kwargs)
    _expect(lambda: DraftRunner(**args), argument, fragment)


@pytest.mark.parametrize("kwargs,argument,fragment", [
    (dict(num_heads=0), "runner.num_heads", "got 0"),
    (dict(kv_lora_rank=None), "runner.kv_lora_rank", "got None"),
    (dict(qk_rope_head_dim=-1), "runner.qk_rope_head_dim", "an int >= 0, got -1"),
    (dict(kv_buffer=[torch.zeros(64, 10, dtype=torch.bfloat16)]), "runner.kv_buffer[0]",
     "shape [num_slots, 12]"),
    (dict(kv_buffer=None), "runner.kv_buffer", "a list of 1 tensors"),
])
def test_runner_mla(kwargs, argument, fragment):
    args = dict(use_mla_backend=True, dtype=torch.bfloat16, device="cpu", page_size=1,
                num_layers=1, req_to_token=R2T, num_heads=2, kv_lora_rank=8,
                qk_rope_head_dim=4, kv_buffer=[torch.zeros(64, 12, dtype=torch.bfloat16)])
    args.update(kwargs)
    _expect(lambda: DraftRunner(**args), argument, fragment)


def test_an_mha_runners_write_needs_the_values():
    runner = DraftRunner.wrap_mha(R2T, [_k()], [_k()], 4)
    _expect(lambda: runner.write_kv(0, torch.tensor([1]), _k(n=1), None), "v", "got None")


@pytest.mark.parametrize("args,argument,fragment", [
    ((-1, torch.tensor([1]), _k(n=1), _k(n=1)), "layer_id", "got -1"),
    ((0, torch.tensor([-1]), _k(n=1), _k(n=1)), "loc", "got a value -1"),
    ((0, torch.tensor([64]), _k(n=1), _k(n=1)), "loc", "got a value 64"),
    ((0, torch.tensor([1.0]), _k(n=1), _k(n=1)), "loc", "got float32"),
    ((0, torch.tensor([1]), _k(n=1, d=1), _k(n=1)), "k", "got shape (1, 2, 1)"),
    ((0, torch.tensor([1, 2]), _k(n=1), _k(n=1)), "k", "shape (2, 2, 8)"),
    ((0, torch.tensor([1]), _k(n=1), _k(n=1)[:, :1]), "v", "shape (1, 2, 8)"),
    ((0, torch.tensor([1]), _k(n=1), _k(n=1), float("nan")), "k_scale", "got nan"),
])
def test_write_kv_checks_its_arguments(args, argument, fragment):
    """A negative slot or layer would index from the end, a row of the wrong width would
    broadcast into the pool: all refused."""
    runner = DraftRunner.wrap_mha(R2T, [_k()], [_k()], 4)
    _expect(lambda: runner.write_kv(*args), argument, fragment)


def test_wrap_runner_accepts_engine_tensors():
    k = [_k(), _k()]
    runner = DraftRunner.wrap_mha(R2T, k, [_k(), _k()], 4, page_size=4)
    assert runner.k_buffer[0] is k[0] and runner.num_slots == 64


# --- decode batch --------------------------------------------------------------------------


@pytest.mark.parametrize("over,argument,fragment", [
    (dict(req_pool_indices=torch.tensor([0.0, 1.0])), "batch.req_pool_indices", "float32"),
    (dict(req_pool_indices=[0, 3]), "batch.req_pool_indices", "a torch.Tensor"),
    (dict(req_pool_indices=torch.tensor([[0, 3]])), "batch.req_pool_indices", "1-D"),
    (dict(req_pool_indices=torch.tensor([0, 3], device="meta")), "batch.req_pool_indices",
     "meta"),
    (dict(req_pool_indices=torch.tensor([0, 4])), "batch.req_pool_indices",
     "values in [0, 4), got a value 4"),
    (dict(req_pool_indices=torch.tensor([-1, 3])), "batch.req_pool_indices", "a value -1"),
    (dict(seq_lens=torch.tensor([4, 9, 1])), "batch.seq_lens", "shape (2,)"),
    (dict(seq_lens=torch.tensor([4, 9], dtype=torch.int16)), "batch.seq_lens", "int16"),
    (dict(seq_lens=torch.tensor([4, 17])), "batch.seq_lens",
     "values in [0, 17), got a value 17"),
    (dict(seq_lens=torch.tensor([4, -2])), "batch.seq_lens", "a value -2"),
    (dict(seq_lens=torch.tensor([4, 9], device="meta")), "batch.seq_lens", "meta"),
    (dict(out_cache_loc=torch.zeros(B, K, S + 1, dtype=torch.int64)), "batch.out_cache_loc",
     "shape (2, 2, 3)"),
    (dict(out_cache_loc=torch.zeros(B * K * S, dtype=torch.int64)), "batch.out_cache_loc",
     "3-D"),
    (dict(out_cache_loc=torch.full((B, K, S), 64)), "batch.out_cache_loc",
     "values in [0, 64), got a value 64"),
    (dict(out_cache_loc=torch.full((B, K, S), -3)), "batch.out_cache_loc", "a value -3"),
    (dict(out_cache_loc=torch.zeros(B, K, S, device="meta", dtype=torch.int64)),
     "batch.out_cache_loc", "meta"),
    (dict(seq_lens_cpu=[4, 9]), "batch.seq_lens_cpu", "a torch.Tensor"),
    (dict(seq_lens_cpu=torch.tensor([4, 9], device="meta")), "batch.seq_lens_cpu",
     "a tensor on cpu"),
    (dict(seq_lens_cpu=torch.tensor([4, 9, 1])), "batch.seq_lens_cpu", "shape (2,)"),
    (dict(seq_lens_cpu=torch.tensor([4.0, 9.0])), "batch.seq_lens_cpu", "float32"),
    (dict(seq_lens_cpu=torch.tensor([4, 8])), "batch.seq_lens_cpu",
     "the values of batch.seq_lens, got seq_lens_cpu[1]=8 (seq_lens[1]=9)"),
])
def test_decode_batch(over, argument, fragment):
    backend = TorchRefDecode(_mha(), K, S)
    _expect(lambda: backend.init_forward_metadata(_batch(**over)), argument, fragment)


def test_decode_batch_empty_and_max_bs():
    runner = _mha()
    empty = _batch(req_pool_indices=torch.zeros(0, dtype=torch.int64),
                   seq_lens=torch.zeros(0, dtype=torch.int64),
                   out_cache_loc=torch.zeros(0, K, S, dtype=torch.int64))
    _expect(lambda: TorchRefDecode(runner, K, S).init_forward_metadata(empty),
            "batch.req_pool_indices", "at least one request")
    _expect(lambda: validation.check_decode_batch(runner, K, S, "lane", _batch(), max_bs=1),
            "batch.req_pool_indices", "max_bs=1", "got 2")


def test_decode_batch_parents():
    backend = TorchRefDecode(_mha(), K, S, tree_mode="path")
    _expect(lambda: backend.init_forward_metadata(_batch(path=False)), "batch.parents",
            "tree_mode='path'", "got None")
    _expect(lambda: backend.init_forward_metadata(
        _batch(parents=torch.zeros(S, B, K + 1, dtype=torch.int64))), "batch.parents",
        "shape (3, 2, 2)")
    _expect(lambda: backend.init_forward_metadata(
        _batch(parents=torch.zeros(S, B, K))), "batch.parents", "float32")
    # parents are read per step (filled in place as the round proceeds).
    batch = _batch(path=True)
    backend.init_forward_metadata(batch)
    batch.parents[2, 1, 0] = K
    runner = backend.runner
    q, k, v = _qkv(runner)
    backend.forward(0, LAYER, q, k, v)
    backend.forward(1, LAYER, q, k, v)
    _expect(lambda: backend.forward(2, LAYER, q, k, v), "batch.parents[1:3]",
            "values in [0, 2), got a value 2")
    batch.parents[1, 0, 1] = -1
    _expect(lambda: backend.forward(1, LAYER, q, k, v), "batch.parents[1:2]", "a value -1")


# --- decode forward ------------------------------------------------------------------------


def _decode_backend(runner):
    backend = TorchRefDecode(runner, K, S)
    backend.init_forward_metadata(_batch())
    return backend


@pytest.mark.parametrize("step", [-1, S, 1.0])
def test_decode_step(step):
    runner = _mha()
    _expect(lambda: _decode_backend(runner).forward(step, LAYER, *_qkv(runner)), "step",
            "[0, 3)", f"got {step!r}")


def test_decode_layer():
    runner = _mha()
    backend = _decode_backend(runner)
    _expect(lambda: backend.forward(0, 0, *_qkv(runner)), "layer", "AttentionLayer", "int")
    _expect(lambda: backend.forward(0, AttentionLayer(2, 1.0), *_qkv(runner)),
            "layer.layer_id", "num_layers=2", "got 2")
    _expect(lambda: AttentionLayer(-1, 1.0), "layer.layer_id", "got -1")
    _expect(lambda: AttentionLayer(0, 0.0), "layer.scaling", "got 0.0")
    _expect(lambda: AttentionLayer(0, 1.0, logit_cap=-1.0), "layer.logit_cap", "got -1.0")


def _mha_qkv_cases():
    q, k, v = _qkv(_mha())
    return [
        ((q.float(), k, v), "q", "dtype float16, got float32"),
        ((q.to("meta"), k, v), "q", "meta"),
        ((q[:, :, 0], k, v), "q", "3-D"),
        ((q[:3], k, v), "q", "shape (4, 4, 8), got shape (3, 4, 8)"),
        ((q, k[:, :1], v), "k", "shape (4, 2, 8)"),
        ((q, k, v.bfloat16()), "v", "got bfloat16"),
        ((q, k, None), "v", "a torch.Tensor"),
        ((q, k, torch.randn(4, 2, 16, dtype=torch.float16)[:, :, ::2]), "v", "unit stride"),
        ((torch.randn(4, 4, 16, dtype=torch.float16)[:, :, ::2], k, v), "q", "unit stride"),
        ((q, torch.randn(4, 2, 16, dtype=torch.float16)[:, :, ::2], v), "k", "unit stride"),
    ]


@pytest.mark.parametrize("case", range(len(_mha_qkv_cases())))
def test_decode_qkv_mha(case):
    runner = _mha()
    qkv, argument, fragment = _mha_qkv_cases()[case]
    _expect(lambda: _decode_backend(runner).forward(0, LAYER, *qkv), argument, fragment)


def test_decode_qkv_mla():
    runner = _mla()
    backend = TorchRefDecode(runner, K, S)
    backend.init_forward_metadata(_batch())
    q, k, _ = _qkv(runner)
    layer = AttentionLayer(0, 1.0)
    _expect(lambda: backend.forward(0, layer, q, k, k), "v", "None for MLA")
    _expect(lambda: backend.forward(0, layer, q[:, :, :8].contiguous(), k, None), "q",
            "shape (4, 2, 12)")
    _expect(lambda: backend.forward(0, layer, q, k[:, None], None), "k", "2-D")
    _expect(lambda: backend.forward(0, layer, q, k.half(), None), "k", "got float16")
    assert backend.forward(0, layer, q, k, None).shape == (4, 2, 8)


# --- extend --------------------------------------------------------------------------------


def _ext(**over):
    fields = dict(req_pool_indices=torch.tensor([1, 2]), seq_lens=torch.tensor([5, 3]),
                  extend_lens=torch.tensor([2, 3]), out_cache_loc=torch.arange(30, 35))
    fields.update(over)
    return DraftExtendBatch(**fields)


@pytest.mark.parametrize("over,argument,fragment", [
    (dict(req_pool_indices=torch.tensor([1, 9])), "batch.req_pool_indices", "a value 9"),
    (dict(req_pool_indices=torch.zeros(0, dtype=torch.int64),
          seq_lens=torch.zeros(0, dtype=torch.int64),
          extend_lens=torch.zeros(0, dtype=torch.int64),
          out_cache_loc=torch.zeros(0, dtype=torch.int64)), "batch.req_pool_indices",
     "at least one request"),
    (dict(seq_lens=torch.tensor([5])), "batch.seq_lens", "shape (2,)"),
    (dict(seq_lens=torch.tensor([5, 17])), "batch.seq_lens", "values in [1, 17)"),
    (dict(seq_lens=torch.tensor([5, 2])), "batch.seq_lens",
     "seq_lens[1]=2 < extend_lens[1]=3"),
    (dict(extend_lens=torch.tensor([2, 0]), out_cache_loc=torch.arange(2)),
     "batch.extend_lens", "values in [1, 17), got a value 0"),
    (dict(extend_lens=torch.tensor([2.0, 3.0])), "batch.extend_lens", "float32"),
    (dict(extend_lens=torch.tensor([2, 3, 1])), "batch.extend_lens", "shape (2,)"),
    (dict(out_cache_loc=torch.arange(4)), "batch.out_cache_loc", "shape (5,), got shape (4,)"),
    (dict(out_cache_loc=torch.arange(30, 35)[None]), "batch.out_cache_loc", "1-D"),
    (dict(out_cache_loc=torch.arange(60, 65)), "batch.out_cache_loc", "a value 64"),
    (dict(out_cache_loc=torch.arange(5, device="meta")), "batch.out_cache_loc", "meta"),
    (dict(extend_lens_cpu=torch.tensor([2])), "batch.extend_lens_cpu", "shape (2,)"),
    (dict(extend_lens_cpu=torch.tensor([2, 2])), "batch.extend_lens_cpu",
     "the values of batch.extend_lens"),
    (dict(seq_lens_cpu=torch.tensor([[5, 3]])), "batch.seq_lens_cpu", "1-D"),
])
def test_extend_batch(over, argument, fragment):
    _expect(lambda: TorchRefExtend(_mha()).init_forward_metadata(_ext(**over)), argument,
            fragment)


def test_decode_draft_slot_holding_a_prefix_token():
    """A lane's draft slot that a request's prefix holds: its step would overwrite
    committed KV (eager rounds; a graph's padded lanes share the padding slot)."""
    runner = _mha()
    runner.req_to_token[3, :9] = torch.arange(40, 49)
    backend = TorchRefDecode(runner, K, S)
    loc = _batch().out_cache_loc.clone()
    loc[1, 0, 2] = 44
    _expect(lambda: backend.init_forward_metadata(_batch(out_cache_loc=loc)),
            "batch.out_cache_loc", "slot 44, req_to_token[3, 4]")
    backend.init_forward_metadata(_batch())  # the same prefixes, free draft slots


def test_extend_slots_must_be_the_new_tokens_req_to_token_entries():
    """An extend's out_cache_loc is where req_to_token puts its new tokens: otherwise a
    backend reading them from the pool and one reading k / v would disagree."""
    runner = _mha()
    runner.req_to_token[1, 3:5] = torch.tensor([30, 31])
    runner.req_to_token[2, 0:3] = torch.tensor([32, 33, 34])
    backend = TorchRefExtend(runner)
    backend.init_forward_metadata(_ext())
    _expect(lambda: backend.init_forward_metadata(_ext(out_cache_loc=torch.tensor(
        [30, 31, 32, 34, 33]))), "batch.out_cache_loc",
        "got out_cache_loc[3] = 34, req_to_token[2, 1] = 33")


def test_scale_tensor_on_another_device_than_the_pools():
    runner = _mha(kv_cache_dtype="fp8_e4m3", dtype=torch.bfloat16)
    runner.req_to_token[1, 3:5] = torch.tensor([30, 31])
    runner.req_to_token[2, 0:3] = torch.tensor([32, 33, 34])
    backend = TorchRefExtend(runner)
    backend.init_forward_metadata(_ext())
    q, k, v = _qkv(runner, rows=5)
    meta = torch.ones(1, device="meta")
    for name in ("k_scale", "v_scale"):
        layer = AttentionLayer(0, 0.5, **{name: meta})
        _expect(lambda: backend.forward(layer, q, k, v), f"layer.{name}",
                "a float or a tensor on cpu", "got a tensor on meta")
    out = backend.forward(AttentionLayer(0, 0.5, k_scale=torch.tensor([0.5])), q, k, v)
    assert out.shape == (5, 4, 8)


def test_extend_forward():
    runner = _mha()
    runner.req_to_token[1, 3:5] = torch.tensor([30, 31])  # the new tokens' slots (_ext)
    runner.req_to_token[2, 0:3] = torch.tensor([32, 33, 34])
    backend = TorchRefExtend(runner)
    backend.init_forward_metadata(_ext())
    q, k, v = _qkv(runner, rows=5)
    _expect(lambda: backend.forward(LAYER, q[:4], k[:4], v[:4]), "q",
            "shape (5, 4, 8), got shape (4, 4, 8)")
    _expect(lambda: backend.forward(LAYER, q, k, v[:, :1]), "v", "shape (5, 2, 8)")
    _expect(lambda: backend.forward(AttentionLayer(5, 1.0), q, k, v), "layer.layer_id",
            "got 5")
    assert backend.forward(LAYER, q, k, v).shape == (5, 4, 8)


def test_host_copies_are_optional_and_compared_where_values_are_checked(monkeypatch):
    """A batch may give host copies of its lengths (``seq_lens_cpu``...) or not, and a
    duck-typed batch need not have the fields; the copies are compared with the lengths
    where values are checked (CPU tensors, or debug checks), never otherwise."""
    backend = TorchRefDecode(_mha(), K, S)
    backend.init_forward_metadata(_batch(seq_lens_cpu=torch.tensor([4, 9], dtype=torch.int32)))

    class Plain:  # the fields of a DraftBatch, without the optional host copy
        req_pool_indices, seq_lens = torch.tensor([0, 3]), torch.tensor([4, 9])
        out_cache_loc, parents = _batch().out_cache_loc, None
        batch_size = 2

    backend.init_forward_metadata(Plain())
    monkeypatch.setattr(validation, "_scan_values", lambda t, debug: bool(debug))
    wrong = _batch(seq_lens_cpu=torch.tensor([4, 8]))
    validation.check_decode_batch(backend.runner, K, S, "lane", wrong, debug=False)
    _expect(lambda: validation.check_decode_batch(backend.runner, K, S, "lane", wrong,
                                                  debug=True), "batch.seq_lens_cpu",
            "seq_lens_cpu[1]=8")


def test_a_host_copy_that_differs_is_named_by_one_request():
    """A serving batch has thousands of requests: the message names the first request whose
    host copy differs, not both lists."""
    n = 4096
    batch = DraftBatch(torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
                       torch.zeros(n, K, S, dtype=torch.int64),
                       seq_lens_cpu=torch.zeros(n, dtype=torch.int64))
    batch.seq_lens_cpu[3000] = 5
    with pytest.raises(InvalidInputError) as info:
        validation.check_decode_batch(_mha(), K, S, "lane", batch)
    assert str(info.value) == ("batch.seq_lens_cpu: expected the values of batch.seq_lens, "
                               "got seq_lens_cpu[3000]=5 (seq_lens[3000]=0)")


def test_value_checks_are_skipped_off_cpu_without_debug(monkeypatch):
    """Production mode reads no device values: on a non-CPU device only metadata is
    checked (here the meta device stands in for a GPU), unless SPECATTN_DEBUG_CHECKS=1."""
    monkeypatch.delenv("SPECATTN_DEBUG_CHECKS", raising=False)
    bad = torch.full((3,), 10 ** 6, device="meta")
    assert not validation._scan_values(bad, None)
    monkeypatch.setenv("SPECATTN_DEBUG_CHECKS", "1")
    assert validation._scan_values(bad, None)
    assert validation._scan_values(torch.zeros(3), False)  # CPU: always (no sync needed)


@pytest.mark.parametrize("page_size", [1, 4])
def test_replay_slots_may_share_page_zero_only(page_size):
    """A replay's padding shares page 0 (slot 0, and its page's other slots at page size >
    1); elsewhere two lanes in one slot, or a draft slot on a prefix token, are refused."""
    runner = _mha(page_size=page_size)
    runner.req_to_token[3, :9] = torch.arange(40, 49)
    loc = torch.arange(B * K * S).reshape(B, K, S) + 20
    padded = loc.clone()
    padded[1] = torch.arange(K * S).reshape(K, S) % page_size  # every lane in page 0
    validation.check_replay_slots(runner, _batch(out_cache_loc=padded))
    twice = loc.clone()
    twice[1, 0, 0] = twice[0, 0, 0]
    _expect(lambda: validation.check_replay_slots(runner, _batch(out_cache_loc=twice)),
            "batch.out_cache_loc", "slot 20 given to 2 tokens")
    in_prefix = loc.clone()
    in_prefix[0, 1, 1] = 45
    _expect(lambda: validation.check_replay_slots(runner, _batch(out_cache_loc=in_prefix)),
            "batch.out_cache_loc", "slot 45, req_to_token[3, 5]")
