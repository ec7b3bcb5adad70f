"""Self-speculative greedy decoding: an early-exit draft through specattn, a tree-verifying
target in plain torch.

One round, for ``B`` requests whose committed tokens end with a root token (the last bonus
token, or the prompt's last token), whose KV the target does not have yet:

1. draft (``EagleDrafter`` of the synthetic demo, over the first ``N`` layers + final norm +
   LM head): draft extend of the newly committed tokens, then ``S`` top-``K`` steps
   (``S - 1`` draft-decode forwards through the specattn backend, ``lane`` or ``path`` mode);
2. verify: one target forward over ``1 + S*K`` rows per request (root, then the tree
   depth-major: row ``1 + d*K + j`` is lane ``j`` at depth ``d + 1``), each row seeing the
   committed prefix, its ancestors and itself (the tree's true parents, whatever the
   draft's tree mode attended to);
3. accept greedily: from the root, follow the child whose token is the target's argmax
   while there is one; the target's argmax at the last accepted row is the bonus token. The
   root's and accepted rows' target KV is committed; the accepted tokens and the bonus are
   the draft's next extend.

The output is the target's greedy continuation, token for token (the draft only decides how
many tokens one target forward yields). ``greedy_generate`` is the plain reference: one
target row per request and step, through the same ``TargetCache.forward_rows``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ...base import DraftDecodeBackend, DraftExtendBackend
from ...data import DraftRunner
from ..eagle import DraftTree, EagleDrafter
from .llama import Llama
from .target import TargetCache

__all__ = ["EarlyExitDraft", "Generation", "SelfSpeculativeDecoder", "greedy_generate",
           "tree_rows", "make_draft_runner", "context_budget"]


class EarlyExitDraft:
    """The draft as ``EagleDrafter`` calls it: the first ``num_layers`` layers of ``model``,
    then the final norm and LM head. ``hidden_in`` (EAGLE's feature input) is unused."""

    def __init__(self, model: Llama, num_layers: int) -> None:
        if not 1 <= num_layers <= model.cfg.num_layers:
            raise ValueError(f"draft layers must be in [1, {model.cfg.num_layers}], "
                             f"got {num_layers}")
        self.model, self.num_layers, self.cfg = model, num_layers, model.cfg

    def __call__(self, ids, positions, hidden_in, attend):
        logits, hidden = self.model.forward(ids, positions, attend, self.num_layers)
        return logits.float(), hidden


@dataclass
class Generation:
    """Result of one generation over ``B`` prompts.

    tokens[b]: new tokens of request ``b`` (at most ``max_new_tokens``, cut after a stop id).
    accepted: per round, per request still generating, the accepted draft tokens.
    trees: the draft tree of every round (empty for plain greedy).
    min_margin: smallest float64 gap between the target's best and second-best logit over
        the tokens kept (how far from a tie every greedy choice was).
    """

    tokens: list[list[int]]
    seconds: float
    target_forwards: int
    accepted: list[list[int]] = field(default_factory=list)
    trees: list[DraftTree] = field(default_factory=list)
    min_margin: float = math.inf

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else math.inf

    @property
    def mean_accepted(self) -> float:
        """Mean accepted draft tokens per round and request (the bonus token not counted)."""
        flat = [a for r in self.accepted for a in r]
        return sum(flat) / len(flat) if flat else 0.0


def context_budget(prompt_lens: Sequence[int], max_new_tokens: int, num_steps: int) -> int:
    """Longest committed length a request can reach: a finished request keeps running (up to
    ``S + 1`` tokens a round) until the last one finishes, at most ``max_new_tokens``
    rounds."""
    return max(prompt_lens) + max_new_tokens * (num_steps + 1) + num_steps + 2


def make_draft_runner(model: Llama, num_layers: int, batch: int, context: int, *,
                      topk: int, num_steps: int, page_size: int) -> DraftRunner:
    """Paged pools for the draft's ``num_layers`` layers, in the draft model's dtype and on its
    device: every request's ``context`` tokens plus one round of drafts (with ``P > 1`` and
    ``K > 1`` each branch gets its own pages)."""
    cfg, p = model.cfg, page_size
    draft_room = topk * (math.ceil((p - 1 + num_steps) / p) + 1) * p
    max_ctx = context + draft_room
    pages_per_req = math.ceil(max_ctx / p) + 1
    return DraftRunner.mha(cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim,
                           num_layers=num_layers, num_slots=(batch * pages_per_req + 2) * p,
                           max_reqs=batch + 1, max_context_len=max_ctx, page_size=p,
                           dtype=model.dtype, device=model.device)


def tree_rows(tree: DraftTree, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Request ``b``'s verification rows: ``ids [T]``, ``depths [T]``, ``visible [T, T]``.

    ``T = 1 + S*K``: the root, then lane ``j`` at depth ``d + 1`` in row ``1 + d*K + j``;
    ``visible[r, c]``: row ``c`` is ``r`` itself or one of its ancestors (the root included).
    """
    s, _, k = tree.tokens.shape
    t = 1 + s * k
    ids = torch.cat([tree.root[b:b + 1], tree.tokens[:, b].reshape(-1)])
    depths = torch.cat([torch.zeros(1, dtype=torch.long),
                        torch.arange(1, s + 1).repeat_interleave(k)])
    visible = torch.eye(t, dtype=torch.bool)
    visible[1:k + 1, 0] = True
    for d in range(1, s):
        for j in range(k):
            row, parent = 1 + d * k + j, 1 + (d - 1) * k + int(tree.parents[d, b, j])
            visible[row] |= visible[parent]
    return ids.long(), depths, visible


def _accept(tree: DraftTree, b: int, pred: torch.Tensor) -> tuple[list[int], list[int], int]:
    """Greedy walk down request ``b``'s tree. pred: ``[T]`` the target's argmax per row.

    Returns (accepted rows, accepted tokens, bonus token)."""
    s, _, k = tree.tokens.shape
    rows, toks, cur, lane = [], [], 0, -1
    for d in range(s):
        want = int(pred[cur])
        hit = next((j for j in range(k) if int(tree.tokens[d, b, j]) == want
                    and (d == 0 or int(tree.parents[d, b, j]) == lane)), None)
        if hit is None:
            break
        lane, cur = hit, 1 + d * k + hit
        rows.append(cur)
        toks.append(want)
    return rows, toks, int(pred[cur])


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock times cover it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _margins(logits: torch.Tensor) -> torch.Tensor:
    """logits: [T, vocab] -> [T] gap between the best and second-best logit."""
    top2 = logits.topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


class _Outputs:
    """New tokens per request, cut at ``max_new`` or after a stop id."""

    def __init__(self, batch: int, max_new: int, stop_ids: Sequence[int]) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.max_new, self.stop = max_new, set(stop_ids)
        self.min_margin = math.inf

    def done(self, b: int) -> bool:
        t = self.tokens[b]
        return len(t) >= self.max_new or (bool(t) and t[-1] in self.stop)

    @property
    def all_done(self) -> bool:
        return all(self.done(b) for b in range(len(self.tokens)))

    def add(self, b: int, toks: list[int], margins: list[float]) -> None:
        for tok, margin in zip(toks, margins):
            if self.done(b):
                return
            self.tokens[b].append(tok)
            self.min_margin = min(self.min_margin, margin)


@torch.inference_mode()
def greedy_generate(target: Llama, prompts: list[torch.Tensor], max_new_tokens: int,
                    stop_ids: Sequence[int] = (),
                    on_step: Optional[Callable[[int], None]] = None) -> Generation:
    """Plain greedy decoding of the target: one row per request per forward.

    on_step(forwards): called after each forward (a progress bar)."""
    _sync(target.device)
    t0 = time.perf_counter()
    cache = TargetCache(target, len(prompts), max(int(p.numel()) for p in prompts)
                        + max_new_tokens + 1)
    cache.prefill(prompts)
    roots = [int(p[-1]) for p in prompts]
    out = _Outputs(len(prompts), max_new_tokens, stop_ids)
    forwards = 0
    one, seen = torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)
    while not out.all_done:
        logits = cache.forward_rows([torch.tensor([r]) for r in roots], [one] * len(roots),
                                    [seen] * len(roots))
        forwards += 1
        for b, lg in enumerate(logits):
            cache.commit(b, [0])
            roots[b] = int(lg[0].argmax())
            out.add(b, [roots[b]], [float(_margins(lg)[0])])
        if on_step is not None:
            on_step(forwards)
    _sync(target.device)
    return Generation(out.tokens, time.perf_counter() - t0, forwards, min_margin=out.min_margin)


class SelfSpeculativeDecoder:
    """Greedy self-speculative decoding of ``target``; the draft is ``draft``'s first
    ``draft_layers`` layers, its attention through the given specattn backends over
    ``runner``'s paged pools (``make_draft_runner``).

    ``draft`` and ``target`` may be the same ``Llama`` or, as the demo does, two copies of
    the same weights in different dtypes (fp32 draft, fp64 target).
    """

    def __init__(self, draft: Llama, target: Llama, draft_layers: int, runner: DraftRunner,
                 extend: DraftExtendBackend, decode: Optional[DraftDecodeBackend], *,
                 topk: int, num_steps: int, tree_mode: str) -> None:
        self.draft = EarlyExitDraft(draft, draft_layers)
        self.target, self.runner = target, runner
        self.extend_backend, self.decode_backend = extend, decode
        self.topk, self.num_steps, self.tree_mode = topk, num_steps, tree_mode

    @torch.inference_mode()
    def generate(self, prompts: list[torch.Tensor], max_new_tokens: int,
                 stop_ids: Sequence[int] = (),
                 on_round: Optional[Callable[[int, "Generation"], None]] = None) -> Generation:
        """Generate up to ``max_new_tokens`` per prompt (``[L_b]`` int tokens, ``L_b >= 1``).

        Requests that are done keep running until every request is (a fixed batch), but
        their tokens and acceptance are no longer recorded. on_round(round, generation):
        called after each round's acceptance, with the tokens so far (live output)."""
        from ...allocator import PagedKVAllocator

        _sync(self.target.device)
        t0 = time.perf_counter()
        bsz = len(prompts)
        context = context_budget([int(p.numel()) for p in prompts], max_new_tokens,
                                 self.num_steps)
        cache = TargetCache(self.target, bsz, context)
        drafter = EagleDrafter(self.draft, self.runner, PagedKVAllocator(self.runner),
                               self.extend_backend, self.decode_backend, topk=self.topk,
                               num_steps=self.num_steps, tree_mode=self.tree_mode)
        drafter.add_requests([p.long() for p in prompts])
        cache.prefill(prompts)
        out = _Outputs(bsz, max_new_tokens, stop_ids)
        gen = Generation(out.tokens, 0.0, 0)
        while not out.all_done:
            tree = drafter.draft()
            rows = [tree_rows(tree, b) for b in range(bsz)]
            logits = cache.forward_rows(*map(list, zip(*rows)))
            gen.target_forwards += 1
            new_tokens, accepted = [], []
            for b, lg in enumerate(logits):
                # On the host: the walk below reads them element by element.
                pred, margins = lg.argmax(dim=-1).cpu(), _margins(lg).cpu()
                acc_rows, acc_toks, bonus = _accept(tree, b, pred)
                cache.commit(b, [0] + acc_rows)
                if not out.done(b):
                    accepted.append(len(acc_rows))
                # The margin of a kept token is that of the row whose argmax chose it.
                chosen = [0] + acc_rows
                out.add(b, acc_toks + [bonus], [float(margins[r]) for r in chosen])
                new_tokens.append(torch.tensor(acc_toks + [bonus], dtype=torch.long))
            gen.accepted.append(accepted)
            gen.trees.append(tree)
            if on_round is not None:
                gen.seconds = time.perf_counter() - t0
                on_round(gen.target_forwards - 1, gen)
            if not out.all_done:
                drafter.extend(new_tokens)
        _sync(self.target.device)
        gen.seconds = time.perf_counter() - t0
        gen.min_margin = out.min_margin
        return gen
