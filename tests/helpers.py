"""Test helpers shared by the kernel test files (``test_triton``, ``test_dsa``, ``test_dsv4``),
the stand-in glue tests (``test_aiter``, ``test_ascend``, ``test_trtllm``) and the case
builders of ``test_flash_attn`` / ``test_flashinfer`` (also used by their GPU tests).

- ``require_triton_interpret()``: skip the calling module without Triton, or on a machine
  with neither a GPU nor ``TRITON_INTERPRET=1`` (conftest sets it on CPU-only machines).
- ``close(out, ref, dtype)``: no NaN in ``out``, then ``out ~ ref`` within ``TOL[dtype]``.
- ``randomize_pools``, ``place_decode_round``, ``place_extend_round``: fresh random pools and
  rounds laid out through ``metadata`` (random request rows and slots).
- ``random_qkv(runner, n, gen)``: one forward's ``q, k, v`` for the runner's model;
  ``randn_qkv`` the same unscaled, on the runner's device (FlashAttention/FlashInfer cases).
- ``poison_pools``, ``fill_slots``, ``extend_lengths``: NaN pools with real values only where
  a case puts them, and the ragged/uniform extend lengths of a case.
- ``check_replayed_lanes``: after a CUDA-graph replay of a padded batch, the real lanes of
  every step's output against ``torch_ref``.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from specattn import metadata
from specattn.data import DraftBatch, DraftExtendBatch, DraftRunner
from specattn.platforms import triton_interpret_enabled

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def require_triton_interpret() -> None:
    """Call at module level, before importing a Triton backend."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and not triton_interpret_enabled():
        pytest.skip("needs TRITON_INTERPRET=1 without a GPU",  # pragma: no cover
                    allow_module_level=True)


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
          nan_message: str = "NaN in the output") -> None:
    """``out`` has no NaN (outputs and scratch are poisoned) and matches ``ref``."""
    assert not torch.isnan(out).any(), nan_message
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def _pools(runner: DraftRunner) -> list[torch.Tensor]:
    return runner.kv_buffer if runner.use_mla_backend else runner.k_buffer + runner.v_buffer


def randomize_pools(runner: DraftRunner) -> DraftRunner:
    """Fill every KV pool of ``runner`` with standard-normal values in its dtype."""
    for p in _pools(runner):
        p.copy_(torch.randn(p.shape, device=DEV).to(p.dtype))
    return runner


def poison_pools(runner: DraftRunner, gen: torch.Generator) -> DraftRunner:
    """Every pool NaN except slot 0 (the dummy slot padded lanes use), which gets random
    values; cases then fill the slots a lane may read (``fill_slots``)."""
    for p in _pools(runner):
        p.fill_(float("nan"))
        p[0] = torch.randn(p[0].shape, generator=gen).to(runner.dtype)
    return runner


def fill_slots(runner: DraftRunner, slots: torch.Tensor, gen: torch.Generator) -> None:
    """Standard-normal values (drawn on the CPU) into ``slots`` of every pool."""
    for p in _pools(runner):
        vals = torch.randn((slots.numel(),) + tuple(p.shape[1:]), generator=gen)
        p[slots.to(p.device).long()] = vals.to(p.dtype).to(p.device)


def extend_lengths(bs: int, max_len: int, max_ext: int, ragged: bool,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(extend_lens, seq_lens)`` ``[bs]`` int64: ragged ``E in [1, max_ext]`` over a prefix
    in ``[0, max_len)``, else every request ``max_ext`` new tokens after ``max_len``."""
    if ragged:
        ext = torch.randint(1, max_ext + 1, (bs,), generator=gen)
        seq = ext + torch.randint(0, max_len, (bs,), generator=gen)
    else:
        ext = torch.full((bs,), max_ext)
        seq = torch.full((bs,), max_len + max_ext)
    return ext, seq


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


def randn_qkv(runner: DraftRunner, n: int, gen: torch.Generator):
    """Unscaled standard-normal ``q, k, v`` for ``n`` rows (drawn on the CPU, moved to the
    runner's device). MHA: ``[n, H_q, D]``, ``[n, H_kv, D]``, ``[n, H_kv, D_v]``; MLA:
    ``[n, H, R + rope]``, ``[n, R + rope]``, ``None``."""
    dev, dt = runner.device, runner.dtype
    if runner.use_mla_backend:
        width = runner.kv_lora_rank + runner.qk_rope_head_dim
        q = torch.randn(n, runner.num_heads, width, generator=gen)
        k = torch.randn(n, width, generator=gen)
        return q.to(dt).to(dev), k.to(dt).to(dev), None
    q = torch.randn(n, runner.num_q_heads, runner.head_dim, generator=gen)
    k = torch.randn(n, runner.num_kv_heads, runner.head_dim, generator=gen)
    v = torch.randn(n, runner.num_kv_heads, runner.v_head_dim, generator=gen)
    return q.to(dt).to(dev), k.to(dt).to(dev), v.to(dt).to(dev)


def check_replayed_lanes(runner: DraftRunner, layer, batch: DraftBatch, real: int,
                         qs: list, outs: list, tree_mode: str, dtype: torch.dtype) -> None:
    """The first ``real`` requests of a replayed padded ``batch``: ``outs[step]`` (the graph's
    outputs, ``[bs*K, H, D_v]``) against ``torch_ref`` for the queries ``qs[step][0]``."""
    from specattn.backends.torch_ref import reference_decode

    topk = batch.out_cache_loc.shape[1]
    sub = DraftBatch(batch.req_pool_indices[:real], batch.seq_lens[:real],
                     batch.out_cache_loc[:real],
                     None if batch.parents is None else batch.parents[:, :real])
    # Each step's reference reads the pool after the last step's writes: earlier steps only
    # see slots written before them, which the replay wrote identically.
    for step, out in enumerate(outs):
        ref = reference_decode(runner, layer, qs[step][0][:real * topk], sub, step, tree_mode)
        close(out[:real * topk], ref, dtype)
