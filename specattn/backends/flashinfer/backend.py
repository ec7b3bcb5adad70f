"""The registered ``flashinfer`` classes (declarations and capabilities); the package doc
says what they compute."""


from __future__ import annotations

import math
from typing import Optional

import torch

from ...errors import BackendUnavailableError
from ...fp8 import FP8_KV_DTYPES, KV_DTYPES_WITH_FP8
from ...keys import BackendRequest
from ...platforms import Platform, is_cuda, is_hopper
from ._decode import MODES, FlashInferDecodeGlue
from ._extend import FlashInferExtendGlue
from ._passes import DecodePass, MLAPass, Params, PrefillPass, default_params

__all__ = ["FlashInferDecode", "FlashInferMLADecode", "FlashInferExtend",
           "FlashInferMLAExtend", "MODES"]

_REQUIRES = (("flashinfer", "flashinfer-python~=0.7.0"),)
_PRIORITY = {"cuda": 70}
_TESTED = "H200 (sm90)"


# FlashInfer 0.7.4's MLA kernels (fa2/fa3, mla/_batch_mla/_backends/_fa_common.py) take an FP8
# latent pool only as e4m3, on SM90, with a bf16 query, kv_lora_rank 512 and rope 0 or 64.
_MLA_FP8_RANK, _MLA_FP8_ROPES = 512, (0, 64)
_MLA_FP8 = ("FlashInfer 0.7.4's MLA kernels take an FP8 latent pool only as e4m3, on SM90, "
            "with a bf16 query, kv_lora_rank 512 and rope 0 or 64")


# FlashInfer 0.7.4's paged prefill kernels (``prefill.cuh``, ``KernelTraits::IsInvalid``),
# which every MHA round calls, have no tile for values under 64 wide (``NUM_MMA_D_VO < 4``):
# the call fails with an internal "Invalid configuration" error.
_MIN_VALUE_WIDTH = 64


class _MHA:
    """Capabilities and plan parameters of the MHA flavour (decode and extend)."""

    dtypes = (torch.bfloat16, torch.float16)
    kv_cache_dtypes = KV_DTYPES_WITH_FP8
    supports_cuda_graph = True
    reads_host_lengths = True  # FlashInfer plans on the host
    tested_on = _TESTED

    def _construct(self, runner, request: BackendRequest) -> None:
        super()._construct(runner, request)  # type: ignore[misc]
        r = self.runner  # type: ignore[attr-defined]
        if r.v_head_dim < _MIN_VALUE_WIDTH:
            why = (f"FlashInfer's prefill kernels take values at least {_MIN_VALUE_WIDTH} "
                   f"wide; the model has v_head_dim {r.v_head_dim} (head_dim {r.head_dim})")
            raise BackendUnavailableError(f"flashinfer: {why}", "flashinfer",
                                          {type(self).qualified_name(): [why]})

    def _default_params(self) -> Params:
        return default_params(self.runner.head_dim)


class _MLA:
    """Capabilities and plan parameters of the MLA flavour (decode and extend)."""

    dtypes = (torch.bfloat16, torch.float16)
    kv_cache_dtypes = ("auto", "fp8_e4m3")
    supports_cuda_graph = True
    reads_host_lengths = True  # FlashInfer plans on the host
    soft_cap_models = frozenset()  # FlashInfer MLA has no soft cap
    tested_on = _TESTED

    @classmethod
    def check_request(cls, request: BackendRequest, platform: Platform) -> Optional[str]:
        """FlashInfer's FP8 MLA kernels (``_MLA_FP8``): e4m3, SM90, bf16."""
        if request.kv_cache_dtype not in FP8_KV_DTYPES:
            return None
        fits = (request.kv_cache_dtype == "fp8_e4m3" and is_hopper(platform)
                and request.dtype in (None, torch.bfloat16))
        query = "" if request.dtype is None else \
            f" with a {str(request.dtype).replace('torch.', '')} query"
        return None if fits else \
            f"{_MLA_FP8}; asked for {request.kv_cache_dtype}{query} on {platform}"

    def _check_fp8_shape(self) -> None:
        r = self.runner
        if r.fp8 and (r.kv_lora_rank != _MLA_FP8_RANK
                      or r.qk_rope_head_dim not in _MLA_FP8_ROPES):
            why = (f"{_MLA_FP8}; the runner has kv_lora_rank {r.kv_lora_rank}, rope "
                   f"{r.qk_rope_head_dim}")
            raise BackendUnavailableError(f"flashinfer: {why}", "flashinfer",
                                          {type(self).qualified_name(): [why]})

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
    ``[B*K, H, R]``. The plan (``MLAPlanMetadata.csr``) is given the indptrs and lengths
    on the host and the slot list on the device.
    """

    def __init__(self, runner, topk: int, num_steps: int, *, tree_mode: str = "lane",
                 mode: str = "shared") -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode, mode=mode)
        self._check_fp8_shape()

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

    def __init__(self, runner, *, topk: int = 1, num_steps: int = 1) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self._check_fp8_shape()

    def _new_pass(self, graph_rows=None, capacity=0):
        return MLAPass(self.runner, with_lse=False, graph_rows=graph_rows, capacity=capacity)
