"""The draft-extend glue shared by the MHA and MLA flavours.

One causal pass over ragged requests: ``qo_indptr = cumsum(E)``, ``kv_indptr = cumsum(L')``,
slots ``R_b[0 : L'_b]`` (the new tokens' KV is written first, so FlashInfer's bottom-right
causal alignment gives query ``t`` the keys ``R_b[0 : L'_b - E_b + t + 1]``).

Plan step (``init_forward_metadata``): one host copy (``seq_lens`` and ``extend_lens``
together), slot list built on the device, one plan. Run step (``forward``): write K/V, run.
CUDA graphs are not offered for extend (the base class's eager defaults apply).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...base import DraftExtendBackend
from ...validation import check_extend_batch, check_extend_forward
from ._passes import Params, Pass
from ._slots import fill_ragged_slots, host_indptr


class FlashInferExtendGlue(DraftExtendBackend):
    """Common body of ``FlashInferExtend`` and ``FlashInferMLAExtend`` (not registered)."""

    def __init__(self, runner, *, topk: int = 1, num_steps: int = 1) -> None:
        super().__init__(runner, topk=topk, num_steps=num_steps)
        self.params = self._default_params()
        self._pass: Optional[Pass] = None
        self._loc: Optional[torch.Tensor] = None
        self._num_tokens: Optional[int] = None

    def _default_params(self) -> Params:
        raise NotImplementedError

    def _check_layer_params(self, layer) -> Params:
        return Params(float(layer.scaling), float(layer.logit_cap))

    def _new_pass(self) -> Pass:
        raise NotImplementedError

    def init_forward_metadata(self, batch) -> None:
        check_extend_batch(self.runner, batch)
        if self._pass is None:
            self._pass = self._new_pass()
        lens = torch.stack([batch.seq_lens.to(torch.int64),
                            batch.extend_lens.to(torch.int64)]).cpu()  # one host copy
        seq_host, ext_host = lens[0], lens[1]
        total = int(seq_host.sum())
        fill_ragged_slots(self._pass.reserve(total), total, self.runner.req_to_token,
                          batch.req_pool_indices, batch.seq_lens)
        self._pass.plan(host_indptr(ext_host), host_indptr(seq_host), total, True, self.params)
        self._loc = batch.out_cache_loc
        self._num_tokens = int(ext_host.sum())

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor,
                v: Optional[torch.Tensor]) -> torch.Tensor:
        if self._pass is None or self._loc is None:
            raise RuntimeError(f"{type(self).name}: forward() called before "
                               "init_forward_metadata()")
        check_extend_forward(self.runner, self._num_tokens, layer, q, k, v)
        want = self._check_layer_params(layer)
        if want != self.params:
            self.params = want
            self._pass.replan(want)
        self.runner.write_kv(layer.layer_id, self._loc, k, v)
        q = q if q.is_contiguous() else q.contiguous()
        o, _ = self._pass.run(q, layer.layer_id)
        return o
