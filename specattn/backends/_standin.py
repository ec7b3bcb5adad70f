"""Shared helpers of the vendor-glue rows (``flashmla``, ``tokenspeed_mla``, ``aiter``,
``ascend``): the lazy vendor import, fixed/growing metadata buffers and the decode round
plumbing around them (``BufferedDecode``), per-lane block tables and the log-sum-exp merge.

Vendor import: ``vendor_module(name, pip_name, backend)`` imports the library when a backend
is *constructed* (never when specattn is imported). Whatever ``sys.modules[name]`` holds is
used, so a test can inject a stand-in module (``tests/standins/``) that records calls and
answers with the reference result; without the library the constructor raises
``BackendUnavailableError`` naming the package to install.

Device: every helper works on the runner's device, CPU included (stand-in tests).
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType
from typing import TYPE_CHECKING, Optional

import torch

from .. import validation
from ..errors import BackendUnavailableError, InvalidInputError
from ..install import install_hint
from ..metadata import history_slots

if TYPE_CHECKING:
    from ..data import DraftBatch

__all__ = ["vendor_module", "Buffers", "BufferedDecode", "lane_block_table", "merge_lse",
           "ceil_div"]


def ceil_div(a, b):
    return (a + b - 1) // b


def vendor_module(name: str, pip_name: str, backend: str) -> ModuleType:
    """``import name`` (or the stand-in already in ``sys.modules``), else a clear error."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise BackendUnavailableError(
            f"{backend}: needs the '{name}' package, which cannot be imported here ({exc}); "
            f"install it with: {install_hint(pip_name)}", backend,
            {backend: [f"needs the '{name}' package ({install_hint(pip_name)})"]}) from exc


class Buffers:
    """Named metadata tensors, handed out as views of flat storage.

    Eager mode grows a buffer when a batch needs more room. After ``freeze()`` (CUDA-graph
    mode, called by ``init_cuda_graph_state`` once every buffer was sized for ``max_bs``) a
    buffer never moves, so a captured graph keeps reading the memory the replay refills.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.fixed = False
        self._flat: dict[str, torch.Tensor] = {}

    def freeze(self) -> None:
        self.fixed = True

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.int32,
            ) -> torch.Tensor:
        n = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.dtype != dtype or flat.numel() < n:
            if self.fixed and flat is not None:
                raise InvalidInputError(f"buffer {name!r}", f"at most {flat.numel()} entries "
                                        "(sized by init_cuda_graph_state)", n)
            flat = torch.zeros(max(n, 1), dtype=dtype, device=self.device)
            self._flat[name] = flat
        return flat[:n].view(shape)

    def data_ptr(self, name: str) -> int:
        return self._flat[name].data_ptr()

    def round_fields(self, bs: int, topk: int, num_steps: int,
                     batch: Optional["DraftBatch"] = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The round's ``req_pool_indices [bs]``, ``seq_lens [bs]`` and ``out_cache_loc
        [bs, topk, num_steps]`` (int64 buffers); ``batch``'s values are copied in if given."""
        rpi = self.get("req_pool_indices", (bs,), torch.int64)
        seq = self.get("seq_lens", (bs,), torch.int64)
        loc = self.get("out_cache_loc", (bs, topk, num_steps), torch.int64)
        if batch is not None:
            rpi.copy_(batch.req_pool_indices)
            seq.copy_(batch.seq_lens)
            loc.copy_(batch.out_cache_loc)
        return rpi, seq, loc


class BufferedDecode:
    """Round plumbing of a decode glue class whose metadata lives in ``self._bufs``
    (``Buffers``) and is written by ``self._fill(batch, bs)``.

    ``init_forward_metadata`` validates and fills; capture/replay check the graph protocol
    (``init_cuda_graph_state`` froze the buffers, ``batch`` padded to ``bs``, within
    ``cuda_graph_max_bs``) and then refill the frozen buffers in place (``_graph_fill``).
    Mix in before ``DraftDecodeBackend``."""

    def init_forward_metadata(self, batch: "DraftBatch") -> None:
        validation.check_decode_batch(self.runner, self.topk, self.num_steps, self.tree_mode,
                                      batch)
        self._fill(batch, batch.batch_size)

    def init_forward_metadata_capture_cuda_graph(self, batch: "DraftBatch") -> None:
        self._graph(batch, batch.batch_size)

    def init_forward_metadata_replay_cuda_graph(self, batch: "DraftBatch", bs: int) -> None:
        self._graph(batch, bs)

    def _graph(self, batch: "DraftBatch", bs: int) -> None:
        self._check_graph_batch(batch, bs, ready=self._bufs.fixed)
        self._graph_fill(batch, bs)

    def _graph_fill(self, batch: "DraftBatch", bs: int) -> None:
        self._fill(batch, bs)


def lane_block_table(out: torch.Tensor, req_to_token: torch.Tensor,
                     req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     out_cache_loc: torch.Tensor, parents: Optional[torch.Tensor], step: int,
                     tree_mode: str, page_size: int) -> torch.Tensor:
    """Block table of every lane at draft step ``step``, written into ``out [B*K, width]``.

    Lane ``z = b*K + j`` sees ``L_b + step + 1`` positions, the prefix then its history:

    - ``page_size == 1``: entries are slots: ``R_b[0 : L_b]`` then the lane's history
      (``lane`` or ``path`` tree mode), so any slot list is expressible;
    - ``page_size > 1``: entries are page ids: the full prefix pages ``R_b[p*P] // P`` for
      ``p*P < base_b`` (``base_b = L_b - L_b % P``), then the lane's own pages at positions
      ``base_b + j*npp_b*P + p'*P`` (``npp_b = ceil((L_b % P + S) / P)``). This is the serving
      engine's draft allocation (``metadata.draft_slot_positions``; ``K == 1`` is its special
      case): the partial last page is duplicated into each lane's first page, so the lane's
      history sits right after the prefix in its own pages. ``lane`` tree mode only.

    Entries past a lane's length are 0. No host sync.
    """
    bs, topk, num_steps = out_cache_loc.shape
    width = out.shape[1]
    dev = out.device
    L = seq_lens.long()
    rows = req_to_token[req_pool_indices.long()]  # [B, ctx]
    x = torch.arange(width, device=dev)
    ctx = req_to_token.shape[1]
    if page_size == 1:
        hist = history_slots(out_cache_loc, parents, step, tree_mode).long()  # [B, K, n]
        pre = torch.gather(rows, 1, x.clamp(max=ctx - 1).expand(bs, width)).long()
        n = step + 1
        hcol = (x[None, :] - L[:, None]).clamp(0, n - 1)  # [B, width]
        his = torch.gather(hist, 2, hcol[:, None, :].expand(bs, topk, width))
        table = torch.where((x[None, :] < L[:, None])[:, None, :], pre[:, None, :], his)
        valid = x[None, :] < (L[:, None] + n)
    else:
        P = page_size
        last = L % P
        base = L - last
        npp = ceil_div(last + num_steps, P)
        j = torch.arange(topk, device=dev)
        pos_pre = x * P  # [width]
        own = base[:, None, None] + j[None, :, None] * npp[:, None, None] * P + (
            x[None, None, :] * P - base[:, None, None])  # [B, K, width]
        pos = torch.where(pos_pre[None, None, :] < base[:, None, None],
                          pos_pre[None, None, :].expand(bs, topk, width), own)
        slots = torch.gather(rows[:, None, :].expand(bs, topk, ctx), 2,
                             pos.clamp(0, ctx - 1)).long()
        table = slots // P
        valid = x[None, :] < ceil_div(L[:, None] + step + 1, P)
    table = torch.where(valid[:, None, :], table, torch.zeros_like(table))
    out.copy_(table.reshape(bs * topk, width))
    return out


def merge_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """Merge two partial attentions over disjoint key sets (natural-log LSEs).

    o1, o2: ``[N, H, D]``; lse1, lse2: ``[N, H]`` (``-inf`` = empty part). Returns
    ``[N, H, D]`` in ``out_dtype``.
    """
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w1 = torch.exp(lse1 - m)
    w2 = torch.exp(lse2 - m)
    o = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
    return o.to(out_dtype)
