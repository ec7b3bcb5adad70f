"""Issue #17's bad inputs outside the backends: the layer and the runner constructors.

The per-backend cases (strided index tensors, non-finite keys, out-of-pool ``req_to_token``
entries, duplicate ``out_cache_loc`` slots, untyped errors) are conformance-kit cases, so
every backend, present and future, is held to them (``tests/conformance``)."""

from __future__ import annotations

import math

import pytest
import torch

from specattn import AttentionLayer, DraftRunner
from specattn.errors import InvalidInputError


@pytest.mark.parametrize("kwargs,argument", [
    (dict(scaling=math.inf), "layer.scaling"),
    (dict(scaling=math.nan), "layer.scaling"),
    (dict(scaling="0.2"), "layer.scaling"),
    (dict(scaling=0.2, logit_cap=math.inf), "layer.logit_cap"),
    (dict(scaling=0.2, logit_cap="2"), "layer.logit_cap"),
    (dict(scaling=torch.tensor(0.2)), "layer.scaling"),
])
def test_layer_refuses_non_finite_and_non_numbers(kwargs, argument):
    with pytest.raises(InvalidInputError, match=f"^{argument}: expected a finite float"):
        AttentionLayer(0, **kwargs)


def test_layer_refuses_a_bool_layer_id():
    with pytest.raises(InvalidInputError, match="^layer.layer_id"):
        AttentionLayer(True, 0.2)


def test_layer_accepts_ints_and_floats():
    assert AttentionLayer(1, 1, 30).scaling == 1


def test_layer_takes_numpy_scalars_as_python_numbers():
    np = pytest.importorskip("numpy")
    layer = AttentionLayer(np.int64(2), np.float32(0.125), np.float16(0.0),
                           k_scale=np.float32(0.5))
    assert (layer.layer_id, layer.scaling, layer.logit_cap, layer.k_scale) == (2, 0.125, 0, 0.5)
    assert all(type(x) is t for x, t in ((layer.layer_id, int), (layer.scaling, float),
                                         (layer.logit_cap, float), (layer.k_scale, float)))
    with pytest.raises(InvalidInputError, match="^layer.scaling"):
        AttentionLayer(0, np.bool_(True))
    with pytest.raises(InvalidInputError, match="^layer.scaling"):
        AttentionLayer(0, np.float32("nan"))


R2T = torch.zeros(2, 8, dtype=torch.int32)


@pytest.mark.parametrize("call,argument,got", [
    (lambda: DraftRunner.wrap_mha(R2T, [], [], 4), "k_buffer", "got []"),
    (lambda: DraftRunner.wrap_mha(R2T, [torch.zeros(4, 2, 8)], [], 4), "v_buffer", "got []"),
    (lambda: DraftRunner.wrap_mha(R2T, torch.zeros(3, 4, 2, 8), [], 4), "k_buffer",
     "a tensor of shape (3, 4, 2, 8)"),
    (lambda: DraftRunner.wrap_mha(R2T, [torch.zeros(4, 16)], [torch.zeros(4, 16)], 4),
     r"k_buffer\[0\]", "shape (4, 16)"),
    (lambda: DraftRunner.wrap_mla(R2T, [torch.zeros(4, 2, 16)], 4, 32), r"kv_buffer\[0\]",
     "shape (4, 2, 16)"),
    (lambda: DraftRunner.wrap_mla(R2T, [torch.zeros(4, 16)], 4, 32), "kv_lora_rank",
     "got 32"),
    # A byte layout's rows say nothing of the rank: a bad one is named, not the pool.
    (lambda: DraftRunner.wrap_mla(R2T, [torch.zeros(4, 656, dtype=torch.uint8)], 4, 0,
                                  kv_cache_dtype="fp8_ds_mla"), "kv_lora_rank", "got 0"),
    (lambda: DraftRunner.wrap_mla(R2T, [torch.zeros(4, 656, dtype=torch.uint8)], 4, None,
                                  kv_cache_dtype="fp8_ds_mla"), "kv_lora_rank", "got None"),
])
def test_wrapping_names_the_pool_and_its_shape(call, argument, got):
    with pytest.raises(InvalidInputError, match=f"^{argument}: expected") as info:
        call()
    assert got in str(info.value)


SIZES = dict(num_layers=1, num_slots=8, max_reqs=2, max_context_len=8)


@pytest.mark.parametrize("call,argument,got", [
    (lambda: DraftRunner.mha(4, 2, 8, **{**SIZES, "num_slots": -1}), "num_slots", "got -1"),
    (lambda: DraftRunner.mha(4, 2, -8, **SIZES), "head_dim", "got -8"),
    (lambda: DraftRunner.mha(4, 2, 8, **{**SIZES, "num_layers": 1.5}), "num_layers",
     "got 1.5"),
    (lambda: DraftRunner.mha(4, 2, 8, **{**SIZES, "max_context_len": -3}), "max_context_len",
     "got -3"),
    (lambda: DraftRunner.mha(4, 2, 8, **SIZES, dtype="bfloat16"), "dtype", "got 'bfloat16'"),
    (lambda: DraftRunner.mha(4, 2, 8, **SIZES, device="gpu"), "device", "got 'gpu'"),
    (lambda: DraftRunner.mla(4, 16, 8, **SIZES, device="meta"), "device", "got 'meta'"),
    pytest.param(lambda: DraftRunner.mla(4, 16, 8, **SIZES, device="cuda"), "device",
                 "got 'cuda'", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                        reason="torch sees a CUDA device")),
    (lambda: DraftRunner.mha(4, 2, 8, **SIZES, kv_cache_dtype=["auto"]), "kv_cache_dtype",
     "got ['auto']"),
    (lambda: DraftRunner.mla(4, 16, -1, **SIZES), "qk_rope_head_dim", "an int >= 0, got -1"),
    (lambda: DraftRunner.mla(4, 16, 8, **{**SIZES, "max_reqs": -2}), "max_reqs", "got -2"),
])
def test_allocating_constructors_check_sizes_before_allocating(call, argument, got):
    """``DraftRunner.mha`` / ``mla`` size tensors with their arguments: a size, dtype or
    device torch cannot allocate with is refused first, naming the argument."""
    with pytest.raises(InvalidInputError, match=f"^{argument}: expected") as info:
        call()
    assert str(info.value).endswith(got)
