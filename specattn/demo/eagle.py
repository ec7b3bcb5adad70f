"""EAGLE draft rounds driven through specattn backends, with tree bookkeeping.

One round, as an EAGLE worker runs it (``reference/upstream-draft-backends.md`` C.3, D.4, E):

1. draft extend: the newly committed tokens (the prompt in round 0, then the accepted
   drafts plus the bonus token) run causally over the paged prefix; the last token's
   logits give ``topk_p, topk_index`` and its hidden state seeds the draft;
2. draft decode: ``S`` top-k selections (``select_top_k_tokens``) and ``S - 1`` forwards
   through the multi-step decode backend. Step 0 takes the top-``K`` of the extend output;
   step ``i > 0`` expands the scores ``K * K`` ways, keeps the best ``K`` and feeds lane
   ``j`` the hidden state of its parent lane ``index // K``. In ``path`` tree mode the
   parents row is written into ``batch.parents[i]`` in place before step ``i`` runs;
3. verification is simulated (random weights, no target model): a seeded number of tokens
   of the best path is accepted and a random bonus token appended.

Positions are plain token indices: the draft token at depth ``d`` (1-based) of a request
with ``L`` committed tokens sits at position ``L + d - 1``, the index of its KV entry in the
lane's list (upstream's draft decode uses one more; the demo has no target to stay
consistent with).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..base import DraftDecodeBackend, DraftExtendBackend
from ..data import AttentionLayer, DraftBatch, DraftExtendBatch, DraftRunner
from .model import Attend, DraftModel

__all__ = ["DraftTree", "ErrorMeter", "EagleDrafter", "TOLERANCES"]

# (atol, rtol) for comparing a backend with torch_ref, per activation dtype.
TOLERANCES = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3),
              torch.float32: (1e-5, 1e-5)}


@dataclass
class DraftTree:
    """One round's draft tree for ``B`` requests, ``K`` tokens per depth, on the CPU.

    root: ``[B]`` the last committed token of each request (the tree's root).
    prefix_lens: ``[B]`` committed KV length ``L_b`` during the round.
    tokens: ``[S, B, K]`` token of lane ``j`` at depth ``d + 1``.
    parents: ``[S, B, K]`` lane at depth ``d`` holding the parent (``-1`` at depth 1: root).
    scores: ``[S, B, K]`` cumulative score (product of the draft probabilities on the path).
    """

    root: torch.Tensor
    prefix_lens: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor

    @property
    def depth(self) -> int:
        return int(self.tokens.shape[0])

    def best_path(self, b: int) -> list[int]:
        """Lanes, depth 1 first, of the highest-scoring deepest node of request ``b``."""
        lane = int(self.scores[-1, b].argmax())
        lanes = [lane]
        for d in range(self.depth - 1, 0, -1):
            lane = int(self.parents[d, b, lane])
            lanes.append(lane)
        return lanes[::-1]

    def ancestry(self, d: int, b: int, j: int) -> list[int]:
        """Lanes of the ancestors of node ``(d, j)``, depth 1 first, the node last."""
        lanes = [j]
        for t in range(d, 0, -1):
            lanes.append(int(self.parents[t, b, lanes[-1]]))
        return lanes[::-1]


@dataclass
class ErrorMeter:
    """Max abs difference between a backend's outputs and torch_ref's, per kind."""

    dtype: torch.dtype
    max_err: dict[str, float] = field(default_factory=lambda: {"extend": 0.0, "decode": 0.0})
    max_ref: dict[str, float] = field(default_factory=lambda: {"extend": 0.0, "decode": 0.0})
    calls: dict[str, int] = field(default_factory=lambda: {"extend": 0, "decode": 0})
    failed: dict[str, bool] = field(default_factory=lambda: {"extend": False, "decode": False})

    def update(self, kind: str, out: torch.Tensor, ref: torch.Tensor) -> None:
        atol, rtol = TOLERANCES[self.dtype]
        out32, ref32 = out.float(), ref.float()
        err = (out32 - ref32).abs()
        # Non-finite outputs compare as infinitely wrong.
        err = torch.where(torch.isfinite(out32), err, torch.full_like(err, float("inf")))
        worst = float(err.max()) if err.numel() else 0.0
        bad = bool((err > atol + rtol * ref32.abs()).any())
        self.max_err[kind] = max(self.max_err[kind], worst)
        self.max_ref[kind] = max(self.max_ref[kind],
                                 float(ref32.abs().max()) if ref32.numel() else 0.0)
        self.calls[kind] += 1
        self.failed[kind] = self.failed[kind] or bad

    @property
    def ok(self) -> bool:
        return not any(self.failed.values())


class EagleDrafter:
    """Runs EAGLE rounds for a fixed set of requests through the given backends.

    ``allocator`` is a ``specattn.allocator.PagedKVAllocator`` over ``runner``. ``decode`` is
    ``None`` when ``num_steps == 1`` (no draft forward is needed, only the extend's top-k).
    ``meter``: when given, every attention call is recomputed with torch_ref on the same
    pools right after the backend wrote its KV, and the difference recorded.
    """

    def __init__(self, model: DraftModel, runner: DraftRunner, allocator,
                 extend: DraftExtendBackend, decode: Optional[DraftDecodeBackend], *,
                 topk: int, num_steps: int, tree_mode: str,
                 meter: Optional[ErrorMeter] = None) -> None:
        self.model, self.runner, self.allocator = model, runner, allocator
        self.extend_backend, self.decode_backend = extend, decode
        self.topk, self.num_steps, self.tree_mode = topk, num_steps, tree_mode
        self.meter = meter
        self.reqs: list[int] = []
        # State after the last extend, per request: its top-k and last hidden state.
        self.topk_p: Optional[torch.Tensor] = None      # [B, K]
        self.topk_index: Optional[torch.Tensor] = None  # [B, K]
        self.hidden: Optional[torch.Tensor] = None      # [B, hidden]
        self.last_token: Optional[torch.Tensor] = None  # [B]

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _checked(self, kind: str, run: Attend,
                 reference: Callable[[AttentionLayer, torch.Tensor], torch.Tensor]) -> Attend:
        if self.meter is None:
            return run

        def attend(layer, q, k, v):
            out = run(layer, q, k, v)  # writes k/v first, so the reference sees them too
            self.meter.update(kind, out, reference(layer, q))
            return out
        return attend

    # --- draft extend ----------------------------------------------------------------------

    def add_requests(self, prompts: list[torch.Tensor]) -> None:
        """Open one request per prompt (``[L_b]`` int tokens) and prefill it."""
        self.reqs = [self.allocator.new_request() for _ in prompts]
        self.extend(prompts)

    def extend(self, new_tokens: list[torch.Tensor]) -> None:
        """Draft extend: ``new_tokens[b]`` (``[E_b]``) appended to request ``b``'s KV."""
        from ..backends.torch_ref import reference_extend

        lens = [int(t.numel()) for t in new_tokens]
        slots = [self.allocator.extend(r, n) for r, n in zip(self.reqs, lens)]
        seq_lens = [self.allocator.seq_len(r) for r in self.reqs]
        batch = DraftExtendBatch(self._index(self.reqs), self._index(seq_lens),
                                 self._index(lens),
                                 torch.cat(slots).to(device=self.device, dtype=torch.int64))
        ids = torch.cat(new_tokens).to(self.device)
        positions = torch.cat([torch.arange(s - n, s, device=self.device)
                               for s, n in zip(seq_lens, lens)])
        self.extend_backend.init_forward_metadata(batch)
        attend = self._checked("extend", self.extend_backend.forward,
                               lambda layer, q: reference_extend(self.runner, layer, q, batch))
        logits, hidden = self.model(ids, positions, None, attend)
        last = torch.cumsum(self._index(lens), 0) - 1
        probs = torch.softmax(logits[last], dim=-1)
        self.topk_p, self.topk_index = probs.topk(self.topk, dim=-1)
        self.hidden = hidden[last]
        self.last_token = ids[last]

    # --- draft decode ----------------------------------------------------------------------

    def draft(self) -> DraftTree:
        """One multi-step draft round over every request; returns its tree."""
        from ..backends.torch_ref import reference_decode

        bsz, k, s, dev = len(self.reqs), self.topk, self.num_steps, self.device
        rpi = self._index(self.reqs)
        prefix = self._index([self.allocator.seq_len(r) for r in self.reqs])
        tokens = torch.empty(s, bsz, k, dtype=torch.int64, device=dev)
        parents = torch.full((s, bsz, k), -1, dtype=torch.int64, device=dev)
        scores = torch.empty(s, bsz, k, dtype=torch.float32, device=dev)

        batch = None
        if self.decode_backend is not None:
            out_cache_loc = self.allocator.alloc_draft(rpi, k, s)  # [B, K, S]
            # One parents tensor for the whole round, rows filled in place as steps go.
            tree_parents = (torch.zeros(s, bsz, k, dtype=torch.int64, device=dev)
                            if self.tree_mode == "path" else None)
            batch = DraftBatch(rpi, prefix, out_cache_loc, tree_parents)
            self.decode_backend.init_forward_metadata(batch)

        topk_p, topk_index, hidden, score = self.topk_p, self.topk_index, self.hidden, None
        lane_base = (torch.arange(bsz, device=dev) * k)[:, None]
        try:
            for i in range(s):
                if i == 0:
                    ids, score = topk_index, topk_p                      # [B, K]
                    hidden = hidden.repeat_interleave(k, dim=0)           # [B*K, hidden]
                else:
                    expand = score[:, :, None] * topk_p.view(bsz, k, k)  # [B, K, K]
                    score, cs_index = expand.view(bsz, k * k).topk(k, dim=-1)
                    ids = topk_index.view(bsz, k * k).gather(1, cs_index)
                    parents[i] = cs_index // k
                    hidden = hidden[(parents[i] + lane_base).reshape(-1)]
                tokens[i], scores[i] = ids, score
                if i == s - 1:
                    break  # the last depth's tokens need no forward
                if batch is not None and batch.parents is not None and i > 0:
                    batch.parents[i].copy_(parents[i])
                positions = (prefix[:, None] + i).expand(bsz, k).reshape(-1)
                attend = self._checked(
                    "decode",
                    lambda layer, q, kk, v, _i=i: self.decode_backend.forward(_i, layer, q, kk, v),
                    lambda layer, q, _i=i: reference_decode(self.runner, layer, q, batch, _i,
                                                            self.tree_mode))
                logits, hidden = self.model(ids.reshape(-1), positions, hidden, attend)
                topk_p, topk_index = torch.softmax(logits, dim=-1).topk(k, dim=-1)  # [B*K, K]
        finally:
            if batch is not None:
                self.allocator.release_draft()
        return DraftTree(self.last_token.cpu(), prefix.cpu(), tokens.cpu(), parents.cpu(),
                         scores.cpu())

    # --- simulated verification ------------------------------------------------------------

    def simulate_acceptance(self, tree: DraftTree, gen: torch.Generator,
                            ) -> tuple[list[int], list[torch.Tensor]]:
        """Accept a seeded number of the best path's tokens plus a random bonus token.

        Returns the accept counts and, per request, the tokens to extend next
        (``[accepted + 1]``)."""
        counts, new_tokens = [], []
        vocab = self.model.cfg.vocab_size
        for b in range(len(self.reqs)):
            lanes = tree.best_path(b)
            n = int(torch.randint(0, tree.depth + 1, (1,), generator=gen))
            path = [int(tree.tokens[d, b, lanes[d]]) for d in range(n)]
            bonus = int(torch.randint(0, vocab, (1,), generator=gen))
            counts.append(n)
            new_tokens.append(torch.tensor(path + [bonus], dtype=torch.int64))
        return counts, new_tokens
