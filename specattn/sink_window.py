"""DeepSeek V4's sink-aware sliding-window attention (the ``dsv4`` rows): the layer type and
the input rules every flavour shares (Triton on CUDA/HIP, ``torch_npu`` on Ascend), and the
one-vector-per-slot key pool that the kernels and the reference read.

Math and key sets: ``specattn.backends.torch_ref_sparse`` (module doc). Data: an MLA runner
with ``qk_rope_head_dim == 0`` (``kv_buffer [slots, D]``), or an MHA runner with one KV head
and ``head_dim == v_head_dim`` (``k_buffer [slots, 1, D]``; ``v_buffer`` is never read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from . import validation
from .errors import InvalidInputError
from .layer import AttentionLayer

if TYPE_CHECKING:
    from .data import DraftRunner

__all__ = ["SinkAttentionLayer", "DEFAULT_WINDOW", "KIT_LIMITS", "check_window_runner",
           "check_window", "layer_sink", "window_key_pool"]

DEFAULT_WINDOW = 128
# The conformance kit compares with dense attention; the MHA form reads each slot's key as
# its value (the v pool is never read), so it is not that math (``known_limits``).
KIT_LIMITS = {"*/mha/*": "dsv4's MHA form reads each slot's key as its value (the v pool is "
                         "unread): not dense attention; tests/test_dsv4.py and "
                         "tests/test_ascend.py check it against its own reference"}


@dataclass(frozen=True, eq=False)
class SinkAttentionLayer(AttentionLayer):
    """An ``AttentionLayer`` with DeepSeek V4's per-head sink: ``attn_sink [H]`` float32."""

    attn_sink: Optional[torch.Tensor] = None


def check_window_runner(runner: "DraftRunner") -> None:
    """The runner stores one vector per slot (keys equal values)."""
    if runner.use_mla_backend:
        if runner.qk_rope_head_dim != 0:
            raise InvalidInputError(
                "runner.qk_rope_head_dim", "0 for dsv4 (keys equal values: the pool stores "
                "one vector per slot, all of it is the value)", runner.qk_rope_head_dim)
        return
    if runner.num_kv_heads != 1:
        raise InvalidInputError("runner.num_kv_heads", "1 for dsv4 (single-KV-head MQA)",
                                runner.num_kv_heads)
    if runner.v_head_dim != runner.head_dim:
        raise InvalidInputError("runner.v_head_dim", f"head_dim={runner.head_dim} for dsv4 "
                                "(keys equal values)", runner.v_head_dim)


def check_window(window: object) -> int:
    """``window``: keys per query, an int >= 1."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise InvalidInputError("window", "an int >= 1", repr(window))
    return window


def layer_sink(runner: "DraftRunner", layer: AttentionLayer,
               attn_sink: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The sink of a call, ``attn_sink [H]`` float32 from ``forward(..., attn_sink=)`` or a
    ``SinkAttentionLayer``; ``None`` = no sink."""
    sink = attn_sink if attn_sink is not None else getattr(layer, "attn_sink", None)
    if sink is None:
        return None
    validation.check_tensor("attn_sink", sink, dtypes=(torch.float32,), shape=(
        runner.num_q_heads,), device=runner.device)
    return sink


def window_key_pool(runner: "DraftRunner", layer_id: int) -> torch.Tensor:
    """The layer's one-vector-per-slot pool ``[num_slots, D]`` (keys = values), as stored:
    an FP8 pool is uint8 ``[num_slots, bytes_per_token]`` (``runner.kv_layout`` decodes it)."""
    if runner.use_mla_backend:
        return runner.kv_buffer[layer_id]
    return runner.k_buffer[layer_id][:, 0, :]
