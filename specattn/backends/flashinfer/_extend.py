"""The draft-extend glue shared by the MHA and MLA flavours.

One causal pass over ragged requests: ``qo_indptr = cumsum(E)``, ``kv_indptr = cumsum(L')``,
slots ``R_b[0 : L'_b]`` (the new tokens' KV is written first, so FlashInfer's bottom-right
causal alignment gives query ``t`` the keys ``R_b[0 : L'_b - E_b + t + 1]``).

Plan step (``init_forward_metadata``): one host copy (``seq_lens`` and ``extend_lens``
together), slot list built on the device, one plan. Run step (``forward``): write K/V, run.

CUDA graphs: one pass per captured batch size on fixed buffers (slot list for
``bs * max_context_len`` slots, ``max_num_tokens`` new-token slots); capture and replay plan
on the host (outside the graph) like the eager path. FlashInfer's graph-mode plan sizes its
query tile for the worst split of the captured token count (``T - B + 1`` rows in one
request), so any split of those ``T`` tokens over the ``B`` requests replays.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...base import DraftExtendBackend
from ...errors import InvalidInputError
from ...validation import check_extend_batch, check_extend_forward
from ._passes import Params, Pass
from ._slots import fill_ragged_slots, host_indptr


class FlashInferExtendGlue(DraftExtendBackend):
    """Common body of ``FlashInferExtend`` and ``FlashInferMLAExtend`` (not registered)."""

    def __init__(self, runner, *, topk: int = 1, num_steps: int = 1) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self.params = self._default_params()
        self._eager: Optional[Pass] = None
        self._graphs: dict[int, Pass] = {}
        self._graph_loc: Optional[torch.Tensor] = None
        self._pass: Optional[Pass] = None  # the pass forward() runs
        self._loc: Optional[torch.Tensor] = None
        self._num_tokens: Optional[int] = None

    def _default_params(self) -> Params:
        raise NotImplementedError

    def _check_layer_params(self, layer) -> Params:
        return Params(float(layer.scaling), float(layer.logit_cap))

    def _new_pass(self, graph_rows: Optional[int] = None, capacity: int = 0) -> Pass:
        raise NotImplementedError

    def init_forward_metadata(self, batch) -> None:
        check_extend_batch(self.runner, batch)
        if self._eager is None:
            self._eager = self._new_pass()
        self._prepare(self._eager, batch, batch.out_cache_loc)

    def _prepare(self, p: Pass, batch, loc: torch.Tensor) -> None:
        """Slot list on the device, one plan (host). loc: the new tokens' slots ``[T]``."""
        lens = torch.stack([batch.seq_lens.to(torch.int64),
                            batch.extend_lens.to(torch.int64)]).cpu()  # one host copy
        seq_host, ext_host = lens[0], lens[1]
        total = int(seq_host.sum())
        fill_ragged_slots(p.reserve(total), total, self.runner.req_to_token,
                          batch.req_pool_indices, batch.seq_lens)
        p.plan(host_indptr(ext_host), host_indptr(seq_host), total, True, self.params)
        self._pass, self._loc = p, loc
        self._num_tokens = int(ext_host.sum())

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        self._require_metadata(None if self._loc is None else self._pass)
        check_extend_forward(self.runner, self._num_tokens, layer, q, k, v)
        want = self._check_layer_params(layer)
        if want != self.params:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise InvalidInputError(
                    "layer", f"scaling={self.params.scale} and logit_cap={self.params.cap} "
                    "under CUDA graph capture (FlashInfer plans them; run one eager batch or "
                    "the warm-up first)", f"scaling={want.scale}, logit_cap={want.cap}")
            self.params = want
            self._pass.replan(want)
        self.runner.write_kv(layer.layer_id, self._loc, k, v)
        q = q if q.is_contiguous() else q.contiguous()
        o, _ = self._pass.run(q, layer.layer_id)
        return o

    # --- CUDA graphs -------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Fixed buffers for up to ``max_bs`` requests and ``max_num_tokens`` new tokens."""
        if not isinstance(max_bs, int) or max_bs < 1:
            raise InvalidInputError("max_bs", "an int >= 1", repr(max_bs))
        if not isinstance(max_num_tokens, int) or max_num_tokens < max_bs:
            raise InvalidInputError("max_num_tokens", f"an int >= max_bs={max_bs}",
                                    repr(max_num_tokens))
        self.cuda_graph_max_bs = max_bs
        self._graph_loc = torch.zeros(max_num_tokens, dtype=torch.int64,
                                      device=self.runner.device)
        self._graphs.clear()

    def _graph_prepare(self, batch, *, capture: bool) -> None:
        self._check_graph_batch(batch, ready=self._graph_loc is not None)
        bs, tokens = batch.batch_size, int(batch.out_cache_loc.shape[0])
        if bs > self.cuda_graph_max_bs or tokens > self._graph_loc.numel():
            raise InvalidInputError("batch", f"at most {self.cuda_graph_max_bs} requests and "
                                    f"{self._graph_loc.numel()} tokens (init_cuda_graph_state)",
                                    f"{bs} requests, {tokens} tokens")
        p = self._graphs.get(bs)
        if p is None:
            if not capture:
                raise InvalidInputError("batch size", f"a captured one {sorted(self._graphs)}",
                                        bs)
            p = self._graphs[bs] = self._new_pass(bs, bs * self.runner.max_context_len)
        loc = self._graph_loc[:tokens]
        loc.copy_(batch.out_cache_loc)
        self._prepare(p, batch, loc)

    def init_forward_metadata_capture_cuda_graph(self, batch) -> None:
        self._graph_prepare(batch, capture=True)

    def init_forward_metadata_replay_cuda_graph(self, batch, bs: int) -> None:
        self._graph_prepare(batch, capture=False)
