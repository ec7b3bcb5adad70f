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
- The replay metadata call's tests (``test_triton_replay``, ``test_flash_attn_replay``):
  ``CountedKernel``, ``TorchOps``, ``forbid_host_reads``, ``trace_specattn``, ``quiet_replay``,
  ``checked_replay`` (what the call launches, runs, reads and checks) and the batches it is
  given (``first_requests``, ``replaced``, ``strided_seq_lens``, ``with_bad_slot``).
- ``plan_on_device``: a FlashInfer graph pass planned as the glue plans it (the slot-list
  launch writes the CSR and the schedule).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specattn import metadata, validation
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


def _shuffled_share(n: int, share: tuple[int, int]) -> torch.Tensor:
    """``range(n)``'s values ``v`` with ``v % parts == part`` (``share = (part, parts)``),
    shuffled, 0 last: rounds placed on shares of one runner name disjoint rows and slots."""
    part, parts = share
    perm = torch.randperm(n, device=DEV)
    perm = perm[perm % parts == part]
    return torch.cat([perm[perm != 0], perm[perm == 0]])


def place_decode_round(runner: DraftRunner, seq_lens: list[int], topk: int, steps: int,
                       page: int, tree_mode: str = "lane",
                       share: tuple[int, int] = (0, 1)) -> DraftBatch:
    """Random request rows (of ``runner.max_reqs``) and distinct random slots for the
    prefixes, slot 0 last (the padding lanes of a padded replay write it); draft slots from
    ``metadata.assign_draft_cache_locs``; zero ``parents`` in ``path`` mode (tests fill step
    ``i > 0`` in place). ``share``: ``(part, parts)`` of the rows and slots (``_shuffled_share``),
    for rounds that stay valid side by side."""
    bs = len(seq_lens)
    seq = torch.tensor(seq_lens, dtype=torch.int64, device=DEV)
    rpi = _shuffled_share(runner.max_reqs, share)[:bs]
    perm = _shuffled_share(runner.num_slots, share).to(torch.int32)
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


def place_extend_round(runner: DraftRunner, seq_lens: list[int], ext_lens: list[int],
                       share: tuple[int, int] = (0, 1)) -> DraftExtendBatch:
    """Random request rows and distinct random slots (of ``share``, as
    ``place_decode_round``); the new tokens are ``R_b[L - E : L]``."""
    bs = len(seq_lens)
    rpi = _shuffled_share(runner.max_reqs, share)[:bs]
    perm = _shuffled_share(runner.num_slots, share).to(torch.int32)
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


# --- CUDA-graph replay metadata calls (``test_triton_replay``, ``test_flash_attn_replay``) ---

class CountedKernel:
    """A Triton kernel stand-in that counts its launches: runs ``kernel`` until ``idle`` is
    set, then launches nothing; returns no compiled kernel (every launch is an ordinary
    one)."""

    def __init__(self, kernel):
        self.kernel, self.launches, self.idle = kernel, 0, False

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            if not self.idle:
                self.kernel[grid](*args, **kwargs)
        return launch


class TorchOps(TorchDispatchMode):
    """Every torch op run inside it (a view, a copy, a reduction...): ``ops``."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def forbid_host_reads(monkeypatch) -> None:
    """Any read of a tensor's values on the host raises."""
    def refuse(*args, **kwargs):
        raise AssertionError("a device -> host read in the replay metadata call")
    for name in ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__",
                 "__index__", "__array__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def trace_specattn(fn) -> tuple[list, int]:
    """``fn()``'s calls (function names) and executed lines inside ``specattn``."""
    root = os.path.dirname(validation.__file__)
    calls, lines = [], [0]

    def tracer(frame, event, arg):
        if not frame.f_code.co_filename.startswith(root):
            return None
        if event == "call":
            calls.append(frame.f_code.co_name)
        elif event == "line":
            lines[0] += 1
        return tracer

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(old)
    return calls, lines[0]


def quiet_replay(monkeypatch, backend, batch, bs: int,
                 page_checks: tuple = ()) -> tuple[list, int, list, list]:
    """One replay metadata call of ``backend`` as on a device (no value checks; a host read
    raises): its calls and line count in ``specattn``, its torch ops and the batch checks it
    ran (``check_decode_batch``, ``check_extend_batch``, and ``check_page_aligned`` of the
    ``page_checks`` modules)."""
    checks: list = []
    with monkeypatch.context() as m:
        m.setattr(validation, "_scan_values", lambda t, debug: False)
        for module in (sys.modules["specattn.base"], validation):
            for name in ("check_decode_batch", "check_extend_batch"):
                m.setattr(module, name, lambda *a, _n=name, **k: checks.append(_n))
        for module in page_checks:
            m.setattr(module, "check_page_aligned",
                      lambda *a, **k: checks.append("check_page_aligned"))
        forbid_host_reads(m)
        with TorchOps() as ops:
            calls, lines = trace_specattn(
                lambda: backend.init_forward_metadata_replay_cuda_graph(batch, bs))
    return calls, lines, ops.ops, checks


def checked_replay(monkeypatch, backend, batch, bs: int) -> int:
    """A replay metadata call of ``batch``: how many times it ran the base class's batch
    check (``check_decode_batch`` / ``check_extend_batch``)."""
    real = validation.check_extend_batch if isinstance(batch, DraftExtendBatch) else \
        validation.check_decode_batch
    checks: list = []
    with monkeypatch.context() as m:
        m.setattr(sys.modules["specattn.base"], real.__name__,
                  lambda *a, **k: checks.append(1) or real(*a, **k))
        backend.init_forward_metadata_replay_cuda_graph(batch, bs)
    return len(checks)


def one_token_fewer(batch: DraftExtendBatch, host_lengths: bool = False) -> DraftExtendBatch:
    """``batch`` without the last new token of its first request that has more than one
    (its ``seq_lens`` and ``extend_lens`` one less, its slot left out of ``out_cache_loc``),
    with host copies of the lengths where ``host_lengths``."""
    r = int((batch.extend_lens > 1).nonzero()[0, 0])
    drop = int(batch.extend_lens[:r + 1].sum()) - 1
    keep = [i for i in range(batch.out_cache_loc.shape[0]) if i != drop]
    fewer, shorter = batch.extend_lens.clone(), batch.seq_lens.clone()
    fewer[r] -= 1
    shorter[r] -= 1
    return DraftExtendBatch(batch.req_pool_indices, shorter, fewer, batch.out_cache_loc[keep],
                            shorter.clone() if host_lengths else None,
                            fewer.clone() if host_lengths else None)


def first_requests(batch: DraftBatch, n: int) -> DraftBatch:
    """The first ``n`` requests of ``batch`` (a replay padded to the captured size)."""
    parents = None if batch.parents is None else batch.parents[:, :n]
    return DraftBatch(batch.req_pool_indices[:n], batch.seq_lens[:n],
                      batch.out_cache_loc[:n], parents)


def replaced(batch, **tensors):
    """``batch`` (decode or extend, host lengths left out) with some index ``tensors``
    replaced (by field name)."""
    names = (("req_pool_indices", "seq_lens", "extend_lens", "out_cache_loc")
             if isinstance(batch, DraftExtendBatch) else
             ("req_pool_indices", "seq_lens", "out_cache_loc", "parents"))
    return type(batch)(*(tensors.get(n, getattr(batch, n)) for n in names))


def strided_seq_lens(batch):
    """``batch`` with its ``seq_lens`` as a strided column of a wider tensor."""
    return replaced(batch, seq_lens=torch.stack([batch.seq_lens, batch.seq_lens], 1)[:, 0])


def with_bad_slot(batch, num_slots: int):
    """``batch`` with its first new token's slot past the pool."""
    loc = batch.out_cache_loc.clone()
    loc.view(-1)[0] = num_slots
    return replaced(batch, out_cache_loc=loc)


def replay_device_work(backend, batch, bs: int) -> list[str]:
    """The CUDA activities (kernels, copies) of one replay metadata call, after a first call
    (compiles, warms caches and the kept launch), with any host synchronisation an error."""
    backend.init_forward_metadata_replay_cuda_graph(batch, bs)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            backend.init_forward_metadata_replay_cuda_graph(batch, bs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def plan_on_device(p, csr, causal: bool, params, ext: Optional[torch.Tensor] = None) -> bool:
    """Plan FlashInfer graph pass ``p`` for the host CSR ``csr`` the way the glue does: one
    slot-list launch (``kernels.prefix_slots``, request rows 0) writes the key CSR (with
    ``ext``, an extend's new tokens per request, also the query indptr) and, where the pass
    takes it, the round's schedule (its requests' query rows otherwise ``csr``'s first);
    then the replan. Returns whether the schedule was written by the launch."""
    from specattn.kernels.prefix_slots import prefix_slots

    r = p.runner
    dev = p.device_csr()
    assert dev is not None, "no direct replanner yet: plan the pass once first"
    bs = csr.kv_lens.shape[0]
    rows = int(csr.qo_indptr[1] - csr.qo_indptr[0]) if bs else 0
    schedule = p.device_schedule(causal, params, None if ext is not None else rows)
    lens = csr.kv_lens.to(r.device, torch.int64)
    qo = None if ext is None else (ext.to(r.device), dev[2])
    prefix_slots(p.reserve(max(csr.total, 1)), csr.total, max(csr.max_kv, 1), r.req_to_token,
                 torch.zeros(bs, dtype=torch.int64, device=r.device), lens, r.num_slots,
                 csr=dev[:2], qo=qo, schedule=schedule)
    p.plan(csr, causal, params, on_device=True, qo_on_device=ext is not None,
           scheduled=schedule is not None)
    return schedule is not None
