"""Comparisons of recorded rounds: two runs of the same round (``compare``), and a run
against a float32 attention of what each row reads (``check_tree``, ``UPSTREAM``)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from .fixture import Fixture
from .runs import Record


def perturbed(rec: Record) -> Record:
    """A copy of ``rec`` whose first step's attention output is wrong by 10% of its scale
    (a comparison must fail it)."""
    bad = copy.copy(rec)
    bad.outputs = [o.clone() for o in rec.outputs]
    bad.outputs[0] += 0.1 * bad.outputs[0].abs().max()
    return bad


# --- comparisons ---------------------------------------------------------------------------------

@dataclass
class Verdict:
    ok: bool
    requests: int
    tokens_equal: int           # requests whose draft tokens are equal
    near_ties: int              # requests whose tokens differ at a rounding-level near-tie
    out_err: float = 0.0        # max over compared steps: max |got - ref| / max |ref|
    kv_err: float = 0.0
    logit_err: float = 0.0
    problems: list = field(default_factory=list)

    @property
    def summary(self) -> str:
        ties = f", {self.near_ties} near-tie" if self.near_ties else ""
        text = (f"tokens {self.tokens_equal}/{self.requests}{ties}; attn {self.out_err:.1e}, "
                f"KV {self.kv_err:.1e}, logits {self.logit_err:.1e}")
        return text if self.ok else text + "; " + "; ".join(self.problems[:3])


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / max |ref|`` in float32 (``inf`` if ``got`` is not finite)."""
    got, ref = got.float(), ref.float()
    if got.shape != ref.shape:
        return math.inf
    if got.numel() == 0:
        return 0.0
    if not torch.isfinite(got).all():
        return math.inf
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def _first_divergence(ref: Record, got: Record, b: int, topk: int) -> Optional[int]:
    """The first selection (1..S-1) whose tokens differ for request ``b``, or None."""
    rows = slice(b * topk, (b + 1) * topk)
    for i, (x, y) in enumerate(zip(ref.input_ids, got.input_ids)):
        if not torch.equal(x[rows], y[rows]):
            return max(i, 1)  # selection 0 takes the given top-k: equal unless broken
    if not all(torch.equal(x[b], y[b]) for x, y in zip(ref.tree, got.tree) if x is not None):
        return len(ref.input_ids)  # the last selection, from the last forward's logits
    return None


def compare(ref: Record, got: Record, topk: int, tol: float) -> Verdict:
    """``got`` against ``ref`` (same inputs): see the module doc."""
    bs = ref.tree[2].shape[0]
    steps = len(ref.outputs)
    equal = ties = 0
    out_err = kv_err = logit_err = 0.0
    problems = []
    compared = [steps] * bs  # forwards of each request that saw equal tokens
    for b in range(bs):
        rows = slice(b * topk, (b + 1) * topk)
        d = _first_divergence(ref, got, b, topk)
        if d is None:
            equal += 1
        else:
            compared[b] = d
            err = rel_err(got.logits[d - 1][rows], ref.logits[d - 1][rows])
            logit_err = max(logit_err, err)
            if err <= tol:
                ties += 1
            else:
                problems.append(f"request {b}: tokens differ at step {d} with logits "
                                f"{err:.2g} apart")
    for i in range(steps):
        idx = [b for b in range(bs) if compared[b] > i]
        if not idx:
            continue
        rows = torch.cat([torch.arange(b * topk, (b + 1) * topk) for b in idx])
        rows = rows.to(ref.outputs[i].device)
        out_err = max(out_err, rel_err(got.outputs[i][rows], ref.outputs[i][rows]))
        logit_err = max(logit_err, rel_err(got.logits[i][rows], ref.logits[i][rows]))
        sel = torch.tensor(idx, device=ref.kv.device)
        kv_err = max(kv_err, rel_err(got.kv[sel, :, i], ref.kv[sel, :, i]))
    for name, err in (("attention output", out_err), ("KV", kv_err), ("logits", logit_err)):
        if not err <= tol and not (name == "logits" and problems):
            problems.append(f"{name} {err:.2g} off (tolerance {tol:g})")
    return Verdict(not problems, bs, equal, ties, out_err, kv_err, logit_err, problems)


def _ancestors(parents: Optional[torch.Tensor], b: int, lane: int, step: int,
               mode: str) -> list[int]:
    """Lane of each step ``0..step`` on lane ``lane``'s history (``lane``) or its token's
    ancestor chain (``path``: ``parents[t][b, x]`` is the lane at ``t - 1`` of the token of
    lane ``x`` at step ``t``)."""
    chain = [lane]
    for t in range(step, 0, -1):
        chain.append(int(parents[t, b, chain[-1]]) if mode == "path" else lane)
    return chain[::-1]


def kv_reads(lengths, topk: int, step: int, mode: str,
             parents: Optional[torch.Tensor] = None) -> list[list[tuple]]:
    """What row ``b * topk + j`` of step ``step`` attends to, as segments ``("prefix", b',
    lo, hi)`` (positions ``lo:hi`` of request ``b'``'s prefix) and ``("draft", b', lane, t)``:

    - ``lane``: its prefix and its lane's draft tokens ``0..step``; ``path``: its prefix and
      its token's ancestors (``parents``);
    - ``prefix``: its prefix alone (SGLang's FlashInfer MLA draft step, eager: ``UPSTREAM``);
    - ``packed`` (``topk`` 1): ``lengths[b]`` entries from offset ``sum(lengths[:b])`` of the
      requests' ``prefix + step + 1`` draft ids laid end to end (the same backend's replay)."""
    rows = []
    for b, n in enumerate(lengths):
        for j in range(topk):
            if mode == "packed":
                layout = [seg for bb in range(b + 1) for seg in
                          [("prefix", bb, 0, lengths[bb])]
                          + [("draft", bb, 0, t) for t in range(step + 1)]]
                rows.append(_window(layout, sum(lengths[:b]), n))
                continue
            segs = [("prefix", b, 0, n)]
            if mode != "prefix":
                segs += [("draft", b, lane, t)
                         for t, lane in enumerate(_ancestors(parents, b, j, step, mode))]
            rows.append(segs)
    return rows


def _window(layout: list, start: int, count: int) -> list:
    """The segments of ``layout`` covering its entries ``start:start + count``."""
    out, pos = [], 0
    for seg in layout:
        size = seg[3] - seg[2] if seg[0] == "prefix" else 1
        lo, hi = max(start, pos), min(start + count, pos + size)
        if lo < hi:
            out.append(("prefix", seg[1], seg[2] + lo - pos, seg[2] + hi - pos)
                       if seg[0] == "prefix" else seg)
        pos += size
    return out


def tree_reference(fx: Fixture, rec: Record, step: int, mode: str) -> torch.Tensor:
    """Float32 attention of step ``step`` from the recorded queries over what ``kv_reads``
    says each row reads in ``mode``: prefixes from the pools, draft KV as that call saw it
    (``rec.pools_at``) or else as the round left it (``rec.kv``; each draft slot is written
    once, at its step, so the later steps did not change what this one read)."""
    case, layer = fx.case, fx.layer
    topk = case.topk
    r2t = fx.runner.req_to_token_pool.req_to_token
    a, b_, c = fx.shape
    pools = rec.pools_at[step] if rec.pools_at else fx.pools()
    if rec.pools_at:  # the draft rows as this call read them, not as the round left them
        loc = fx.loc.view(fx.batch, topk, case.steps)
        kv = (pools[0][loc].float().flatten(3) if fx.model == "mla" else torch.cat(
            [pools[0][loc].float().flatten(3), pools[1][loc].float().flatten(3)], dim=-1))
    else:
        kv = rec.kv
    npools = 1 if fx.model == "mla" else 2  # MLA: one [kv_lora_rank + rope] buffer
    if fx.model == "mla":
        hq, hkv, dk, dv = a, 1, b_ + c, b_

        def split(rows):  # [n, dk] -> keys, values
            rows = rows.view(rows.shape[0], 1, dk)
            return rows, rows[..., :dv]
    else:
        hq, hkv, dk, dv = a, b_, c, c

        def split(rows):
            k, v = rows[:, :hkv * dk], rows[:, hkv * dk:]
            return k.reshape(-1, hkv, dk), v.reshape(-1, hkv, dv)

    def rows_of(seg):
        if seg[0] == "draft":
            return kv[seg[1], seg[2], seg[3]][None]
        slots = r2t[seg[1], seg[2]:seg[3]].long()
        return torch.cat([p[slots].float().flatten(1) for p in pools[:npools]], dim=-1)

    reads = kv_reads(fx.lengths, topk, step, mode, rec.parents)
    q = rec.queries[step][:len(reads)].float()
    q = q.view(q.shape[0], hq, dk)
    out = torch.empty(q.shape[0], hq, dv, device=q.device)
    group = hq // hkv
    for r, segs in enumerate(reads):
        keys, vals = split(torch.cat([rows_of(seg) for seg in segs]))
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[r], keys) * layer.scaling
        out[r] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)
    return out.flatten(1)


def check_tree(fx: Fixture, rec: Record, mode: str, tol: float) -> tuple[bool, float, int, int]:
    """``rec``'s attention outputs (a graph's padded rows left out) against
    ``tree_reference`` in ``mode``; returns (ok, max error, rows whose path reference differs
    from the lane one, rows compared)."""
    worst, differ, rows = 0.0, 0, 0
    for step in range(len(rec.outputs)):
        ref = tree_reference(fx, rec, step, mode)
        worst = max(worst, rel_err(rec.outputs[step][:ref.shape[0]].flatten(1), ref))
        if rec.parents is not None and step > 0:
            lane = tree_reference(fx, rec, step, "lane")
            scale = ref.abs().max().clamp_min(1e-6)
            differ += int(((ref - lane).abs().amax(-1) / scale > tol).sum())
        rows += ref.shape[0]
    return worst <= tol, worst, differ, rows


def tree_verdict(fx: Fixture, rec: Record, mode: str, tol: float) -> Verdict:
    """``check_tree`` as a ``Verdict`` (``path``: the rows that differ from lane attention
    are noted, and none differing at ``topk`` > 1 fails: the tree was not used)."""
    ok, err, differ, total = check_tree(fx, rec, mode, tol)
    verdict = Verdict(ok, fx.batch, fx.batch, 0, out_err=err)
    if not ok:
        verdict.problems.append(f"attention {err:.2g} off the float32 {mode} reference")
    if mode == "path":
        verdict.problems.append(f"{differ} of {total} rows differ from lane attention")
        if fx.case.topk > 1 and differ == 0:
            verdict.ok = False
            verdict.problems.insert(0, "no row differs from lane attention")
    return verdict


#: SGLang 0.5.23 draft backends whose attention is not the draft tree's: per run (``eager``,
#: ``graph``), the ``kv_reads`` mode that models what they read, and where SGLang does it.
UPSTREAM = {
    "FlashInferMLAMultiStepDraftBackend": {
        "eager": ("prefix", "SGLang's FlashInferMLAAttnBackend.init_forward_metadata plans a "
                  "decode batch without its spec_info (sglang/srt/layers/attention/"
                  "flashinfer_mla_backend.py:424-434; the draft branch is at :951), so each "
                  "draft step attends to the prefix alone"),
        "graph": ("packed", "SGLang's FlashInferMLAAttnBackend._apply_cuda_graph_metadata "
                  "plans replays with the prefix lengths (seq_lens_cpu, flashinfer_mla_backend"
                  ".py:557-562) over kv_indices holding prefix + step + 1 ids per request, so "
                  "request b reads its prefix length from the prefix-only offset"),
    },
}


def upstream_check(fx: Fixture, rec: Record, container, run: str,
                   tol: float) -> Optional[tuple[str, str, Verdict]]:
    """For SGLang's ``container`` of ``UPSTREAM``: ``(mode, where, verdict)``, ``rec``'s
    attention against the float32 model of what that backend reads in ``run``; else None."""
    known = UPSTREAM.get(type(container).__name__, {}).get(run)
    if known is None:
        return None
    return known[0], known[1], tree_verdict(fx, rec, known[0], tol)
