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
])
def test_wrapping_names_the_pool_and_its_shape(call, argument, got):
    with pytest.raises(InvalidInputError, match=f"^{argument}: expected") as info:
        call()
    assert got in str(info.value)
