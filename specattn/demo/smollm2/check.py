"""Compare two speculative generations' draft trees (a backend's against ``torch_ref``'s).

Round by round the trees' tokens and parents must be equal and their scores close. Two
backends may legitimately pick different nodes at a near tie (the chosen cumulative scores
agree, as multisets, within the tolerance); after such a round the runs may diverge, so the
comparison stops there. Used by ``tests/test_smollm2.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .spec import Generation

__all__ = ["TreeComparison", "compare_trees", "TREE_TOLERANCES"]

# (rtol, atol) on the trees' cumulative scores, by draft dtype: fp32 drafts differ only by
# summation order; in half precision one rounding of an attention output moves every later
# layer's bf16 activations, and the scores (products of probabilities) by up to a few
# percent over N layers (1.5e-2 absolute seen with 2 bf16 layers under Triton's interpreter).
TREE_TOLERANCES = {torch.float32: (1e-4, 1e-6), torch.float16: (3e-2, 5e-3),
                   torch.bfloat16: (1e-1, 2e-2)}


@dataclass
class TreeComparison:
    """rounds: rounds equal to the reference before the first difference (all if none);
    total: rounds of the reference; outputs_equal: same generated tokens;
    first_diff: where and how the first differing round differs (None if none);
    near_tie: that difference is a near tie; scores_close: every equal round's scores
    agree within the tolerance (max_score_diff: the largest absolute difference)."""

    rounds: int
    total: int
    outputs_equal: bool
    first_diff: Optional[str] = None
    near_tie: bool = True
    scores_close: bool = True
    max_score_diff: float = 0.0

    @property
    def ok(self) -> bool:
        return self.outputs_equal and self.near_tie and self.scores_close

    def describe(self) -> str:
        if not self.outputs_equal:
            return "generated tokens differ from the reference's"
        if not self.scores_close:
            return f"scores differ by up to {self.max_score_diff:.2e} in equal trees"
        if self.first_diff is None:
            return f"all {self.total} rounds equal (max score diff {self.max_score_diff:.1e})"
        kind = "near tie" if self.near_tie else "NOT a near tie"
        return (f"{self.rounds}/{self.total} rounds equal (max score diff "
                f"{self.max_score_diff:.1e}), then {kind}: {self.first_diff}")


def _same_choice(ref: torch.Tensor, got: torch.Tensor, rtol: float, atol: float) -> bool:
    """ref, got: [K] chosen scores at one depth: equal as multisets within tolerance."""
    return bool(torch.allclose(ref.sort().values, got.sort().values, rtol=rtol, atol=atol))


def compare_trees(ref: Generation, got: Generation, *,
                  dtype: torch.dtype = torch.float32) -> TreeComparison:
    """Compare ``got``'s draft trees with ``ref``'s (same prompts, config and draft dtype
    ``dtype``, which sets the tolerance)."""
    rtol, atol = TREE_TOLERANCES[dtype]
    cmp = TreeComparison(0, len(ref.trees), got.tokens == ref.tokens)
    for r, (a, g) in enumerate(zip(ref.trees, got.trees)):
        if not (torch.equal(a.root, g.root) and torch.equal(a.prefix_lens, g.prefix_lens)):
            cmp.first_diff, cmp.near_tie = f"round {r}: different roots or prefix lengths", False
            return cmp
        diff = (a.tokens != g.tokens) | (a.parents != g.parents)
        if diff.any():
            d, b, _ = (int(x) for x in diff.nonzero()[0])
            cmp.near_tie = _same_choice(a.scores[d, b], g.scores[d, b], rtol, atol)
            cmp.first_diff = (f"round {r}, depth {d + 1}, request {b}: tokens "
                              f"{g.tokens[d, b].tolist()} parents {g.parents[d, b].tolist()} "
                              f"scores {[f'{x:.4g}' for x in g.scores[d, b].tolist()]} vs "
                              f"reference {a.tokens[d, b].tolist()} {a.parents[d, b].tolist()} "
                              f"{[f'{x:.4g}' for x in a.scores[d, b].tolist()]}")
            return cmp
        cmp.max_score_diff = max(cmp.max_score_diff, float((g.scores - a.scores).abs().max()))
        if not torch.allclose(g.scores, a.scores, rtol=rtol, atol=atol):
            cmp.scores_close = False
        cmp.rounds = r + 1
    if len(got.trees) != len(ref.trees):
        cmp.first_diff = f"{len(got.trees)} rounds vs the reference's {len(ref.trees)}"
        cmp.near_tie = False
    return cmp
