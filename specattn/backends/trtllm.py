"""TRT-LLM-gen backends from FlashInfer (Blackwell, CUDA compute capability 10.x):
``trtllm_mha``, ``trtllm_mla``, ``cutedsl_mla``. Vendor glue, **not run on hardware** (no
Blackwell GPU here); tests drive it through a recording stand-in of ``flashinfer``
(``tests/standins/trtllm_flashinfer.py``).

Calls (per layer; arguments as SGLang's ``trtllm_mha_backend`` / ``trtllm_mla_backend``)::

    flashinfer.decode.trtllm_batch_decode_with_kv_cache(query [rows * q_len, H_q, D],
        kv_cache = (k, v) each [pages, H_kv, P, D] (HND *view* of the token-major pool),
        workspace_buffer (int8, zeroed), block_tables [rows, width] int32, seq_lens [rows]
        int32, max_seq_len, bmm1_scale = layer.scaling * k_scale, bmm2_scale = v_scale,
        q_len_per_req) → [rows * q_len, H_q, D]
    flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla(query [rows, q_len, H, 576],
        kv_cache [pages, 1, P, 576], workspace_buffer, qk_nope_head_dim = 128,
        kv_lora_rank = 512, qk_rope_head_dim = 64, block_tables [rows, width] int32 (width a
        multiple of 128 / P), seq_lens [rows] int32, max_seq_len, bmm1_scale, bmm2_scale
        [, backend="cute-dsl"]) → bf16 [rows, q_len, H, 512]

``k_scale = v_scale = 1`` (the pool stores unscaled bf16/fp16 values; FP8 KV is not wired).
With ``q_len > 1`` the kernels mask causally, bottom-right aligned: query ``t`` of a row sees
``seq_len - q_len + t + 1`` keys (SGLang's target-verify and draft-extend rely on this).
``cutedsl_mla`` is the same MLA entry point with ``backend="cute-dsl"`` and its own
workspace (SGLang: the CuTe-DSL kernel writes split-KV partials into it, which would corrupt
the trtllm-gen counters of a shared one); its draft extend is ``TRTLLMMLAExtend`` by alias.

**Draft decode: per-lane sequences.** FlashInfer 0.7.x's trtllm-gen decode returns no LSE
(``return_lse`` exists only on newer main, base unverified), so the prefix/history split of
``flashmla`` cannot be merged. Each lane ``z = b*K + j`` is instead one kernel row
(``q_len = 1``) over ``L_b + i + 1`` keys whose block table is the shared full prefix pages
followed by the lane's own pages (``metadata.lane_rows``). This needs the serving
engine's draft layout (``metadata.draft_slot_positions``: the lane's draft slots sit
page-aligned right after its copy of the partial last page, which the serving code
duplicates per lane when ``P > 1 and K > 1``): ``out_cache_loc[b, j, t] ==
R_b[base_b + j*npp_b*P + last_b + t]``. Other layouts are rejected with
``InvalidInputError`` when the batch is checked by value (CPU tensors, or
``SPECATTN_DEBUG_CHECKS=1`` on a device; the check costs one host sync). Consequences:

- ``topk > 1`` works (upstream refuses it for all three); every lane reads the prefix again
  (the kernel cannot share it across rows);
- ``lane`` tree mode only: a ``path`` history is not a run of pages (page size >= 16).

**Draft extend.** One row per request, its ``E_b`` queries left-aligned in
``q_len = max(E)`` slots and ``seq_len = L'_b - E_b + q_len`` (SGLang's TRT-LLM MLA
draft-extend convention), so the causal mask gives query ``t < E_b`` exactly
``L'_b - E_b + t + 1`` keys and ``seq_len >= q_len`` always holds. Padding rows read past
``L'_b`` (table entries there are page 0, valid memory); their outputs are dropped.
``max(E)`` is read on the host once per batch, so extend has no CUDA-graph path.

CUDA graphs (decode): request/length/slot buffers, the lane table ``[max_bs*K, width]``, the
lane lengths and the workspace are fixed by ``init_cuda_graph_state``; the table is rebuilt
per step with torch ops (no host sync). ``max_seq_len`` is the static bound
``max_context_len + S``.

Limits: no logit soft-cap, no sliding window, no attention sinks; MHA needs
``v_head_dim == head_dim``; MLA needs DeepSeek's shape (``kv_lora_rank`` 512, rope 64) and
bf16; page sizes 16/32/64 (MHA) and 32/64 (MLA) as upstream's server args force; the pool's
slot count must be a multiple of the page size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from .. import validation
from ..base import DraftDecodeBackend, DraftExtendBackend
from ..buffers import Buffers
from ..errors import BackendUnavailableError, InvalidInputError
from ..metadata import draft_slot_positions, extend_token_slots, lane_rows, prefix_page_table
from ..platforms import cuda_capability
from ..util import ceil_div, vendor_module
from ..validation import check_whole_pages

if TYPE_CHECKING:
    from ..data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner

__all__ = ["TRTLLMMHADecode", "TRTLLMMHAExtend", "TRTLLMMLADecode", "CuteDSLMLADecode",
           "TRTLLMMLAExtend"]

_SM10X = cuda_capability(10)
_REQUIRES = (("flashinfer", "flashinfer-python~=0.7.0"),)
_PRIORITY = {"cuda": 85}
_TESTED = "not run on hardware (Blackwell only; stand-in tested)"
_MHA_FN = "trtllm_batch_decode_with_kv_cache"
_MLA_FN = "trtllm_batch_decode_with_kv_cache_mla"
# DeepSeek's absorbed MLA shape, the only one trtllm-gen MLA takes; qk_nope_head_dim is only
# shape-checked by the kernel (the absorbed query is kv_lora_rank + rope wide).
_KV_LORA_RANK, _ROPE, _QK_NOPE = 512, 64, 128
_MLA_BLOCK_CONSTRAINT = 128  # block table width must be a multiple of 128 / page_size
# SGLang's trtllm workspace (150 MiB, zero-initialised once); the CPU stand-in needs none.
_WORKSPACE_BYTES = {"cuda": 150 * 1024 * 1024}
_K_SCALE = _V_SCALE = 1.0


def _vendor_function(backend: str, fn: str) -> Callable:
    """``flashinfer.decode.<fn>`` (or ``flashinfer.mla.<fn>``), imported lazily."""
    vendor_module("flashinfer", "flashinfer-python", backend)
    for sub in ("flashinfer.decode", "flashinfer.mla"):
        try:
            mod = vendor_module(sub, "flashinfer-python", backend)
        except BackendUnavailableError:
            continue
        if hasattr(mod, fn):
            return getattr(mod, fn)
    raise BackendUnavailableError(
        f"{backend}: the installed flashinfer has no flashinfer.decode.{fn} (needs a "
        "flashinfer-python release with the trtllm-gen decode functions)", backend,
        {backend: [f"flashinfer lacks {fn}"]})


def check_draft_layout(runner: "DraftRunner", batch: "DraftBatch", topk: int,
                       num_steps: int, backend: str, debug: Optional[bool] = None) -> None:
    """``out_cache_loc`` follows the serving engine's draft layout (module doc).

    Checked by value when the batch is on the CPU or debug checks are on (one host sync)."""
    loc = batch.out_cache_loc
    if debug is None:
        debug = validation.debug_checks_enabled()
    if not (debug or loc.device.type == "cpu"):
        return
    pos = draft_slot_positions(batch.seq_lens, topk, num_steps, runner.page_size)
    ctx = runner.max_context_len
    rows = runner.req_to_token[batch.req_pool_indices.long()].long()  # [B, ctx]
    want = torch.gather(rows[:, None, :].expand(-1, topk, -1), 2, pos.clamp(0, ctx - 1))
    bad = (want != loc.long()) | (pos >= ctx)
    if bool(bad.any()):
        b, j, t = (int(x) for x in bad.nonzero()[0])
        raise InvalidInputError(
            "batch.out_cache_loc",
            f"the serving engine's draft layout for {backend}'s per-lane page tables: "
            f"out_cache_loc[b, j, t] == req_to_token[req_pool_indices[b], base_b + "
            f"j*npp_b*P + last_b + t] (metadata.draft_slot_positions)",
            f"out_cache_loc[{b}, {j}, {t}] = {int(loc[b, j, t])}, the layout puts "
            f"{int(want[b, j, t]) if pos[b, j, t] < ctx else 'past max_context_len'} there")


class _TRTLLM:
    """Shared setup: vendor function, workspace."""

    tested_on = _TESTED
    kv_cache_dtypes = ("auto",)
    soft_cap_models = frozenset()  # trtllm-gen has no soft cap
    _fn_name = _MHA_FN
    _vendor_backend: Optional[str] = None  # MLA: the ``backend=`` argument, if any

    def _open_library(self, runner: "DraftRunner") -> None:
        check_whole_pages(runner, self.name)
        self._fn = _vendor_function(self.name, self._fn_name)
        self._bufs = Buffers(runner.device)

    def _workspace(self) -> torch.Tensor:
        nbytes = _WORKSPACE_BYTES.get(self.runner.device.type, 4096)
        return self._bufs.get("workspace", (nbytes,), torch.int8)  # zeros when created


class _MHA(_TRTLLM):
    page_sizes = frozenset({16, 32, 64})
    dtypes = (torch.bfloat16, torch.float16)

    def _open_library(self, runner: "DraftRunner") -> None:
        if runner.v_head_dim != runner.head_dim:
            raise BackendUnavailableError(
                f"{self.name}: trtllm-gen MHA needs v_head_dim == head_dim, the model has "
                f"{runner.v_head_dim} and {runner.head_dim}", self.name)
        super()._open_library(runner)

    def _call(self, q: torch.Tensor, layer: "AttentionLayer", table: torch.Tensor,
              lens: torch.Tensor, max_seq_len: int, q_len: int) -> torch.Tensor:
        """q: ``[rows * q_len, H_q, D]`` → ``[rows * q_len, H_q, D]``."""
        r = self.runner
        P, hkv = r.page_size, r.num_kv_heads
        # HND views of the token-major pool (SGLang's permute): no copy.
        k = r.k_buffer[layer.layer_id].view(-1, P, hkv, r.head_dim).permute(0, 2, 1, 3)
        v = r.v_buffer[layer.layer_id].view(-1, P, hkv, r.v_head_dim).permute(0, 2, 1, 3)
        return self._fn(query=q.contiguous(), kv_cache=(k, v),
                        workspace_buffer=self._workspace(), block_tables=table, seq_lens=lens,
                        max_seq_len=max_seq_len, bmm1_scale=layer.scaling * _K_SCALE,
                        bmm2_scale=_V_SCALE, q_len_per_req=q_len)


class _MLA(_TRTLLM):
    page_sizes = frozenset({32, 64})
    dtypes = (torch.bfloat16,)
    head_dims = frozenset({_KV_LORA_RANK + _ROPE})
    _fn_name = _MLA_FN

    def _open_library(self, runner: "DraftRunner") -> None:
        if (runner.kv_lora_rank, runner.qk_rope_head_dim) != (_KV_LORA_RANK, _ROPE):
            raise BackendUnavailableError(
                f"{self.name}: trtllm-gen MLA needs kv_lora_rank {_KV_LORA_RANK} and rope "
                f"{_ROPE}, the model has {runner.kv_lora_rank} and {runner.qk_rope_head_dim}",
                self.name)
        super()._open_library(runner)

    @staticmethod
    def _padded_width(num_tokens: int, page_size: int) -> int:
        mult = _MLA_BLOCK_CONSTRAINT // page_size
        return ceil_div(ceil_div(num_tokens, page_size), mult) * mult

    def _call(self, q: torch.Tensor, layer: "AttentionLayer", table: torch.Tensor,
              lens: torch.Tensor, max_seq_len: int) -> torch.Tensor:
        """q: ``[rows, q_len, H, 576]`` → ``[rows, q_len, H, 512]`` (runner dtype)."""
        r = self.runner
        kv = r.kv_buffer[layer.layer_id]
        extra = {} if self._vendor_backend is None else {"backend": self._vendor_backend}
        out = self._fn(query=q.contiguous(),
                       kv_cache=kv.view(-1, r.page_size, kv.shape[-1]).unsqueeze(1),
                       workspace_buffer=self._workspace(), qk_nope_head_dim=_QK_NOPE,
                       kv_lora_rank=_KV_LORA_RANK, qk_rope_head_dim=_ROPE,
                       block_tables=table, seq_lens=lens, max_seq_len=max_seq_len,
                       bmm1_scale=float(layer.scaling * _K_SCALE), bmm2_scale=_V_SCALE,
                       **extra)
        return out.to(r.dtype)


# --- draft decode ----------------------------------------------------------------------------

class _LaneDecode(DraftDecodeBackend):
    """Per-lane rows (module doc). Subclasses provide ``_call`` and ``_table_width``."""

    tree_modes = frozenset({"lane"})
    supports_cuda_graph = True

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int, *,
                 tree_mode: str = "lane") -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
        self._open_library(runner)
        self._width = self._table_width(runner.max_context_len + num_steps, runner.page_size)
        self._max_seq_len = runner.max_context_len + num_steps

    @staticmethod
    def _table_width(num_tokens: int, page_size: int) -> int:
        return ceil_div(num_tokens, page_size)

    def _check_batch(self, batch: "DraftBatch", debug: Optional[bool]) -> None:
        check_draft_layout(self.runner, batch, self.topk, self.num_steps, self.name, debug)

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed buffers for ``max_bs * K`` lanes (table, lengths, workspace)."""
        b, n = self._bufs, max_bs * self.topk
        b.get("table", (n, self._width))
        b.get("lens", (n,))
        self._workspace()
        b.freeze()

    def _lane_metadata(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Lane table ``[B*K, width]`` int32 and lane lengths ``[B*K]`` int32 for ``step``."""
        b, n = self._bufs, self.num_lanes
        return lane_rows(b.get("table", (n, self._width)), b.get("lens", (n,)),
                         self.runner.req_to_token, self.batch, step, self.runner.page_size,
                         num_slots=self.runner.num_slots)


class TRTLLMMHADecode(_MHA, _LaneDecode, name="trtllm_mha", platforms=_SM10X,
                      models=("mha",), requires=_REQUIRES,
                      kernel_library="flashinfer (trtllm-gen)", priority=_PRIORITY):
    """Per-lane trtllm-gen MHA decode. q ``[B*K, H_q, D]``, k/v ``[B*K, H_kv, D]`` →
    ``[B*K, H_q, D]``."""

    def _attend(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        table, lens = self._lane_metadata(step)
        return self._call(q, layer, table, lens, self._max_seq_len, 1)


class TRTLLMMLADecode(_MLA, _LaneDecode, name="trtllm_mla", platforms=_SM10X,
                      models=("mla",), mla_required_name="trtllm_mla", requires=_REQUIRES,
                      kernel_library="flashinfer (trtllm-gen)", priority=_PRIORITY):
    """Per-lane trtllm-gen MLA decode. q ``[B*K, H, 576]``, k ``[B*K, 576]`` →
    ``[B*K, H, 512]``."""

    @staticmethod
    def _table_width(num_tokens: int, page_size: int) -> int:
        return _MLA._padded_width(num_tokens, page_size)

    def _attend(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        table, lens = self._lane_metadata(step)
        r, n = self.runner, self.num_lanes
        out = self._call(q.view(n, 1, r.num_heads, q.shape[-1]), layer, table, lens,
                         self._max_seq_len)
        return out.view(n, r.num_heads, r.kv_lora_rank)


class CuteDSLMLADecode(TRTLLMMLADecode, name="cutedsl_mla", platforms=_SM10X,
                       models=("mla",), mla_required_name="trtllm_mla", requires=_REQUIRES,
                       kernel_library="flashinfer (CuTe-DSL)", priority={"cuda": 84}):
    """``trtllm_mla`` decode through FlashInfer's CuTe-DSL MLA kernel (``backend="cute-dsl"``,
    own workspace). Draft extend: ``TRTLLMMLAExtend`` (alias ``cutedsl_mla``)."""

    _vendor_backend = "cute-dsl"


# --- draft extend ----------------------------------------------------------------------------

class _PaddedExtend(DraftExtendBackend):
    """Left-aligned padded queries through the decode kernel (module doc)."""

    supports_cuda_graph = False  # max(E) sizes q_len on the host per batch

    def __init__(self, runner: "DraftRunner", *, topk: int = 1, num_steps: int = 1) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self._open_library(runner)

    @staticmethod
    def _table_width(num_tokens: int, page_size: int) -> int:
        return ceil_div(num_tokens, page_size)

    def _plan(self, batch: "DraftExtendBatch") -> None:
        r = self.runner
        meta = extend_token_slots(r.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                  batch.extend_lens, max_len=1, num_slots=r.num_slots)
        q_len = self._q_len = int(batch.extend_lens.max())
        # Token t of request b sits in padded row b * q_len + t; the row's keys run to
        # L' - E + q_len so that query t sees L' - E + t + 1 of them (module doc).
        self._rows = meta.token_req * q_len + meta.token_pos
        self._max_seq_len = r.max_context_len + q_len
        width = self._table_width(self._max_seq_len, r.page_size)
        self._table = prefix_page_table(r.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                        r.page_size, width, num_slots=r.num_slots)
        self._lens = (batch.seq_lens - batch.extend_lens + q_len).to(torch.int32)

    def _padded_query(self, q: torch.Tensor) -> torch.Tensor:
        """The padded query ``[B * q_len, H, D]``."""
        q_pad = q.new_zeros(self.batch.batch_size * self._q_len, *q.shape[1:])
        q_pad[self._rows] = q
        return q_pad


class TRTLLMMHAExtend(_MHA, _PaddedExtend, name="trtllm_mha", platforms=_SM10X,
                      models=("mha",), requires=_REQUIRES,
                      kernel_library="flashinfer (trtllm-gen)", priority=_PRIORITY):
    """Draft extend: q ``[sum(E), H_q, D]`` → ``[sum(E), H_q, D]``."""

    def _attend(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        q_pad = self._padded_query(q)
        out = self._call(q_pad, layer, self._table, self._lens, self._max_seq_len,
                         self._q_len)
        return out[self._rows]


class TRTLLMMLAExtend(_MLA, _PaddedExtend, name="trtllm_mla", aliases=("cutedsl_mla",),
                      platforms=_SM10X, models=("mla",), mla_required_name="trtllm_mla",
                      requires=_REQUIRES, kernel_library="flashinfer (trtllm-gen)",
                      priority=_PRIORITY):
    """Draft extend for ``trtllm_mla`` and, by alias, ``cutedsl_mla`` (trtllm-gen kernel).
    q ``[sum(E), H, 576]`` → ``[sum(E), H, 512]``."""

    @staticmethod
    def _table_width(num_tokens: int, page_size: int) -> int:
        return _MLA._padded_width(num_tokens, page_size)

    def _attend(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        q_pad = self._padded_query(q)
        r, bs = self.runner, self.batch.batch_size
        out = self._call(q_pad.view(bs, self._q_len, r.num_heads, q.shape[-1]), layer,
                         self._table, self._lens, self._max_seq_len)
        return out.reshape(bs * self._q_len, r.num_heads, r.kv_lora_rank)[self._rows]
