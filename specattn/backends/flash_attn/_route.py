"""Which formulation a draft-decode round runs in ``mode="auto"``, and how many prefix chunks
a draft extend batch runs by default (``topk=1``: one pass or a split): a pure function of
shapes.

FA4 has no split-KV on sm90: one CTA reads one (sequence, kv head)'s keys, so a pass over
``rows`` sequences runs ``ctas = rows * H_kv`` CTAs. Its time is the larger of two limits:

    pass(ctas, keys) = max(ceil(ctas / SMs) * keys * T_CTA,     one CTA streams at most
                           ctas / SMs * keys * T_BW)             the chip's bandwidth

(``T_CTA``: one CTA's latency-bound rate, ``T_BW``: the chip's bandwidth per SM, both per key
of one kv head at ``D = 128``). Every route runs one FlashAttention pass (its fixed cost
cancels); the two-pass routes add the Triton history+merge kernel (``HIST``), a split adds
the copy of ``q`` per chunk (``COPY``):

- ``shared``: ``pass(B * H_kv, L) + HIST``; ``K == 1``: one pass ``pass(B * H_kv, L)``.
- ``split C``: ``pass(B * C * H_kv, L / C) + HIST + COPY``.
- ``per-branch``: ``pass(B * K * H_kv, L)`` (``K`` times the bytes).

Constants fitted on the H200: ``gqa-small`` prefix pass 20 / 17 / 14 us unsplit / 2 / 4
chunks (``T_CTA``), ``gqa-long`` 155 us against a 126 us copy floor (``T_BW``), per-branch
28 us at ``gqa-small``; it picks split 4 there (measured fastest: 27.0 us vs per-branch 27.8,
shared 31.2) and shared at ``gqa-long``/``gqa-paged``. One request with a long prefix
(``gqa-b1-32k``: 8 CTAs unsplit on 132 SMs) takes 8 or 16 chunks, so that the pass fills
the chip.
``L`` is the host's bound on the prefix length (the runner's ``max_context_len``): the
actual lengths live on the device and are not read (no sync), and the decision must not
change between replays of one captured graph.
"""

from __future__ import annotations

from typing import Optional

from ...errors import InvalidInputError
from ...util import ceil_div

__all__ = ["Route", "choose_route", "route_cost", "SPLITS", "check_split_prefix"]

T_CTA_US = 0.008  # one CTA, one key of one kv head (K+V rows, 512 B at D=128), us
T_BW_US = 0.016  # the same key at the chip's copy bandwidth per SM (512 B / (4.25 TB/s/132))
HIST_US = 8.0  # the Triton history+merge kernel, incl. its launch in a graph
COPY_US = 2.0  # q repeated per chunk (split only)
SPLITS = (2, 4, 8, 16)  # split-prefix chunk counts considered
# (mode, chunks): mode "shared" or "per-branch"; chunks > 1 only with "shared".
Route = tuple


def check_split_prefix(split_prefix: Optional[int], *, none_means: str = "") -> Optional[int]:
    """``split_prefix`` (prefix chunks per request) as given, refused unless an int >= 1
    (or ``None`` where ``none_means`` says what ``None`` does)."""
    if split_prefix is None and none_means:
        return None
    if not isinstance(split_prefix, int) or isinstance(split_prefix, bool) or split_prefix < 1:
        expected = "an int >= 1 (1 = one pass)"
        raise InvalidInputError("split_prefix", f"None ({none_means}) or {expected}"
                                if none_means else expected, repr(split_prefix))
    return split_prefix


def _pass_us(ctas: int, keys: int, sms: int, scale: float) -> float:
    waves = ceil_div(ctas, sms)
    return max(waves * keys * T_CTA_US, ctas / sms * keys * T_BW_US) * scale


def route_cost(route: Route, *, bs: int, topk: int, prefix_len: int, num_kv_heads: int,
               num_sms: int, head_dim: int = 128) -> float:
    """Modelled microseconds of one step of ``route`` past the costs every route shares
    (the KV write, one pass's launch); see the module docstring."""
    mode, chunks = route
    scale = head_dim / 128
    if mode == "per-branch":
        return _pass_us(bs * topk * num_kv_heads, prefix_len, num_sms, scale)
    keys = ceil_div(prefix_len, chunks)
    cost = _pass_us(bs * chunks * num_kv_heads, keys, num_sms, scale)
    if chunks > 1:
        return cost + HIST_US + COPY_US
    return cost + (HIST_US if topk > 1 else 0.0)


def choose_route(*, bs: int, topk: int, prefix_len: int, num_kv_heads: int,
                 num_sms: Optional[int], head_dim: int = 128) -> Route:
    """The cheapest of ``shared``, ``split C`` and ``per-branch`` for this round's shape.

    ``num_sms=None`` (no GPU: the CPU stand-ins) keeps ``shared``. ``topk == 1`` has no
    per-branch alternative (one pass is already per lane): ``shared`` or a split."""
    if num_sms is None or bs < 1:
        return ("shared", 1)
    kw = dict(bs=bs, topk=topk, prefix_len=max(prefix_len, 1), num_kv_heads=num_kv_heads,
              num_sms=num_sms, head_dim=head_dim)
    options = [("shared", 1)] + [("shared", c) for c in SPLITS]
    if topk > 1:
        options.append(("per-branch", 1))
    # min keeps the first of equal costs: shared before split before per-branch.
    return min(options, key=lambda r: route_cost(r, **kw))

