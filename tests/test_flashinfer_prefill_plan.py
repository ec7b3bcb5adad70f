"""FlashInfer's FA2 prefill schedule written by the slot-list launch
(``kernels.prefill_schedule`` through ``kernels.prefix_slots``, laid out by
``backends.flashinfer._prefill_plan``), CPU (Triton's interpreter), against FlashInfer 0.7.4's
host planner as ported in ``standins/flashinfer_prefill``.

The device schedule is the planner's: the same work items in the same order, the same
``o_indptr``, ``merge_indptr``, key chunk, query rows and valid-block mask, for ragged and
uniform query rows, split and unsplit plans, one request and more than one block of
requests; a ``plan_info`` laid out otherwise gets no device schedule; and a graph replay
that takes it reaches the right attention (the stand-in's ``run`` checks the workspace).
"""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch

from specattn.backends.flashinfer import _prefill_plan
from specattn.backends.flashinfer._prefill_plan import device_schedule
from specattn.kernels.prefix_slots import prefix_slots
from standins import flashinfer_prefill as fa2

SMS = 6


def _indptr(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return out


def _wrapper(plan_info, size):
    """The attributes ``device_schedule`` reads, over a poisoned int workspace."""
    return types.SimpleNamespace(_backend="fa2", _plan_info=plan_info,
                                 _int_workspace_buffer=torch.full((size,), 0x5A,
                                                                  dtype=torch.uint8))


@pytest.fixture(autouse=True)
def _stand_in_sms(monkeypatch):
    """The stand-in's SMs, and FlashInfer 0.7.4 imported."""
    monkeypatch.setattr(_prefill_plan, "sm_count", lambda device: SMS)
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.7.4"))


def _device(q_lens, kv_lens, hq, hkv, rows_cap, *, uniform=0, disable=False, fill=1,
            raw=None):
    """``(FlashInfer's schedule, the device's)`` of one graph round of ``len(kv_lens)``
    requests, the first ``raw`` real (the rest padding: ``fill`` keys, ``uniform`` rows)."""
    bs = len(kv_lens)
    raw = bs if raw is None else raw
    host_kv = kv_lens[:raw] + [fill] * (bs - raw)
    qo = _indptr(q_lens)
    plan_info, want, used = fa2.fa2_plan(qo, _indptr(host_kv), rows_cap, hq, hkv, 128,
                                         uniform=uniform, disable_split_kv=disable, sms=SMS)
    w = _wrapper(plan_info, used + 64 + (-used) % 16)
    schedule = device_schedule(w, plan_info, bs, (hq, hkv, 128, 1), uniform=uniform,
                               disable_split_kv=disable, fixed_split_size=-1)
    assert schedule is not None
    width = max(kv_lens + [1])
    req_to_token = torch.arange(raw * width, dtype=torch.int32).view(raw, width)
    rows = torch.arange(raw)
    lens = torch.tensor(kv_lens[:raw], dtype=torch.int64)
    total = sum(host_kv)
    out = torch.zeros(max(total, 1), dtype=torch.int32)
    csr = (torch.zeros(bs + 1, dtype=torch.int32), torch.zeros(bs, dtype=torch.int32))
    qo_dev = None
    if not uniform:  # an extend: the launch writes the query indptr of its new tokens
        qo_dev = (torch.tensor(q_lens[:raw]), torch.zeros(bs + 1, dtype=torch.int32))
    prefix_slots(out, total, max(host_kv + [1]), req_to_token, rows, lens, 1 << 20, bs=bs,
                 fill=fill, csr=csr, qo=qo_dev, schedule=schedule)
    got = fa2.read_schedule(w._int_workspace_buffer, plan_info, bs)
    return want, got


def _random(rng, bs, uniform):
    q = [uniform] * bs if uniform else [rng.randint(0, 9) for _ in range(bs)]
    kv = [rng.choice([0, 1, rng.randint(1, 300), rng.randint(300, 40000)]) for _ in range(bs)]
    return q, kv


_rng = random.Random(11)
CASES = [
    # (q_lens, kv_lens, hq, hkv, rows_cap, uniform, disable)
    ([4], [32768], 32, 8, 4, 4, False),  # one request split over every SM
    ([1, 7, 2, 6], [4096, 100, 77, 20000], 32, 8, 16, 0, False),  # an extend, ragged
    ([3, 0, 5], [0, 900, 1], 8, 8, 12, 0, False),  # no keys, no new tokens
    ([8] * 5, [5000, 300, 3, 128, 129], 16, 2, 40, 8, True),  # disable_split_kv
    ([2] * 3, [64, 64, 64], 4, 4, 6, 2, False),  # keys under the least chunk
    ([4], [1200], 4, 1, 4, 4, False),  # exactly the work-item budget (12) at chunk 100
] + [(*_random(_rng, n, u), 4 * hkv, hkv, (9 if not u else u) * n, u, False)
     for n, u, hkv in ((1, 0, 1), (7, 4, 2), (70, 1, 8), (65, 0, 1), (3, 0, 2))]


@pytest.mark.parametrize("q_lens, kv_lens, hq, hkv, rows_cap, uniform, disable", CASES)
def test_device_schedule_is_flashinfers(q_lens, kv_lens, hq, hkv, rows_cap, uniform, disable):
    rows_cap = max(rows_cap, sum(q_lens))
    want, got = _device(q_lens, kv_lens, hq, hkv, rows_cap, uniform=uniform, disable=disable)
    assert got == want


def test_padding_requests_are_scheduled_as_the_host_csr_lists_them():
    """A padded decode round: requests past ``raw`` have the fill length and ``K`` rows."""
    want, got = _device([4] * 5, [3000, 70, 9000, 5, 5], 32, 8, 20, uniform=4, fill=7,
                        raw=3)
    assert got == want


def test_other_plan_layouts_get_no_device_schedule():
    qo, kv = _indptr([4, 4]), _indptr([100, 5000])
    plan_info, _, used = fa2.fa2_plan(qo, kv, 8, 32, 8, 128, uniform=4, sms=SMS)
    w = _wrapper(plan_info, used)
    kw = dict(uniform=4, disable_split_kv=False, fixed_split_size=-1)
    assert device_schedule(w, plan_info, 2, (32, 8, 128, 1), **kw) is not None
    moved = list(plan_info)
    moved[5] += 16  # qo_tile_indices elsewhere
    for info, wrapper, heads, extra in (
            (moved, w, (32, 8, 128, 1), {}),
            (plan_info[:14], w, (32, 8, 128, 1), {}),  # not 15 values
            (plan_info, w, (32, 8, 128, 16), {}),  # pages of 16 tokens
            (plan_info, w, (32, 8, 128, 1), dict(fixed_split_size=256)),
            (plan_info, w, (32, 8, 128, 1), dict(disable_split_kv=True)),  # split disagrees
            (plan_info, _wrapper(plan_info, used - 1), (32, 8, 128, 1), {}),  # too small
            (plan_info, types.SimpleNamespace(**{**vars(w), "_backend": "fa3"}),
             (32, 8, 128, 1), {})):
        assert device_schedule(wrapper, info, 2, heads, **{**kw, **extra}) is None
    eager, _, _ = fa2.fa2_plan(qo, kv, 8, 32, 8, 128, graph=False, sms=SMS)
    assert device_schedule(w, eager, 2, (32, 8, 128, 1), **kw) is None
    sys.modules["flashinfer"].__version__ = "0.7.5"  # another release's planner
    assert device_schedule(w, plan_info, 2, (32, 8, 128, 1), **kw) is None


def compile_slot_launch(kind: str, extend: bool) -> dict:
    """The slot-list launch with a schedule (``kind``: ``fa2`` or ``mla``; an extend's: query
    rows from the launch's own ``Ext``; a decode prefix's: ``qrows`` each), captured on CPU
    tensors and compiled for sm90: ``{"shared": bytes}``."""
    from specattn.backends.flashinfer._mla_plan import MLASchedule, plan_layout
    from specattn.kernels import prefix_slots as ps
    from specattn.kernels.prefill_schedule import Fa2Schedule
    from sm90_compile import compile_launch
    from standins import flashinfer_mla as mla

    seen = {}

    class Captured:
        def __init__(self, kernel, grid, tail, consts):
            seen.update(kernel=kernel, tail=tail, consts=consts)

        def __call__(self, *head):
            seen["head"] = head

    ps.KernelLaunch = Captured
    bs = 8
    if kind == "fa2":
        ws = torch.zeros(4096, dtype=torch.uint8)
        schedule = Fa2Schedule(ws.view(torch.int32), ws, (0, 64, 128, 300, 200, 240, 244, 1600),
                               40, 32, 64, 4, 128, 33, 0 if extend else 4, True)
    else:
        plan_info, _ = mla.mla_plan(list(range(bs + 1)), list(range(bs + 1)), [1] * bs, 16,
                                    extend)
        ws = torch.zeros(mla.offsets()[1], dtype=torch.uint8)
        schedule = MLASchedule(ws.view(torch.int32), ws, plan_layout(plan_info), 16, extend,
                               bs, 0 if extend else 4)
    ones = torch.ones(bs, dtype=torch.int64)
    csr = (torch.zeros(bs + 1, dtype=torch.int32), torch.zeros(bs, dtype=torch.int32))
    qo = (ones, torch.zeros(bs + 1, dtype=torch.int32)) if extend else None
    ps.prefix_slots(torch.zeros(64, dtype=torch.int32), 8, 1,
                    torch.zeros(bs, 64, dtype=torch.int32), ones, ones, 1000, csr=csr, qo=qo,
                    schedule=schedule)
    kernel = compile_launch(seen["kernel"], (*seen["head"], *seen["tail"]), seen["consts"])
    return {"shared": kernel.metadata.shared}


@pytest.mark.parametrize("kind", ["fa2", "mla"])
@pytest.mark.parametrize("extend", [True, False], ids=["extend", "decode"])
def test_slot_launch_with_schedule_compiles_for_sm90(kind, extend):
    """The schedules' device functions compile inside the slot-list kernel (types the
    interpreter does not check: its loops' carried values). Any Triton release."""
    from sm90_compile import in_child

    got = in_child(__file__, dict(kind=kind, extend=extend))
    assert got["shared"] >= 0


if __name__ == "__main__":
    import json

    print(json.dumps(compile_slot_launch(**json.loads(sys.argv[1]))))
