"""Call recording and the reference attention the stand-ins answer with."""

from __future__ import annotations

import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


class StandinError(AssertionError):
    """A call that does not match the documented vendor API."""


@dataclass
class Call:
    """One recorded call: function name and bound arguments (defaults applied)."""

    name: str
    args: dict[str, Any]
    passed: tuple[str, ...] = field(default_factory=tuple)  # names the caller passed

    def describe(self, name: str) -> Any:
        """(shape, dtype, device) of a tensor argument, else the value."""
        v = self.args[name]
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), v.dtype, v.device.type
        return v


def recorder(module: types.ModuleType, calls: list[Call], fn: Callable) -> Callable:
    """Wrap ``fn`` so a call binds to its signature, is recorded, then runs."""
    sig = inspect.signature(fn)

    def wrapper(*args, **kwargs):
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise StandinError(f"{fn.__name__}: arguments do not fit the documented "
                               f"signature {sig}: {exc}") from exc
        passed = tuple(bound.arguments)
        bound.apply_defaults()
        calls.append(Call(fn.__name__, dict(bound.arguments), passed))
        return fn(**bound.arguments)

    wrapper.__name__ = fn.__name__
    wrapper.__signature__ = sig  # type: ignore[attr-defined]
    return wrapper


def build(name: str, functions: dict[str, Callable]) -> tuple[types.ModuleType, list[Call]]:
    module = types.ModuleType(name)
    calls: list[Call] = []
    for fname, fn in functions.items():
        setattr(module, fname, recorder(module, calls, fn))
    module.calls = calls  # type: ignore[attr-defined]
    return module, calls


def install(monkeypatch, name: str, module: types.ModuleType) -> types.ModuleType:
    monkeypatch.setitem(sys.modules, name, module)
    return module


def expect(cond: bool, message: str) -> None:
    if not cond:
        raise StandinError(message)


def expect_tensor(name: str, t: Any, *, ndim: Optional[int] = None,
                  dtype: Optional[tuple] = None, shape: Optional[tuple] = None) -> None:
    expect(isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}")
    if ndim is not None:
        expect(t.dim() == ndim, f"{name}: expected {ndim}-D, got shape {tuple(t.shape)}")
    if dtype is not None:
        expect(t.dtype in dtype, f"{name}: expected dtype in {dtype}, got {t.dtype}")
    if shape is not None:
        for i, (want, got) in enumerate(zip(shape, t.shape)):
            expect(want is None or want == got,
                   f"{name}: expected shape {shape}, got {tuple(t.shape)} (dim {i})")


def masked_pv(p: torch.Tensor, v: torch.Tensor, visible: Optional[torch.Tensor],
              spec: str) -> torch.Tensor:
    """``einsum(spec, p, v)`` as the kernels document it: a key a query does not see adds
    nothing to that query, not even ``0 * NaN`` (the masked probabilities are 0). ``visible``:
    bool, shaped like ``p``, or None (every key seen). Non-finite values reach exactly the
    rows that see them."""
    if visible is None:
        return torch.einsum(spec, p, v)
    finite = torch.isfinite(v)
    out = torch.einsum(spec, p, torch.where(finite, v, torch.zeros_like(v)))
    seen = torch.einsum(spec, visible.to(p.dtype).expand_as(p), (~finite).to(p.dtype)) > 0
    return out.masked_fill(seen, float("nan"))


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  visible: Optional[torch.Tensor] = None, cap: float = 0.0,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference attention with natural-log LSE.

    q: ``[M, H, D]``; k: ``[n, H_kv, D]``; v: ``[n, H_kv, Dv]`` (``H % H_kv == 0``, q head h
    reads kv head ``h // (H / H_kv)``); visible: ``[M]`` keys each query row sees (a prefix of
    the ``n`` keys) or None. Returns ``o [M, H, Dv]`` fp32, ``lse [M, H]`` fp32 (``-inf`` and
    a zero row when a query sees no key).
    """
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,nhd->mhn", q.float(), kf) * scale
    if cap > 0:
        s = cap * torch.tanh(s / cap)
    seen = None
    if visible is not None:
        mask = torch.arange(k.shape[0])[None, :] < visible[:, None].cpu()
        seen = mask.to(s.device)[:, None, :]
        s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    p = torch.where(torch.isfinite(lse)[..., None], p, torch.zeros_like(p))
    return masked_pv(p, vf, seen, "mhn,nhd->mhd"), lse


# --- test data -----------------------------------------------------------------------------

def paged_round(runner, seq_lens: list[int], topk: int, num_steps: int,
                gen: torch.Generator, *, parents: bool = False):
    """A draft round laid out as the serving engine does it.

    Request ``b`` (pool row ``2b + 1``) owns random distinct pages; ``R_b`` maps its
    positions page by page (``R_b[x] = page[x // P] * P + x % P``) over its prefix and the
    draft extension (``metadata.draft_extend_lens``); ``out_cache_loc`` follows
    ``metadata.draft_slot_positions`` and, when ``P > 1 and K > 1``, the partial last page is
    copied into each lane's first page (``duplicate_last_page_copies``). Every pool row gets
    random values; draft slots get NaN (they must be written before being read).
    Returns a ``DraftBatch``.
    """
    from specattn import metadata
    from specattn.data import DraftBatch

    P = runner.page_size
    dev = runner.device
    L = torch.tensor(seq_lens, dtype=torch.int64, device=dev)
    ext = metadata.draft_extend_lens(L, topk, num_steps, P)
    need = [-(-(int(L[b]) + int(ext[b])) // P) for b in range(len(seq_lens))]
    num_pages = runner.num_slots // P
    perm = torch.randperm(num_pages, generator=gen)
    rpi = torch.arange(len(seq_lens), device=dev) * 2 + 1
    start = 0
    r2t = runner.req_to_token
    r2t.zero_()
    for b, n in enumerate(need):
        pages = perm[start:start + n].to(dev)
        start += n
        x = torch.arange(n * P, device=dev)
        r2t[rpi[b], :n * P] = (pages[x // P] * P + x % P).to(r2t.dtype)
    pools = [runner.kv_buffer] if runner.use_mla_backend else [runner.k_buffer,
                                                                runner.v_buffer]
    for pool in pools:
        for t in pool:
            t.copy_((torch.randn(t.shape, generator=gen) * 0.5).to(t.dtype))
    pos = metadata.draft_slot_positions(L, topk, num_steps, P)
    rows = r2t[rpi.long()]
    loc = torch.gather(rows[:, None, :].expand(-1, topk, -1), 2,
                       pos.reshape(len(seq_lens), topk, -1)).long()
    src, dst = metadata.duplicate_last_page_copies(r2t, rpi, L, topk, num_steps, P)
    metadata.copy_kv_slots(runner, src, dst)
    for pool in pools:
        for t in pool:
            if t.dtype.is_floating_point and t.element_size() > 1:
                t[loc.reshape(-1)] = float("nan")
    par = None
    if parents:
        par = torch.randint(0, topk, (num_steps, len(seq_lens), topk), generator=gen).to(dev)
    return DraftBatch(rpi, L, loc, par)


def extend_batch(runner, seq_lens: list[int], extend_lens: list[int], gen: torch.Generator):
    """A draft-extend batch over page-aligned request rows (random pool, random pages);
    the new tokens' slots are ``R_b[L' - E : L']`` and hold NaN until written."""
    from specattn.data import DraftExtendBatch

    P = runner.page_size
    dev = runner.device
    num_pages = runner.num_slots // P
    perm = torch.randperm(num_pages, generator=gen)
    rpi = torch.arange(len(seq_lens), device=dev) * 2
    r2t = runner.req_to_token
    r2t.zero_()
    start = 0
    locs = []
    for b, L in enumerate(seq_lens):
        n = -(-L // P)
        pages = perm[start:start + n].to(dev)
        start += n
        x = torch.arange(n * P, device=dev)
        r2t[rpi[b], :n * P] = (pages[x // P] * P + x % P).to(r2t.dtype)
        locs.append(r2t[rpi[b], L - extend_lens[b]:L].long())
    loc = torch.cat(locs)
    pools = [runner.kv_buffer] if runner.use_mla_backend else [runner.k_buffer,
                                                                runner.v_buffer]
    for pool in pools:
        for t in pool:
            t.copy_((torch.randn(t.shape, generator=gen) * 0.5).to(t.dtype))
            if t.element_size() > 1:
                t[loc] = float("nan")
    return DraftExtendBatch(rpi, torch.tensor(seq_lens, device=dev),
                            torch.tensor(extend_lens, device=dev), loc)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}[dtype]
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.isfinite(got).all(), "non-finite output"
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
