"""Test helpers shared by the kernel test files (``test_triton``, ``test_dsa``, ``test_dsv4``)
and the stand-in glue tests (``test_aiter``, ``test_ascend``).

- ``require_triton_interpret()``: skip the calling module without Triton, or on a machine
  with neither a GPU nor ``TRITON_INTERPRET=1`` (conftest sets it on CPU-only machines).
- ``close(out, ref, dtype)``: no NaN in ``out``, then ``out ~ ref`` within ``TOL[dtype]``.
- ``randomize_pools``, ``place_decode_round``, ``place_extend_round``: fresh random pools and
  rounds laid out through ``metadata`` (random request rows and slots).
- ``random_qkv(runner, n, gen)``: one forward's ``q, k, v`` for the runner's model.
"""

from __future__ import annotations

import os
from typing import Optional

import pytest
import torch

from specattn import metadata
from specattn.data import DraftBatch, DraftExtendBatch, DraftRunner

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def require_triton_interpret() -> None:
    """Call at module level, before importing a Triton backend."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 without a GPU",  # pragma: no cover
                    allow_module_level=True)


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
          nan_message: str = "NaN in the output") -> None:
    """``out`` has no NaN (outputs and scratch are poisoned) and matches ``ref``."""
    assert not torch.isnan(out).any(), nan_message
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def randomize_pools(runner: DraftRunner) -> DraftRunner:
    """Fill every KV pool of ``runner`` with standard-normal values in its dtype."""
    pools = runner.kv_buffer if runner.use_mla_backend else runner.k_buffer + runner.v_buffer
    for p in pools:
        p.copy_(torch.randn(p.shape, device=DEV).to(p.dtype))
    return runner


def decode_sizes(seq_lens: list[int], topk: int, steps: int, page: int) -> tuple[int, int]:
    """``(num_slots, max_context_len)`` that hold ``seq_lens`` plus a draft round."""
    extra = metadata.max_draft_extend_len(topk, steps, page)
    return sum(seq_lens) + len(seq_lens) * extra + 8, max(seq_lens) + extra + page


def place_decode_round(runner: DraftRunner, seq_lens: list[int], topk: int, steps: int,
                       page: int, tree_mode: str = "lane") -> DraftBatch:
    """Random request rows (of ``runner.max_reqs``) and distinct random slots for the
    prefixes; draft slots from ``metadata.assign_draft_cache_locs``; zero ``parents`` in
    ``path`` mode (tests fill step ``i > 0`` in place)."""
    bs = len(seq_lens)
    seq = torch.tensor(seq_lens, dtype=torch.int64, device=DEV)
    rpi = torch.randperm(runner.max_reqs, device=DEV)[:bs]
    perm = torch.randperm(runner.num_slots, device=DEV).to(torch.int32)
    used = 0
    for b, L in enumerate(seq_lens):
        runner.req_to_token[rpi[b], :L] = perm[used:used + L]
        used += L
    n_new = int(metadata.draft_extend_lens(seq, topk, steps, page).sum())
    loc = metadata.assign_draft_cache_locs(runner.req_to_token, rpi, seq,
                                           perm[used:used + n_new].long(), topk, steps, page)
    parents = (torch.zeros(steps, bs, topk, dtype=torch.int64, device=DEV)
               if tree_mode == "path" else None)
    return DraftBatch(rpi, seq, loc, parents)


def place_extend_round(runner: DraftRunner, seq_lens: list[int],
                       ext_lens: list[int]) -> DraftExtendBatch:
    """Random request rows and distinct random slots; the new tokens are ``R_b[L - E : L]``."""
    bs = len(seq_lens)
    rpi = torch.randperm(runner.max_reqs, device=DEV)[:bs]
    perm = torch.randperm(runner.num_slots, device=DEV).to(torch.int32)
    used, new = 0, []
    for b, (L, E) in enumerate(zip(seq_lens, ext_lens)):
        runner.req_to_token[rpi[b], :L] = perm[used:used + L]
        new.append(perm[used + L - E:used + L].long())
        used += L
    return DraftExtendBatch(rpi, torch.tensor(seq_lens, device=DEV),
                            torch.tensor(ext_lens, device=DEV), torch.cat(new))


def random_qkv(runner: DraftRunner, n: int, gen: Optional[torch.Generator] = None):
    """``q, k, v`` for ``n`` rows on the CPU (stand-in tests); keys scaled by 0.5.
    MHA: ``[n, H_q, D]``, ``[n, H_kv, D]``, ``[n, H_kv, D_v]``; MLA: ``[n, H, R + rope]``,
    ``[n, R + rope]``, ``None``."""
    dt = runner.dtype
    if runner.use_mla_backend:
        w = runner.kv_lora_rank + runner.qk_rope_head_dim
        return (torch.randn(n, runner.num_heads, w, generator=gen).to(dt),
                (torch.randn(n, w, generator=gen) * 0.5).to(dt), None)
    return (torch.randn(n, runner.num_q_heads, runner.head_dim, generator=gen).to(dt),
            (torch.randn(n, runner.num_kv_heads, runner.head_dim, generator=gen) * .5).to(dt),
            torch.randn(n, runner.num_kv_heads, runner.v_head_dim, generator=gen).to(dt))
