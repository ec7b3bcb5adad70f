"""``selection.auto_order``: the order ``auto`` tries the backends in, as one table; ``auto``
picks the first row that runs here and accepts the request."""

from __future__ import annotations

import itertools

import pytest
import torch

from specattn.errors import BackendUnavailableError
from specattn.keys import BackendRequest
from specattn.platforms import Platform
from specattn.registry import default_registry
from specattn.selection import auto_order, select

PLATFORMS = [
    Platform("cpu", None),
    Platform("cpu", None, triton_interpret=True, libraries=frozenset({"triton"})),
    Platform("cuda", (9, 0), libraries=frozenset({"triton", "flashinfer", "flash_attn.cute",
                                                  "flash_mla"})),
    Platform("cuda", (10, 0), libraries=frozenset({"triton", "flashinfer",
                                                   "tokenspeed_mla"})),
    Platform("cuda", (8, 0), libraries=frozenset({"triton"})),
    Platform("hip", None, libraries=frozenset({"triton", "aiter"})),
]
REQUESTS = [BackendRequest(kind=kind, mla=mla, topk=topk, page_size=page, dtype=dtype)
            for kind, mla, topk, page, dtype in itertools.product(
                ("decode", "extend"), (False, True), (1, 4), (1, 16, 64),
                (torch.bfloat16, torch.float32))]


@pytest.mark.parametrize("platform", PLATFORMS, ids=str)
def test_auto_picks_the_first_row_that_runs_and_accepts(platform):
    rows = auto_order(platform)
    by_name = {c.qualified_name(): c for k in ("decode", "extend")
               for c in default_registry.classes(k)}
    for request in REQUESTS:
        fits = [r for r in rows if r.kind == request.kind and r.runs_here
                and not by_name[r.qualified_name].validate(request, platform)]
        try:
            got = select(request.kind, "auto", request, platform).backend
        except BackendUnavailableError:
            assert not fits, f"{request}: auto found nothing, the table has {fits[0]}"
            continue
        assert fits and got.qualified_name() == fits[0].qualified_name, request


@pytest.mark.parametrize("platform", PLATFORMS, ids=str)
def test_the_table_is_ranked_by_priority_and_lists_every_auto_class(platform):
    for kind in ("decode", "extend"):
        rows = auto_order(platform, kind)
        assert [r.rank for r in rows] == list(range(1, len(rows) + 1))
        prios = [r.priority for r in rows]
        assert prios == sorted(prios, reverse=True)
        eligible = {c.qualified_name() for c in default_registry.classes(kind)
                    if c.auto_eligible}
        assert {r.qualified_name for r in rows} == eligible
        assert all(r.runs_here == (r.reason == "") for r in rows)


def test_model_specific_rows_are_not_in_the_table():
    names = {r.name for r in auto_order(PLATFORMS[2])}
    assert "dsa" not in names and "dsv4" not in names
    assert {"flashinfer", "fa4", "triton", "torch_ref"} <= names
