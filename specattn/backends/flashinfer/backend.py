"""The registered ``flashinfer`` classes (declarations and capabilities); the package doc
says what they compute."""


from __future__ import annotations

import math

import torch

from ...platforms import is_cuda
from ._decode import MODES, FlashInferDecodeGlue
from ._extend import FlashInferExtendGlue
from ._passes import DecodePass, MLAPass, Params, PrefillPass, default_params

__all__ = ["FlashInferDecode", "FlashInferMLADecode", "FlashInferExtend",
           "FlashInferMLAExtend", "MODES"]

_REQUIRES = (("flashinfer", "flashinfer-python~=0.7.0"),)
_PRIORITY = {"cuda": 70}
_TESTED = "H200 (sm90)"


class _MHA:
    """Capabilities and plan parameters of the MHA flavour (decode and extend)."""

    dtypes = (torch.bfloat16, torch.float16)
    supports_cuda_graph = True
    tested_on = _TESTED

    def _default_params(self) -> Params:
        return default_params(self.runner.head_dim)


class _MLA:
    """Capabilities and plan parameters of the MLA flavour (decode and extend)."""

    dtypes = (torch.bfloat16, torch.float16)
    supports_cuda_graph = True
    soft_cap_models = frozenset()  # FlashInfer MLA has no soft cap
    tested_on = _TESTED

    def _default_params(self) -> Params:
        r = self.runner
        return Params(1.0 / math.sqrt(r.kv_lora_rank + r.qk_rope_head_dim), 0.0)

    def _check_layer_params(self, layer) -> Params:
        return Params(float(layer.scaling), 0.0)  # no soft cap (soft_cap_models refuses one)


class FlashInferDecode(_MHA, FlashInferDecodeGlue, name="flashinfer", flavour="mha",
                       platforms=is_cuda, models=("mha",), requires=_REQUIRES,
                       kernel_library="flashinfer", priority=_PRIORITY):
    """Shared-prefix draft decode for MHA/GQA (``mode="per-branch"``: upstream design).

    q: ``[B*K, H_q, D]``, k: ``[B*K, H_kv, D]``, v: ``[B*K, H_kv, D_v]`` → ``[B*K, H_q, D_v]``.
    ``prefix_backend`` and ``prefix_plan_kwargs`` (instance attributes, set before the first
    round) pick the prefill wrapper's kernel for the prefix pass and extra ``plan`` arguments
    (``fixed_split_size``, ...; they override the graph plan's ``uniform_q_len`` and
    ``disable_split_kv``), for benchmarks. ``auto`` resolves to fa2 here (FlashInfer
    takes fa2 for <= 64 query rows per request); forcing fa3 measured 3.9x slower on the
    H200 with page-size-1 gathers (2026-11-29).
    """

    prefix_backend = "auto"
    prefix_plan_kwargs: dict = {}

    def _new_pass(self, role, graph_rows, capacity):
        kw = dict(graph_rows=graph_rows, capacity=capacity)
        if role == "prefix":
            return PrefillPass(self.runner, with_lse=True, backend=self.prefix_backend,
                               plan_kwargs=self.prefix_plan_kwargs, uniform_rows=self.topk,
                               **kw)
        if self.runner.v_head_dim != self.runner.head_dim:  # decode wrapper: one head dim
            return PrefillPass(self.runner, with_lse=False, **kw)
        return DecodePass(self.runner, with_lse=False, **kw)

    def _history_pools(self, layer_id):
        return self.runner.k_buffer[layer_id], self.runner.v_buffer[layer_id]


class FlashInferExtend(_MHA, FlashInferExtendGlue, name="flashinfer", flavour="mha",
                       platforms=is_cuda, models=("mha",), requires=_REQUIRES,
                       kernel_library="flashinfer", priority=_PRIORITY):
    """Draft extend for MHA/GQA: causal paged prefill over ragged requests.

    q: ``[T, H_q, D]``, k: ``[T, H_kv, D]``, v: ``[T, H_kv, D_v]`` → ``[T, H_q, D_v]``.
    """

    def _new_pass(self, graph_rows=None, capacity=0):
        return PrefillPass(self.runner, with_lse=False, graph_rows=graph_rows,
                           capacity=capacity)


class FlashInferMLADecode(_MLA, FlashInferDecodeGlue, name="flashinfer", flavour="mla",
                          platforms=is_cuda, models=("mla",), requires=_REQUIRES,
                          kernel_library="flashinfer", priority=_PRIORITY):
    """MLA draft decode through ``BatchMLAPagedAttentionWrapper``, ``topk > 1`` included.

    q: ``[B*K, H, R + rope]`` (absorbed), k: ``[B*K, R + rope]``, v: ``None`` →
    ``[B*K, H, R]``. The plan reads the index range back from the device (FlashInfer's MLA
    planner validates it), one sync per planned pass.
    """

    def _new_pass(self, role, graph_rows, capacity):
        return MLAPass(self.runner, with_lse=role != "full", graph_rows=graph_rows,
                       capacity=capacity)

    def _history_pools(self, layer_id):
        # The latent pool [num_slots, R + rope] is both K (all of it) and V (its first R).
        kv = self.runner.kv_buffer[layer_id]
        return kv.unsqueeze(1), kv[:, :self.runner.kv_lora_rank].unsqueeze(1)


class FlashInferMLAExtend(_MLA, FlashInferExtendGlue, name="flashinfer", flavour="mla",
                          platforms=is_cuda, models=("mla",), requires=_REQUIRES,
                          kernel_library="flashinfer", priority=_PRIORITY):
    """MLA draft extend: one causal ``BatchMLAPagedAttentionWrapper`` pass.

    q: ``[T, H, R + rope]``, k: ``[T, R + rope]``, v: ``None`` → ``[T, H, R]``.
    """

    def _new_pass(self, graph_rows=None, capacity=0):
        return MLAPass(self.runner, with_lse=False, graph_rows=graph_rows, capacity=capacity)
