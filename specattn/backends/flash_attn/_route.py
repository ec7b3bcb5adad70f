"""Which formulation a draft-decode round runs in ``mode="auto"``: a pure function of shapes.

FA4 has no split-KV on sm90: one CTA reads one (sequence, kv head)'s keys, so a pass over
``rows`` sequences keeps ``rows * H_kv`` CTAs busy, and one CTA streams keys at about
``1 / SMs`` of the chip's bandwidth. A small cost model from that:

    time(pass) = ceil(ctas / SMs) waves * keys_per_cta * T_KEY  +  LAUNCH per launch

- ``shared``: ``B * H_kv`` CTAs over ``L`` keys; 2 launches (prefix pass, history+merge),
  1 when ``K == 1`` (one pass).
- ``split C``: ``B * C * H_kv`` CTAs over ``L / C`` keys; 3 launches (q copy too).
- ``per-branch``: ``B * K * H_kv`` CTAs over ``L`` keys (K times the bytes); 1 launch.

Constants from the H200 (2026-11-29, ``flash-attn-bench-v2.md``): one CTA reads a kv head's
key+value row (``D = 128``, bf16: 512 B) in ``T_KEY`` us; a launch inside a CUDA graph costs
``LAUNCH`` us. ``L`` is the host's bound on the prefix length (the runner's
``max_context_len``): the actual lengths live on the device and are not read (no sync),
and the decision must not change between replays of one captured graph.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

__all__ = ["Route", "choose_route", "route_cost", "SPLITS", "device_sm_count"]

T_KEY_US = 0.016  # per key of one kv head (K+V, 512 B) per CTA, us
LAUNCH_US = 4.0  # one extra kernel in a replayed graph, incl. its tail, us
SPLITS = (2, 4)  # split-prefix chunk counts considered
# (mode, chunks): mode "shared" or "per-branch"; chunks > 1 only with "shared".
Route = tuple


def _waves(ctas: int, sms: int) -> int:
    return -(-ctas // sms)


def route_cost(route: Route, *, bs: int, topk: int, prefix_len: int, num_kv_heads: int,
               num_sms: int, head_dim: int = 128) -> float:
    """Modelled microseconds of one step of ``route`` (see the module docstring)."""
    mode, chunks = route
    per_key = T_KEY_US * head_dim / 128
    if mode == "per-branch":
        return _waves(bs * topk * num_kv_heads, num_sms) * prefix_len * per_key + LAUNCH_US
    keys = -(-prefix_len // chunks)
    # K == 1 unsplit is one pass; else prefix + history/merge (+ the q copy when split).
    launches = (1 if topk == 1 else 2) if chunks == 1 else 3
    return _waves(bs * chunks * num_kv_heads, num_sms) * keys * per_key + launches * LAUNCH_US


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


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sm_count(device: torch.device) -> Optional[int]:
    """SMs of a CUDA device; None elsewhere (routing then keeps ``shared``)."""
    if device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
