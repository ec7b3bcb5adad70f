"""Ascend NPU rows through ``torch_npu``: ``ascend`` and the NPU flavour of ``dsv4``.

Vendor glue, **not run on hardware** (no Ascend NPU here); tests drive it through a recording
stand-in of ``torch_npu`` (``tests/standins/torch_npu.py``).

Every call is a *paged decode over query rows*: each row is one query token with its own
page-level block table (``block_table [rows, width]`` int32, page ids ``slot // P``) and its
visible length (a host list / CPU tensor, as the NPU ops take it; read once per round):

- draft decode: row = lane ``z = b*K + j`` at step ``i``, ``L_b + i + 1`` keys, the table from
  ``metadata.lane_block_table`` (shared full prefix pages, then the lane's own pages: the
  serving engine's draft allocation, ``lane`` tree mode). Upstream Ascend has no lane
  expansion (``topk == 1``); the per-lane tables lift that. Step ``i`` sees the prefix plus its
  ``i + 1`` drafts (the newer upstream revision's ``speculative_step_id + 1``).
- draft extend: row = new token ``t`` of request ``b``, ``L'_b - E_b + t + 1`` keys, the
  request's table (each token its own row, as SGLang's DSA path runs draft extend). This keeps
  one op per model type instead of the fused rightDownCausal ``forward_mtp`` call, whose
  ``TND`` layout only takes ``D = 512`` MLA or ``D = 192`` heads.

Ops (torch_npu API reference):

- MHA: ``torch_npu.npu_fused_infer_attention_score(query [rows, 1, H, D], key, value,
  num_heads, num_key_value_heads, input_layout="BSND", scale, block_table, block_size=P,
  actual_seq_lengths_kv)`` with the pools viewed as ``[blocks, P, H_kv * D]`` (the only paged
  KV layout BSND accepts). Returns ``(out [rows, 1, H, D_v], lse)``.
- MLA: ``torch_npu._npu_paged_attention_mla(query [rows, H, R + rope], key_cache
  [blocks, P, 1, R + rope], num_kv_heads=1, num_heads, scale_value, block_table, context_lens,
  mla_vheadsize=R, out)``: it takes the whole latent row, which is our pool's layout (FIA's MLA
  path wants ``c_kv`` and ``k_rope`` as separate contiguous pools). Eager only: upstream notes
  it does not work in graph mode.
- ``dsv4`` (NPU flavour): the FIA call above on the one-vector pool (keys = values,
  ``H_kv = 1``) with ``softmax_lse_flag=True`` and, for the sliding window, a boolean
  ``atten_mask [rows, width * P]`` (``True`` = masked) hiding positions before
  ``len - window``; the sink is applied to the output with the returned natural-log LSE:
  ``o * sigmoid(lse - sink)``. Same key sets as ``specattn.backends.dsv4``
  (``specattn.sink_window``).

Page sizes: multiples of 16 up to 512 (FIA's page attention needs 16-aligned blocks for
fp16/bf16); pools must hold whole pages. No logit soft-cap (neither op has one).

CUDA graphs: the graph methods fill fixed table buffers, but ``supports_cuda_graph`` stays
False: the ops take host-side lengths, which NPU graphs update through torch_npu's graph
update machinery (not wired here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..base import DraftDecodeBackend, DraftExtendBackend
from ..buffers import Buffers
from ..errors import InvalidInputError
from ..metadata import extend_token_slots, lane_block_table, prefix_page_table
from ..platforms import is_npu
from ..sink_window import (DEFAULT_WINDOW, KIT_LIMITS, check_window, check_window_runner,
                           layer_sink)
from ..util import ceil_div, vendor_module
from ..validation import check_whole_pages

if TYPE_CHECKING:
    from ..data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner

__all__ = ["AscendDecode", "AscendExtend", "DSV4NpuDecode", "DSV4NpuExtend", "PAGE_SIZES"]

PAGE_SIZES = frozenset(range(16, 513, 16))
_NPU = (("torch_npu", "torch-npu"),)
_TESTED = "not run on hardware (stand-in tested)"


class _Rows:
    """The paged-rows call shared by the four classes (``kind``: ``mha``, ``mla``,
    ``window``)."""

    def __init__(self, runner: "DraftRunner", kind: str, backend: str,
                 window: Optional[int] = None) -> None:
        self.runner, self.kind, self.window = runner, kind, window
        self.npu = vendor_module("torch_npu", "torch-npu", backend)
        self.P = runner.page_size
        self.width = ceil_div(runner.max_context_len, self.P) + 1

    def run(self, q: torch.Tensor, layer: "AttentionLayer", table: torch.Tensor,
            lens: list[int], sink: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: ``[rows, H, W]``; table: ``[rows, width]`` int32; lens: ``rows`` host ints."""
        r, P, rows = self.runner, self.P, q.shape[0]
        lid = layer.layer_id
        if self.kind == "mla":
            out = torch.empty(rows, r.num_heads, r.kv_lora_rank, dtype=q.dtype,
                              device=q.device)
            width = r.kv_lora_rank + r.qk_rope_head_dim
            self.npu._npu_paged_attention_mla(
                query=q, key_cache=r.kv_buffer[lid].view(-1, P, 1, width), num_kv_heads=1,
                num_heads=r.num_heads, scale_value=layer.scaling, block_table=table,
                context_lens=torch.tensor(lens, dtype=torch.int32), mla_vheadsize=r.kv_lora_rank,
                out=out)
            return out
        if self.kind == "mha":
            key = r.k_buffer[lid].view(-1, P, r.num_kv_heads * r.head_dim)
            value = r.v_buffer[lid].view(-1, P, r.num_kv_heads * r.v_head_dim)
            out, _ = self.npu.npu_fused_infer_attention_score(
                q.view(rows, 1, q.shape[1], q.shape[2]), key, value,
                num_heads=r.num_q_heads, num_key_value_heads=r.num_kv_heads,
                input_layout="BSND", scale=layer.scaling, block_table=table, block_size=P,
                actual_seq_lengths_kv=lens)
            return out.view(rows, r.num_q_heads, r.v_head_dim)
        # window (dsv4): one vector per slot, keys = values.
        pool = (r.kv_buffer[lid] if r.use_mla_backend else r.k_buffer[lid][:, 0, :])
        kv = pool.view(-1, P, pool.shape[-1])
        x = torch.arange(table.shape[1] * P, device=q.device)
        start = torch.tensor(lens, device=q.device) - self.window
        mask = x[None, :] < start[:, None]  # True = masked
        heads = q.shape[1]
        out, lse = self.npu.npu_fused_infer_attention_score(
            q.view(rows, 1, heads, q.shape[2]), kv, kv, atten_mask=mask,
            num_heads=heads, num_key_value_heads=1, input_layout="BSND", scale=layer.scaling,
            block_table=table, block_size=P, actual_seq_lengths_kv=lens, sparse_mode=0,
            softmax_lse_flag=True)
        out = out.view(rows, heads, -1)
        if sink is None:
            return out
        lse = lse.view(rows, heads)
        return (out.float() * torch.sigmoid(lse - sink.float())[..., None]).to(q.dtype)


class _NpuBackend:
    """What the four classes share: the pool check, the op wrapper, the sink keyword."""

    page_sizes = PAGE_SIZES
    dtypes = (torch.bfloat16, torch.float16)
    tested_on = _TESTED
    soft_cap_models = frozenset()  # neither op has a soft cap
    _window: Optional[int] = None

    def _open_ops(self, runner: "DraftRunner") -> None:
        check_whole_pages(runner, type(self).name)
        self._rows = _Rows(runner, self._kind_for(runner), type(self).name, self._window)
        self._bufs = Buffers(runner.device)

    def _kind_for(self, runner: "DraftRunner") -> str:
        return "mla" if runner.use_mla_backend else "mha"

    def _forward_options(self, layer: "AttentionLayer", *,
                         attn_sink: Optional[torch.Tensor] = None) -> dict:
        if attn_sink is not None:
            raise InvalidInputError("attn_sink", f"None ({self.name} has no attention sink)",
                                    "a tensor")
        return {"sink": None}

    def _refuse_mla_graph(self) -> None:
        if self._rows.kind == "mla":
            raise InvalidInputError("CUDA/NPU graph", "an MHA model (the MLA op "
                                    "_npu_paged_attention_mla runs eagerly only)", "an MLA model")


class _NpuDecode(_NpuBackend, DraftDecodeBackend):
    """Per-lane paged decode on torch_npu (see the module doc)."""

    tree_modes = frozenset({"lane"})

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int, *,
                 tree_mode: str = "lane") -> None:
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
        self._open_ops(runner)

    def _plan(self, batch: "DraftBatch") -> None:
        # Host lengths for the ops' length arguments: one read per round.
        self._host_lens = [int(x) for x in batch.seq_lens.tolist() for _ in range(self.topk)]

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        """A fixed table buffer for ``max_bs * topk`` lanes."""
        self._bufs.get("table", (max_bs * self.topk, self._rows.width))
        self._bufs.freeze()

    def _plan_graph(self, batch: "DraftBatch", *, capture: bool) -> None:
        self._refuse_mla_graph()
        self._plan(batch)

    def _attend(self, step: int, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], *, sink: Optional[torch.Tensor]) -> torch.Tensor:
        """q: ``[B*K, H, W]`` → ``[B*K, H, D_v]`` (see ``DraftDecodeBackend``)."""
        r, batch, n = self.runner, self.batch, self.num_lanes
        table = lane_block_table(self._bufs.get("table", (n, self._rows.width)), r.req_to_token,
                                 batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc,
                                 None, step, "lane", r.page_size, num_slots=r.num_slots)
        lens = [x + step + 1 for x in self._host_lens]
        return self._rows.run(q, layer, table, lens, sink)


class _NpuExtend(_NpuBackend, DraftExtendBackend):
    """Draft extend: every new token is one row of the paged decode op."""

    def __init__(self, runner: "DraftRunner", *, topk: int = 1, num_steps: int = 1) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self._open_ops(runner)

    def _plan(self, batch: "DraftExtendBatch") -> None:
        r, n = self.runner, self.num_tokens
        meta = extend_token_slots(r.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                  batch.extend_lens, max_len=1, num_tokens=n,
                                  num_slots=r.num_slots)
        width = self._rows.width
        pages = prefix_page_table(r.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                  r.page_size, width, num_slots=r.num_slots)
        self._bufs.get("table", (n, width)).copy_(pages[meta.token_req])
        self._host_lens = [int(x) for x in meta.token_visible.tolist()]

    def _alloc_graph_buffers(self, max_bs: int, max_num_tokens: int) -> None:
        self._bufs.get("table", (max_num_tokens, self._rows.width))
        self._bufs.freeze()

    def _plan_graph(self, batch: "DraftExtendBatch", *, capture: bool) -> None:
        self._refuse_mla_graph()
        self._plan(batch)

    def _attend(self, layer: "AttentionLayer", q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor], *, sink: Optional[torch.Tensor]) -> torch.Tensor:
        """q: ``[T, H, W]`` → ``[T, H, D_v]`` (see ``DraftExtendBackend``)."""
        table = self._bufs.get("table", (self.num_tokens, self._rows.width))
        return self._rows.run(q, layer, table, self._host_lens, sink)


_DECL = dict(platforms=is_npu, requires=_NPU, kernel_library="torch_npu")


class AscendDecode(_NpuDecode, name="ascend", priority={"npu": 70}, **_DECL):
    """Ascend draft decode, MHA/GQA (FIA) and MLA (``_npu_paged_attention_mla``)."""


class AscendExtend(_NpuExtend, name="ascend", priority={"npu": 70}, **_DECL):
    """Ascend draft extend, MHA/GQA (FIA) and MLA (``_npu_paged_attention_mla``)."""


# --- dsv4, NPU flavour -----------------------------------------------------------------------


class _DSV4Npu:
    """The dsv4 rules (``specattn.sink_window``) on the Ascend classes: window kind, the
    ``window`` keyword, the sink."""

    auto_eligible = False
    known_limits = KIT_LIMITS
    kit_options = {"window": 1 << 30}  # every key in the window: dense attention

    def _kind_for(self, runner: "DraftRunner") -> str:
        check_window_runner(runner)
        return "window"

    @property
    def window(self) -> int:
        return self._window

    def _forward_options(self, layer: "AttentionLayer", *,
                         attn_sink: Optional[torch.Tensor] = None) -> dict:
        return {"sink": layer_sink(self.runner, layer, attn_sink)}


class DSV4NpuDecode(_DSV4Npu, _NpuDecode, name="dsv4", flavour="npu", **_DECL):
    """DeepSeek V4 draft decode, Ascend flavour: sliding window + sink through FIA.

    ``window`` (default 128); ``forward(..., attn_sink=None)`` or a ``SinkAttentionLayer``."""

    def __init__(self, runner: "DraftRunner", topk: int, num_steps: int, *,
                 tree_mode: str = "lane", window: int = DEFAULT_WINDOW) -> None:
        self._window = check_window(window)
        super().__init__(runner, topk, num_steps, tree_mode=tree_mode)


class DSV4NpuExtend(_DSV4Npu, _NpuExtend, name="dsv4", flavour="npu", **_DECL):
    """DeepSeek V4 draft extend, Ascend flavour (token ``p`` sees ``R_b[p+1-window : p+1]``)."""

    def __init__(self, runner: "DraftRunner", *, topk: int = 1, num_steps: int = 1,
                 window: int = DEFAULT_WINDOW) -> None:
        self._window = check_window(window)
        super().__init__(runner, topk=topk, num_steps=num_steps)
