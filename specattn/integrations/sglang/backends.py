"""SGLang-protocol draft backends over specattn backends (this module imports SGLang).

- ``SpecattnMultiStepDraftBackend``: SGLang's multi-step draft decode container
  (``Cls(model_runner, topk, speculative_num_steps)`` in SGLang; here the specattn backend is
  passed in), with ``attn_backends`` (one ``SpecattnDraftStepBackend`` per step), one
  ``init_forward_metadata`` per draft round and the CUDA-graph calls of SGLang's
  ``EAGLEDraftCudaGraphRunner``.
- ``SpecattnDraftExtendBackend``: SGLang's draft-extend backend, which SGLang also installs
  as the draft model runner's own backend (prefill extend, draft extend, decode batches).

SGLang's CUDA-graph protocol maps onto specattn's: ``init_cuda_graph_state`` →
``init_cuda_graph_state``; ``init_forward_metadata_out_graph(fb, in_capture=True)`` →
``init_forward_metadata_capture_cuda_graph``; ``..._out_graph(fb)`` (replay) →
``init_forward_metadata_replay_cuda_graph(batch, bs)``; ``init_forward_metadata_in_graph`` has
nothing to do (specattn fills its buffers outside the graph).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ...errors import CallOrderError, InvalidInputError
from . import tree
from .adapter import DecodeAdapter, ExtendAdapter

__all__ = ["SpecattnMultiStepDraftBackend", "SpecattnDraftStepBackend",
           "SpecattnDraftExtendBackend", "check_model_runner"]

# Keyword arguments of SGLang's forward calls that specattn has no equivalent for: sinks,
# DeepSeek's fused rope (``cos_sin_cache``: its ``q_rope`` / ``k_rope`` come unrotated), a
# sparse indexer's selection (``topk_indices``, ``idx_q``: specattn's ``dsa`` selects its
# own keys) and a request for the LSE (``return_lse``: the caller unpacks two results).
_UNSUPPORTED_KWARGS = ("sinks", "attn_sink", "score_mod", "aux_tensors", "cos_sin_cache",
                       "topk_indices", "idx_q", "return_lse")


def check_model_runner(model_runner: Any) -> None:
    """Refuse, with the reason, what the adapter cannot serve: translated KV ids (unified or
    fused pools), decode context parallelism, a draft-decode window."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.spec_utils import resolve_draft_decode_window

    translator = getattr(model_runner, "kv_index_translator", None)
    if translator is not None and translator.is_translating:
        raise InvalidInputError("model_runner.kv_index_translator",
                                "a static KV pool (no virtual-to-physical id translation)",
                                "a translating pool (unified or fused draft pool)")
    dcp = get_parallel().attn_dcp_size
    if dcp > 1:
        raise InvalidInputError("attn_dcp_size", "1 (no decode context parallelism)", dcp)
    window = resolve_draft_decode_window(model_runner)
    if window != (0, 0):
        raise InvalidInputError("--speculative-draft-window-size",
                                "unset (specattn drafts attend to the whole prefix)", window)


def _check_kwargs(kwargs: dict) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(q_rope, k_rope)`` of a forward call's keywords: the rope parts DeepSeek's absorbed
    attention passes apart from ``q`` / ``k`` under the names SGLang's factory gives its
    FA3, FA4, FlashInfer, TRT-LLM and DSA backends; a keyword specattn cannot honour is
    refused."""
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None and kwargs[name] is not False:
            raise InvalidInputError(name, "None (not supported by specattn)",
                                    type(kwargs[name]).__name__)
    return kwargs.get("q_rope"), kwargs.get("k_rope")


class _PoolAttrs:
    """The attributes SGLang's model code reads off the active backend.

    ``needs_cpu_seq_lens`` asks SGLang for the host copy of ``seq_lens`` (it skips that
    copy for backends that need none): set for a specattn backend that plans on the host
    (``reads_host_lengths``), which otherwise copies the lengths itself, a sync per round."""

    needs_cpu_seq_lens = False

    def _bind_pools(self, model_runner: Any) -> None:
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.kv_index_translator = getattr(model_runner, "kv_index_translator", None)
        self.device = model_runner.device


class SpecattnDraftStepBackend(_PoolAttrs, AttentionBackend):
    """Draft step ``step`` of a ``SpecattnMultiStepDraftBackend``: what SGLang's EAGLE loop
    makes the active backend for that step's forward."""

    def __init__(self, container: "SpecattnMultiStepDraftBackend", step: int,
                 model_runner: Any) -> None:
        self.container = container
        self.step = step
        self.needs_cpu_seq_lens = container.needs_cpu_seq_lens
        self._bind_pools(model_runner)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Nothing: the container prepared every step of the round."""

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Nothing: the container owns the graph state."""

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.container.adapter.backend.get_cuda_graph_seq_len_fill_value()

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        q_rope, k_rope = _check_kwargs(kwargs)
        return self.container.adapter.forward(self.step, q, k, v, layer, save_kv_cache,
                                              k_rope, q_rope)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        raise InvalidInputError("forward_batch.forward_mode", "DECODE (a draft step)",
                                forward_batch.forward_mode.name)


class SpecattnMultiStepDraftBackend(_PoolAttrs):
    """SGLang's multi-step draft decode container over a specattn ``DraftDecodeBackend``
    (``decode_backend``, built for this draft: same ``topk`` and ``num_steps``)."""

    def __init__(self, model_runner: Any, topk: int, speculative_num_steps: int,
                 decode_backend: Any, *, start_layer: int = 0) -> None:
        if (decode_backend.topk, decode_backend.num_steps) != (topk, speculative_num_steps):
            raise InvalidInputError("decode_backend (topk, num_steps)",
                                    f"({topk}, {speculative_num_steps})",
                                    (decode_backend.topk, decode_backend.num_steps))
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self._bind_pools(model_runner)
        self.needs_cpu_seq_lens = bool(getattr(decode_backend, "reads_host_lengths", False))
        self.adapter = DecodeAdapter(decode_backend, start_layer)
        self.attn_backends = [SpecattnDraftStepBackend(self, i, model_runner)
                              for i in range(speculative_num_steps - 1)]

    @property
    def specattn_backend(self) -> Any:
        return self.adapter.backend

    def _activate(self) -> None:
        if self.adapter.backend.tree_mode == "path":
            tree.activate(self.adapter)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        self.adapter.begin(forward_batch)
        self._activate()

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.adapter.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, forward_batch: Any,
                                        in_capture: bool = False) -> None:
        self._activate()
        if in_capture:
            self.adapter.capture(forward_batch)
        else:
            self.adapter.replay(forward_batch)

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        """Nothing: specattn's metadata is filled outside the graph."""

    def on_after_cuda_graph_warmup(self) -> None:
        """Nothing: warm-up leaves no state behind."""


class SpecattnDraftExtendBackend(_PoolAttrs, AttentionBackend):
    """SGLang's draft-extend backend over a specattn ``DraftExtendBackend``.

    ``fallback``: an SGLang backend for the calls specattn cannot serve here (an MLA model's
    non-absorbed prefill, forward modes other than extend/decode); without one they raise."""

    def __init__(self, model_runner: Any, extend_backend: Any, *,
                 fallback: Optional[AttentionBackend] = None, start_layer: int = 0) -> None:
        self._bind_pools(model_runner)
        self.adapter = ExtendAdapter(extend_backend, start_layer)
        self.fallback = fallback
        self.needs_cpu_seq_lens = bool(
            getattr(extend_backend, "reads_host_lengths", False)
            or (fallback is not None and fallback.needs_cpu_seq_lens))
        self._served = False

    @property
    def specattn_backend(self) -> Any:
        return self.adapter.backend

    def _fallback_needed(self, served: bool) -> bool:
        # An MLA model may call a prefill in the non-absorbed form (decided per layer).
        return self.fallback is not None and (
            not served or self.adapter.runner.use_mla_backend)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        mode = forward_batch.forward_mode
        self._served = ExtendAdapter.serves_mode(forward_batch)
        if self._served:
            self.adapter.begin(forward_batch)
        if self._fallback_needed(self._served):
            self.fallback.init_forward_metadata(forward_batch)
        elif not self._served and not mode.is_idle():
            raise InvalidInputError("forward_batch.forward_mode",
                                    "EXTEND, MIXED, DRAFT_EXTEND_V2, DECODE or IDLE", mode.name)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.adapter.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, forward_batch: Any,
                                        in_capture: bool = False) -> None:
        self._served = True
        if in_capture:
            self.adapter.capture(forward_batch)
        else:
            self.adapter.replay(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.adapter.backend.get_cuda_graph_seq_len_fill_value()

    def _route(self, q, k, v, layer, forward_batch, save_kv_cache, kwargs, fallback_fn):
        if self._served and self.adapter.layers.get(layer) is not None:
            q_rope, k_rope = _check_kwargs(kwargs)  # SGLang's own fallback takes them all
            return self.adapter.forward(q, k, v, layer, save_kv_cache, k_rope, q_rope)
        if self.fallback is not None:
            return fallback_fn(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache,
                               **kwargs)
        self.adapter.layers.require(layer)  # raises with the shape it expected
        if ExtendAdapter.serves_mode(forward_batch):  # a mode it serves, not prepared
            raise CallOrderError("init_forward_metadata", "a call for the batch before forward",
                                 f"a {forward_batch.forward_mode.name} forward first")
        raise InvalidInputError("forward_batch.forward_mode",
                                "EXTEND, MIXED, DRAFT_EXTEND_V2 or DECODE",
                                forward_batch.forward_mode.name)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._route(q, k, v, layer, forward_batch, save_kv_cache, kwargs,
                           self.fallback and self.fallback.forward_extend)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._route(q, k, v, layer, forward_batch, save_kv_cache, kwargs,
                           self.fallback and self.fallback.forward_decode)
