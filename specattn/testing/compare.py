"""Comparisons that say where and how two results differ.

``output_mismatch`` compares a backend's output with the reference: no non-finite value
(outputs and unread pool slots are poisoned with NaN), every element within ``atol + rtol *
|ref|`` and the whole within a relative error norm (so an output off by a few percent fails
even where single elements stay inside the elementwise bound). ``pool_mismatch`` compares a
pool with the kit's expected pool bit for bit. Both return ``None`` or a sentence naming the
first differing lane (request, branch), head and element, and the error size.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["TOLERANCES", "output_mismatch", "pool_mismatch"]

# dtype: (atol = rtol elementwise, relative error norm ||out - ref|| / ||ref||)
TOLERANCES = {
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (5e-3, 2.5e-3),
    torch.float32: (1e-4, 2e-5),
}


def _row_name(row: int, topk: Optional[int], rows_are: str) -> str:
    if topk is None:
        return f"{rows_are} {row}"
    b, j = divmod(row, topk)
    return f"lane {row} (request {b}, branch {j})"


def output_mismatch(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, *,
                    topk: Optional[int] = None, rows_are: str = "token",
                    free_rows: Optional[torch.Tensor] = None) -> Optional[str]:
    """``out``, ``ref``: ``[rows, heads, dim]``. ``topk``: rows are lanes ``b * topk + j``
    (decode); else rows are ``rows_are`` (extend tokens). ``free_rows [rows]`` bool: rows
    not compared (they attend a non-finite key on purpose)."""
    if tuple(out.shape) != tuple(ref.shape):
        return f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    if out.dtype != ref.dtype:
        return f"output dtype {out.dtype}, expected {ref.dtype}"
    o, r = out.detach().float().cpu().clone(), ref.detach().float().cpu().clone()
    if free_rows is not None:
        o[free_rows.cpu()] = 0.0
        r[free_rows.cpu()] = 0.0
    bad = ~torch.isfinite(o)
    if bad.any():
        row, head, col = (int(i) for i in bad.nonzero()[0])
        return (f"non-finite output ({o[row, head, col].item()}) at "
                f"{_row_name(row, topk, rows_are)}, head {head}, element {col}: "
                f"{int(bad.any(-1).any(-1).sum())} of {o.shape[0]} rows affected (a read of "
                "a slot no query may read, or an output row never written)")
    atol, rel_tol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    err = (o - r).abs()
    over = err > atol + atol * r.abs()
    rel = float(err.norm() / r.norm().clamp_min(1e-30))
    if not over.any() and rel <= rel_tol:
        return None
    if over.any():
        row, head, col = (int(i) for i in over.nonzero()[0])
    else:
        row, head, col = (int(i) for i in (err == err.max()).nonzero()[0])
    rows_off = int(over.any(-1).any(-1).sum())
    return (f"first difference at {_row_name(row, topk, rows_are)}, head {head}, element "
            f"{col}: got {o[row, head, col].item():.6g}, expected "
            f"{r[row, head, col].item():.6g}; max abs error {err.max().item():.3g} "
            f"(elementwise bound {atol:g} + {atol:g}*|ref|), relative error norm {rel:.3g} "
            f"(bound {rel_tol:g}); {rows_off} of {o.shape[0]} rows outside the bound")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A NaN-exact integer view of ``t`` (same bits, comparable with ``==``)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def _poisoned(row: torch.Tensor) -> bool:
    """Still holds the kit's poison: NaN everywhere (float pools), 0xFF bytes (FP8 layouts)."""
    if row.is_floating_point():
        return not bool(torch.isfinite(row.float()).any())
    return bool((row == 255).all())


def pool_mismatch(name: str, got: torch.Tensor, want: torch.Tensor,
                  written: torch.Tensor, exempt: Optional[torch.Tensor] = None
                  ) -> Optional[str]:
    """``got``/``want``: one pool ``[num_slots, ...]``. ``written``: the slots this call had
    to write. ``exempt``: slots whose contents are not checked (the shared padding slot)."""
    same = (_bits(got) == _bits(want)).reshape(got.shape[0], -1).all(-1)
    if exempt is not None and exempt.numel():
        same[exempt.long().to(same.device)] = True
    if bool(same.all()):
        return None
    slots = (~same).nonzero().reshape(-1)
    slot = int(slots[0])
    was_written = bool((written.reshape(-1).long().to(slots.device) == slot).any())
    if not was_written:
        why = ("changed, but no token writes it in this call (a write outside out_cache_loc, "
               "or the new KV written to the wrong slot)")
    elif _poisoned(got[slot]):
        why = "was never written (still poisoned), but a token's new KV belongs there"
    else:
        why = "holds a value different from the new KV written there"
    return f"pool {name}: slot {slot} {why}; {slots.numel()} slot(s) differ"
