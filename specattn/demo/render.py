"""Plain-text rendering of draft trees and error summaries (ASCII only, any terminal)."""

from __future__ import annotations

from typing import Optional

from .eagle import TOLERANCES, DraftTree, ErrorMeter

__all__ = ["render_tree", "render_meter", "lane_divergence", "slow_start_note", "LEGEND"]

LEGEND = ("tree: token p=<cumulative score> L<lane>; '*' best path, '+' accepted, "
          "'~' lane history is not the node's ancestry (lane mode)")


def slow_start_note(backends: list, platform) -> str:
    """A line for before the first round when it will be silent for long: Triton kernels
    are interpreted on a CPU (slowly) and compiled on their first call on a GPU; '' when
    no backend of ``backends`` (None: none) runs Triton kernels."""
    if not any(m == "triton" for b in backends if b is not None for m, _ in type(b).requires):
        return ""
    if platform.device == "cpu":
        return ("the Triton kernels run in Triton's interpreter on this CPU "
                "(TRITON_INTERPRET=1): each round takes seconds...")
    return "round 0 compiles the Triton kernels on their first calls (seconds)..."


def _lane_diverges(tree: DraftTree, d: int, b: int, j: int) -> bool:
    """Node ``(d, j)`` was run at step ``d`` and attended to lane ``j``'s slots at steps
    ``0..d-1`` (lane mode): true when those are not the KV of its ancestors."""
    return any(a != j for a in tree.ancestry(d, b, j)[:-1])


def lane_divergence(tree: DraftTree) -> tuple[int, int]:
    """(nodes whose lane-mode history was not their ancestry, nodes that could diverge):
    the forwarded nodes below depth 1, over every request."""
    bsz, k = tree.tokens.shape[1:]
    nodes = [(d, b, j) for d in range(1, tree.depth - 1) for b in range(bsz) for j in range(k)]
    return sum(_lane_diverges(tree, *n) for n in nodes), len(nodes)


def render_tree(tree: DraftTree, b: int, *, tree_mode: str,
                accepted: Optional[int] = None, token_width: int = 3) -> list[str]:
    """Indented tree of request ``b``: root, then each depth's nodes under their parents.

    Only nodes that ran a forward (depths ``1 .. S-1``) can be marked '~'."""
    best = tree.best_path(b)
    head = (f"req {b}: prefix {int(tree.prefix_lens[b])} tokens, root token "
            f"{int(tree.root[b]):>{token_width}}")
    lines = [head]

    def children(d: int, parent: int) -> list[int]:
        if d >= tree.depth:
            return []
        if d == 0:
            return list(range(tree.tokens.shape[2]))
        return [j for j in range(tree.tokens.shape[2]) if int(tree.parents[d, b, j]) == parent]

    def walk(d: int, j: int, indent: str, last: bool, on_best: bool) -> None:
        on_best = on_best and best[d] == j
        marks = ""
        if on_best:
            marks += "*"
            if accepted is not None and d < accepted:
                marks += "+"
        if tree_mode == "lane" and 0 < d < tree.depth - 1 and _lane_diverges(tree, d, b, j):
            marks += "~"
        lines.append(f"{indent}{'`-' if last else '|-'} {int(tree.tokens[d, b, j]):>{token_width}}"
                     f" p={float(tree.scores[d, b, j]):.4f} L{j}" + (f" {marks}" if marks else ""))
        kids = children(d + 1, j)
        for n, c in enumerate(kids):
            walk(d + 1, c, indent + ("   " if last else "|  "), n == len(kids) - 1, on_best)

    roots = children(0, -1)
    for n, j in enumerate(roots):
        walk(0, j, "  ", n == len(roots) - 1, True)
    return lines


def render_meter(meter: ErrorMeter, backend_names: dict[str, str]) -> list[str]:
    """One line per kind: max abs error against torch_ref and the verdict."""
    atol, rtol = TOLERANCES[meter.dtype]
    lines = []
    for kind in ("extend", "decode"):
        name = backend_names.get(kind)
        if name is None or meter.calls[kind] == 0:
            lines.append(f"  {kind}: no {kind} attention calls (no backend needed)")
            continue
        same = " (the reference itself)" if name == "torch_ref" else ""
        verdict = "OK" if not meter.failed[kind] else "MISMATCH"
        lines.append(f"  {kind}: {name}{same} vs torch_ref: max abs error "
                     f"{meter.max_err[kind]:.2e} over {meter.calls[kind]} calls "
                     f"(max |ref| {meter.max_ref[kind]:.2f}; tolerance {atol:g} + "
                     f"{rtol:g}*|ref|): {verdict}")
    return lines
