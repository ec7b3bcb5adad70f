"""Kept graph calls: the CUDA-graph replay metadata call of a backend whose graph round is one
metadata launch (``_fills_graph_round``), repeated at the cost of that launch.

An engine makes the replay metadata call on the host before every replay. Apart from the
values of the caller's index tensors, the call depends only on its signature: the captured
size, the tensors' dtypes, devices, shapes and strides (``signature``), in ``path`` mode the
captured ``parents`` tensor, and what a backend adds (``_graph_key_extra``). The first call of
a signature, the capture's included, runs the full checks and keeps what later calls repeat
(``Replay``); a later call of that signature launches the kept compiled kernel on the new
tensors (``kernel_launch.KernelLaunch``) and checks again only what reads values (CPU
tensors: a graph call makes no debug pass on a device).

A backend derives from ``KeptDecodeCalls`` / ``KeptExtendCalls`` instead of
``DraftDecodeBackend`` / ``DraftExtendBackend``, keeps its last metadata launch in
``self._launch`` and the round's buffers in ``self._active``, says what its plan is
(``_kept_plan`` / ``_resume_plan``) and, where it has more, what else the key holds
(``_graph_key_extra``) and what else a kept call checks (``_check_kept_call``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from . import validation as _validation
from .base import DraftDecodeBackend, DraftExtendBackend
from .data import DraftExtendBatch

if TYPE_CHECKING:
    from .data import DraftBatch

__all__ = ["MAX_KEPT", "KeptDecodeCalls", "KeptExtendCalls", "Replay", "signature"]

MAX_KEPT = 64  # signatures kept per backend (engines use a few per captured size)


def signature(t: Any) -> tuple:
    """What a kept launch's compiled code and the checks before it depend on in an index
    tensor: its dtype, shape, strides and device (not its address or values)."""
    return t.dtype, t.shape, t.stride(), t.device


class Replay:
    """What a graph call of one signature repeats: the metadata launch (run on the caller's
    new tensors), the round's fixed views (decode: a ``DraftBatch``; extend: the
    ``out_cache_loc`` view), its rows (lanes; extend: tokens), the backend's plan and its
    buffers."""

    __slots__ = ("launch", "fixed", "rows", "plan", "bufs")

    def __init__(self, launch: Any, fixed: Any, rows: int, plan: Any, bufs: Any) -> None:
        self.launch, self.fixed, self.rows, self.plan, self.bufs = \
            launch, fixed, rows, plan, bufs


class _KeptCalls:
    """The kept calls by signature and the replay call that uses them (decode and extend)."""

    _launch: Any  # the last metadata launch (kernel_launch.KernelLaunch)
    _active: Any  # the round's buffers

    def _construct(self, runner, request) -> None:
        self._launch = None
        self._replays: dict = {}  # signature -> Replay
        super()._construct(runner, request)  # type: ignore[misc]

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """As the base class; the kept calls, views of the old buffers, are dropped."""
        self._replays.clear()
        super().init_cuda_graph_state(max_bs, max_num_tokens)  # type: ignore[misc]

    def init_forward_metadata_replay_cuda_graph(self, batch, bs: int) -> None:
        """As the base class: one metadata launch. A call whose signature a checked call had
        (``_replay_key``) launches the kept kernel on the new tensors and checks only what
        reads values."""
        key = self._replay_key(batch, bs)
        replay = self._replays.get(key) if key is not None else None
        if replay is None:
            super().init_forward_metadata_replay_cuda_graph(batch, bs)  # type: ignore[misc]
            self._keep_graph_call(key)
            return
        if _validation._scan_values(batch.req_pool_indices, False):  # CPU tensors only
            self._check_kept_call(batch, replay)
        self._check_replay(batch, bs)  # type: ignore[attr-defined]
        self._launch_kept(batch, replay)
        self._launch, self.graph_source, self._active = replay.launch, batch, replay.bufs
        self._resume_plan(replay.plan)

    def _keep_graph_call(self, key: Optional[tuple]) -> None:
        """Keep what the checked graph call of signature ``key`` repeats (``None``: not
        repeatable)."""
        if key is None:
            return
        if len(self._replays) >= MAX_KEPT:
            self._replays.clear()
        fixed, rows = self._kept_views()
        self._replays[key] = Replay(self._launch, fixed, rows, self._kept_plan(), self._active)

    # --- what a backend declares ---------------------------------------------------------

    def _graph_key_extra(self) -> Optional[tuple]:
        """What a kept call depends on beyond the caller's index tensors (e.g. a table the
        launch reads); ``None``: no call is kept (no metadata launch)."""
        return ()

    def _kept_plan(self) -> Any:
        """The round's plan as ``_resume_plan`` restores it."""
        raise NotImplementedError(f"{type(self).__qualname__} keeps no plan")

    def _resume_plan(self, plan: Any) -> None:
        raise NotImplementedError(f"{type(self).__qualname__} keeps no plan")

    def _check_kept_call(self, batch, replay: Replay) -> None:
        """The checks of a kept call, where values are read (CPU tensors)."""
        self._check_graph_batch(batch)  # type: ignore[attr-defined]

    # --- decode / extend -------------------------------------------------------------------

    def _replay_key(self, batch, bs: int) -> Optional[tuple]:
        raise NotImplementedError

    def _kept_views(self) -> tuple:
        """The round's fixed views and rows, as ``_launch_kept`` restores them."""
        raise NotImplementedError

    def _launch_kept(self, batch, replay: Replay) -> None:
        """``replay``'s launch on the batch's index tensors; the kept views restored."""
        raise NotImplementedError


class KeptDecodeCalls(_KeptCalls, DraftDecodeBackend):
    """``DraftDecodeBackend`` with kept graph calls, keyed by the captured size, the caller's
    ``req_pool_indices``, ``seq_lens`` and ``out_cache_loc`` and, in ``path`` mode, the
    captured ``parents``."""

    def _replay_key(self, batch: "DraftBatch", bs: int) -> Optional[tuple]:
        """The signature of a graph call: ``bs``, ``_graph_key_extra()`` and the index
        tensors; in ``path`` mode also ``parents``, which must be the tensor the graph reads.
        ``None`` where the call is not repeated (no call kept, a batch that is not one,
        ``path`` mode without ``parents`` or with ``parents`` copied into the captured
        tensor). ``lane`` mode reads no ``parents``: a batch's are not part of the key."""
        try:
            extra = self._graph_key_extra()
            if extra is None:
                return None
            key = (bs, *extra, signature(batch.req_pool_indices), signature(batch.seq_lens),
                   signature(batch.out_cache_loc))
            if self.tree_mode == "lane":
                return key
            parents = batch.parents
            if parents is None:
                return None
            captured = self._graph.parents.get(bs) if self._graph is not None else None
            if self.tree_mode != "path" or captured is None or \
                    parents.data_ptr() != captured.data_ptr():
                return None
            return key + (signature(parents), parents.data_ptr())
        except (AttributeError, TypeError):
            return None

    def init_forward_metadata_capture_cuda_graph(self, batch: "DraftBatch") -> None:
        """As the base class; keeps the call for the replays at this size (in place of what
        an earlier capture at this size kept: ``parents`` may be another tensor now)."""
        super().init_forward_metadata_capture_cuda_graph(batch)
        bs = self.batch.batch_size
        self._replays = {k: r for k, r in self._replays.items() if k[0] != bs}
        self._keep_graph_call(self._replay_key(batch, bs))

    def _kept_views(self) -> tuple:
        return self.batch, self.num_lanes

    def _launch_kept(self, batch: "DraftBatch", replay: Replay) -> None:
        replay.launch(batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc)
        self.batch, self.num_lanes = replay.fixed, replay.rows
        self._parents_copied = None  # a kept path-mode call reads the caller's parents


class KeptExtendCalls(_KeptCalls, DraftExtendBackend):
    """``DraftExtendBackend`` with kept graph calls, keyed by the caller's four index tensors
    (a replay is not padded: the captured size is not part of the key)."""

    def _replay_key(self, batch: DraftExtendBatch, bs: int) -> Optional[tuple]:
        """The signature of a graph call: ``_graph_key_extra()`` and the index tensors."""
        try:
            extra = self._graph_key_extra()
            if extra is None:
                return None
            return (*extra, signature(batch.req_pool_indices), signature(batch.seq_lens),
                    signature(batch.extend_lens), signature(batch.out_cache_loc))
        except (AttributeError, TypeError):
            return None

    def init_forward_metadata_capture_cuda_graph(self, batch: DraftExtendBatch) -> None:
        """As the base class; keeps the call for the replays."""
        super().init_forward_metadata_capture_cuda_graph(batch)
        self._keep_graph_call(self._replay_key(batch, batch.batch_size))

    def _kept_views(self) -> tuple:
        return self.batch.out_cache_loc, self.num_tokens

    def _launch_kept(self, batch: DraftExtendBatch, replay: Replay) -> None:
        rpi, seq, ext = batch.req_pool_indices, batch.seq_lens, batch.extend_lens
        replay.launch(rpi, seq, ext, batch.out_cache_loc)
        self.batch = DraftExtendBatch(rpi, seq, ext, replay.fixed)
        self.num_tokens = replay.rows
