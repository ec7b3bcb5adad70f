"""FlashInfer backends (``flashinfer``, MHA and MLA flavours), FlashInfer 0.7.x.

Draft decode reads each request's prefix once for all ``K`` lanes: a prefix pass (paged
prefill wrapper, ``K`` non-causal query rows per request) plus one small Triton kernel that
attends each lane to its history and merges with the prefix result by the prefix's base-2
LSE (Triton ships with torch on CUDA). ``topk == 1`` is one plain decode over prefix +
history. MLA does the same with ``BatchMLAPagedAttentionWrapper`` for the prefix pass, so
``topk > 1`` works for MLA too.
Draft extend is one causal paged prefill (MHA) or MLA pass over ragged requests.

The token pool ``[num_slots, H_kv, D]`` (MLA ``[num_slots, R + rope]``) is viewed as pages
of one token, so FlashInfer indices are token slots and any engine page size works (also
page size > 1 with ``topk > 1``). Layout of this package:

- ``_slots.py``: pure-torch CSR slot lists (device-built, no host sync);
- ``_passes.py``: one planned FlashInfer call (the only vendor imports);
- ``.._history_merge``: the fused history pass + merge (Triton, shared with ``flashmla``);
- ``_decode.py`` / ``_extend.py``: the plan/run protocol shared by both flavours;
- this module: the four registered classes.

Limits: FlashInfer plans the softmax scale and the soft cap, so a layer with other values
than the last plan triggers a re-plan (eager; refused under graph capture). MLA has no soft
cap. CUDA graph replay (decode and extend) re-plans on the host (FlashInfer's scheduler is
host code).
"""

from __future__ import annotations

import math

import torch

from ...errors import InvalidInputError
from ...platforms import is_cuda
from ._decode import MODES, FlashInferDecodeGlue
from ._extend import FlashInferExtendGlue
from ._passes import DecodePass, MLAPass, Params, PrefillPass, default_params

__all__ = ["FlashInferDecode", "FlashInferMLADecode", "FlashInferExtend",
           "FlashInferMLAExtend", "MODES"]

_REQUIRES = (("flashinfer", "flashinfer-python~=0.7.0"),)
_PRIORITY = {"cuda": 70}
_TESTED = "H200 (sm90)"


class FlashInferDecode(FlashInferDecodeGlue, name="flashinfer", flavour="mha",
                       platforms=is_cuda, models=("mha",), requires=_REQUIRES,
                       kernel_library="flashinfer", priority=_PRIORITY):
    """Shared-prefix draft decode for MHA/GQA (``mode="per-branch"``: upstream design).

    q: ``[B*K, H_q, D]``, k: ``[B*K, H_kv, D]``, v: ``[B*K, H_kv, D_v]`` → ``[B*K, H_q, D_v]``.
    ``prefix_backend`` and ``prefix_plan_kwargs`` (instance attributes, set before the first
    round) pick the prefill wrapper's kernel for the prefix pass and extra ``plan`` arguments
    (``fixed_split_size``, ...; they override the graph plan's ``uniform_q_len`` and
    ``disable_split_kv``), for benchmarks. ``auto`` resolves to fa2 here (FlashInfer
    takes fa2 for <= 64 query rows per request); forcing fa3 measured 3.9x slower on the
    H200 with page-size-1 gathers (``benchmarks/results/2026-11-29-h200/flashinfer-bench.md``).
    """

    dtypes = (torch.bfloat16, torch.float16)
    supports_cuda_graph = True
    tested_on = _TESTED
    prefix_backend = "auto"
    prefix_plan_kwargs: dict = {}

    def _default_params(self) -> Params:
        return default_params(self.runner.head_dim)

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


class FlashInferExtend(FlashInferExtendGlue, name="flashinfer", flavour="mha",
                       platforms=is_cuda, models=("mha",), requires=_REQUIRES,
                       kernel_library="flashinfer", priority=_PRIORITY):
    """Draft extend for MHA/GQA: causal paged prefill over ragged requests.

    q: ``[T, H_q, D]``, k: ``[T, H_kv, D]``, v: ``[T, H_kv, D_v]`` → ``[T, H_q, D_v]``.
    """

    dtypes = (torch.bfloat16, torch.float16)
    supports_cuda_graph = True
    tested_on = _TESTED

    def _default_params(self) -> Params:
        return default_params(self.runner.head_dim)

    def _new_pass(self, graph_rows=None, capacity=0):
        return PrefillPass(self.runner, with_lse=False, graph_rows=graph_rows,
                           capacity=capacity)


def _mla_params(runner) -> Params:
    return Params(1.0 / math.sqrt(runner.kv_lora_rank + runner.qk_rope_head_dim), 0.0)


def _mla_layer_params(layer) -> Params:
    if layer.logit_cap > 0:
        raise InvalidInputError("layer.logit_cap", "0 (FlashInfer MLA has no soft cap)",
                                layer.logit_cap)
    return Params(float(layer.scaling), 0.0)


class FlashInferMLADecode(FlashInferDecodeGlue, name="flashinfer", flavour="mla",
                          platforms=is_cuda, models=("mla",), requires=_REQUIRES,
                          kernel_library="flashinfer", priority=_PRIORITY):
    """MLA draft decode through ``BatchMLAPagedAttentionWrapper``, ``topk > 1`` included.

    q: ``[B*K, H, R + rope]`` (absorbed), k: ``[B*K, R + rope]``, v: ``None`` →
    ``[B*K, H, R]``. The plan reads the index range back from the device (FlashInfer's MLA
    planner validates it), one sync per planned pass.
    """

    dtypes = (torch.bfloat16, torch.float16)
    supports_cuda_graph = True
    tested_on = _TESTED

    def _default_params(self) -> Params:
        return _mla_params(self.runner)

    def _check_layer_params(self, layer) -> Params:
        return _mla_layer_params(layer)

    def _new_pass(self, role, graph_rows, capacity):
        return MLAPass(self.runner, with_lse=role != "full", graph_rows=graph_rows,
                       capacity=capacity)

    def _history_pools(self, layer_id):
        # The latent pool [num_slots, R + rope] is both K (all of it) and V (its first R).
        kv = self.runner.kv_buffer[layer_id]
        return kv.unsqueeze(1), kv[:, :self.runner.kv_lora_rank].unsqueeze(1)


class FlashInferMLAExtend(FlashInferExtendGlue, name="flashinfer", flavour="mla",
                          platforms=is_cuda, models=("mla",), requires=_REQUIRES,
                          kernel_library="flashinfer", priority=_PRIORITY):
    """MLA draft extend: one causal ``BatchMLAPagedAttentionWrapper`` pass.

    q: ``[T, H, R + rope]``, k: ``[T, R + rope]``, v: ``None`` → ``[T, H, R]``.
    """

    dtypes = (torch.bfloat16, torch.float16)
    supports_cuda_graph = True
    tested_on = _TESTED

    def _default_params(self) -> Params:
        return _mla_params(self.runner)

    def _check_layer_params(self, layer) -> Params:
        return _mla_layer_params(layer)

    def _new_pass(self, graph_rows=None, capacity=0):
        return MLAPass(self.runner, with_lse=False, graph_rows=graph_rows, capacity=capacity)
