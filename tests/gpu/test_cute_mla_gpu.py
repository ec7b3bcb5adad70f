"""The CuTe-DSL MLA kernel on an sm90 GPU with CuTe-DSL (the FA4 part of the offline
bundle), marked ``gpu``:

- the conformance kit on the ``triton`` backend with plan ``cute`` forced: every MLA
  decode case the kit plans, against the reference; and on the default table, where its
  K 8 cases take ``cute`` and the smaller ones ``gluon-wl``;
- every cluster shape (``cute_mla.cluster_shape`` forced): one cluster of all the splits,
  clusters of 2 or 1 whose partials the merge launch combines, against the reference with
  NaN-poisoned partial buffers, bf16 and fp16, lane and path mode, ragged lengths from 0.

The kernel's other tests are the ``cute`` variant of ``test_sm90_mla_gpu.py``."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu


def _require_cute():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("cutlass.cute", reason="CuTe-DSL is not installed (FA4 bundle)")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the CuTe-DSL MLA kernel is built for sm90")


@pytest.mark.parametrize("splits,cluster", [(4, 2), (6, 2), (3, 1), (8, 4), (5, 5)])
@pytest.mark.parametrize("dtype,H,K,tree_mode", [(torch.bfloat16, 16, 4, "path"),
                                                 (torch.float16, 16, 2, "lane"),
                                                 (torch.bfloat16, 128, 1, "lane")])
def test_every_cluster_shape(monkeypatch, splits, cluster, dtype, H, K, tree_mode):
    _require_cute()
    from test_sm90_mla_gpu import make_round, run_round  # this folder (pytest's sys.path)

    from specattn.backends.triton import TritonDecode, cute_mla
    from specattn.data import AttentionLayer

    shapes = []

    def forced(n, programs, device, max_groups):
        shapes.append((n, cluster, n // cluster))
        return cluster, n // cluster

    monkeypatch.setattr(cute_mla, "cluster_shape", forced)
    rng = random.Random(splits * 100 + H + K)
    lens = [0, 1, 65] + [rng.randint(100, 3000) for _ in range(3)]
    r, batch = make_round(dtype, H, K, 3, 1 if H == 16 else 64, lens, tree_mode)
    backend = TritonDecode(r, K, 3, tree_mode=tree_mode, num_splits=splits, plan="cute")
    gen = torch.Generator().manual_seed(splits)
    run_round(r, batch, backend, AttentionLayer(0, 576 ** -0.5, 0.0), tree_mode, gen)
    assert shapes and all(s == (splits, cluster, splits // cluster) for s in shapes)


@pytest.mark.parametrize("num_splits,want", [
    (None, None),  # the plan's own split count
    (120, (8, 15)),  # 15 clusters of 8: all the H200 runs at once
    (132, (2, 66)),  # one CTA per SM
    (8, (8, 1)),  # one cluster: the output written directly
])
def test_one_request_over_the_whole_gpu(num_splits, want):
    """One request of a long prefix split into up to one CTA per SM (far more splits than
    the partial buffers' parts: one part per cluster), path mode, against the reference
    with NaN-poisoned partial buffers."""
    _require_cute()
    from test_sm90_mla_gpu import make_round, run_round  # this folder (pytest's sys.path)

    from specattn.backends.triton import TritonDecode, cute_mla, launchers
    from specattn.data import AttentionLayer

    r, batch = make_round(torch.bfloat16, 16, 4, 3, 64, [20000], "path")
    backend = TritonDecode(r, 4, 3, tree_mode="path", num_splits=num_splits, plan="cute")
    run_round(r, batch, backend, AttentionLayer(0, 576 ** -0.5, 0.0), "path",
              torch.Generator().manual_seed(7))
    splits = backend._round_plan["num_splits"]
    shape = cute_mla.cluster_shape(splits, 1, torch.device("cuda"), launchers.partial_room(4))
    assert shape is not None and (want is None or shape == want), (splits, shape)
    assert num_splits is not None or splits > 16  # the plan fills the GPU


def test_conformance_kit_with_the_cute_plan():
    _require_cute()
    from specattn.testing import check_backend

    report = check_backend("triton", device="cuda", kinds=("decode",), models=("mla",),
                           level="full", decode_options={"plan": "cute"},
                           raise_on_failure=False)
    print(report)
    assert report.ok, report
    # Cases the kernel does not serve (fp32, per-branch mode) are skipped; the rest ran.
    assert report.passed >= 10, report


def test_conformance_kit_on_the_default_table(monkeypatch):
    """The kit on ``triton`` as it is built by default, at the full level: its K 8 cases (128
    query rows per request at H 16) take ``cute``, its smaller ones ``gluon-wl``; both must
    have served (the plans the table chose are recorded)."""
    _require_cute()
    from specattn.backends.triton import plans
    from specattn.testing import check_backend

    chosen = []
    choose = plans.choose_plan

    def recording(*args, **kwargs):
        plan = choose(*args, **kwargs)
        chosen.append(plan.name)
        return plan

    monkeypatch.setattr(plans, "choose_plan", recording)
    report = check_backend("triton", device="cuda", kinds=("decode",), models=("mla",),
                           level="full", raise_on_failure=False)
    print(report)
    assert report.ok, report
    assert report.passed >= 10, report
    assert "cute" in chosen and "gluon-wl" in chosen, sorted(set(chosen))
