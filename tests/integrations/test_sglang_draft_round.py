"""``specattn.integrations.sglang.draft_round`` on the CPU: SGLang's real
``EAGLEDraftCudaGraphRunner`` (its buffers, the padding of a batch smaller than the captured
one, the metadata calls; an eager stand-in for the CUDA graph) over SGLang's Triton draft
backend and over specattn through the plugin give the eager round; the records and the
float32 tree reference see what the round did."""

from __future__ import annotations

import pytest
import torch

from specattn.integrations.sglang import draft_round as R

TOL = 1e-4
SHAPE = (4, 2, 16)


@pytest.fixture
def fixture(sglang_cpu):
    fx = R.build_fixture("mha", (5, 11, 2), shape=SHAPE, page_size=4, steps=3, topk_max=2,
                         graph_bs=4, hidden=32, vocab=50, dtype=torch.float32, device="cpu")
    case = R.RoundCase("mha", (5, 11, 2), 2, 3, 4, SHAPE, 32, 50, capture_bs=4)
    return fx, fx.use(case, "triton")


def test_graph_runner_replays_the_eager_round_stock_and_specattn(fixture):
    fx, settings = fixture
    model, inputs, saved = R.DraftModel(fx), fx.inputs(), fx.snapshot()
    stock = R.make_container(fx, None)
    ref = R.run_eager(fx, stock, settings, model, inputs)
    fx.restore(saved)
    assert len(set(ref.tree[2].flatten().tolist())) > 2  # a real draft, not a constant
    assert R.check_tree(fx, ref, "lane", TOL)[0]
    for env in (None, {"SPECATTN_SGLANG": "1"}):
        container = R.make_container(fx, env)
        graph = R.capture_graph_recorded(fx, container, settings, model)
        assert graph.max_bs == 4 and fx.batch == 3  # the replay pads one request
        fx.restore(saved)
        got = R.run_graph(fx, graph, model, inputs, container)
        fx.restore(saved)
        verdict = R.compare(ref, got, 2, TOL)
        assert verdict.ok and verdict.tokens_equal == 3, verdict.problems
        tree = R.execute_tree(fx, graph, inputs)
        assert all(torch.equal(a, b) for a, b in zip(tree, ref.tree))


def test_path_mode_attends_to_the_ancestors(fixture):
    fx, settings = fixture
    model, inputs = R.DraftModel(fx), fx.inputs()
    env = {"SPECATTN_SGLANG": "1", "SPECATTN_SGLANG_TREE_MODE": "path"}
    rec = R.run_eager(fx, R.make_container(fx, env), settings, model, inputs)
    ok, err, differ, rows = R.check_tree(fx, rec, "path", TOL)
    assert ok and 0 < differ < rows, (err, differ, rows)
    assert not R.check_tree(fx, rec, "lane", TOL)[0]  # the lane reference is another tree


@pytest.fixture
def stride_blind_mla_store(monkeypatch):
    """SGLang's MLA KV store on a GPU (the SM90 JIT ``set_mla_kv_buffer.cuh`` and the Triton
    ``set_mla_kv_buffer_kernel``) reads ``loc`` from its data pointer as if contiguous; on
    the CPU it scatters by indexing. This makes the CPU store read ``loc`` as the GPU does."""
    from sglang.kernels.ops.kvcache import mla_buffer

    naive = mla_buffer.set_mla_kv_buffer_naive

    def stride_blind(kv_buffer, loc, *args, **kwargs):
        return naive(kv_buffer, torch.as_strided(loc, (loc.numel(),), (1,)), *args, **kwargs)

    monkeypatch.setattr(mla_buffer, "set_mla_kv_buffer_naive", stride_blind)


def test_mla_draft_kv_lands_in_its_slots_eager_and_in_a_padded_replay(
        sglang_cpu, stride_blind_mla_store):
    """``draft_forward`` hands each step a strided view of ``out_cache_loc``; with the GPU's
    store the kit's MLA module wrote row ``r`` of step ``i`` to ``loc[i + r]`` and a padded
    replay's extra rows into real draft slots (the graph's KV then differed from the eager
    round's). The fixture's store takes a contiguous copy: every row lands in its own slot."""
    shape, topk = (4, 256, 32), 2
    fx = R.build_fixture("mla", (5, 11, 2), shape=shape, page_size=1, steps=3, topk_max=topk,
                         graph_bs=4, hidden=32, vocab=50, dtype=torch.float32, device="cpu")
    case = R.RoundCase("mla", (5, 11, 2), topk, 3, 1, shape, 32, 50, capture_bs=4)
    settings = fx.use(case, "triton")
    model, inputs, saved = R.DraftModel(fx), fx.inputs(), fx.snapshot()
    container = R.make_container(fx, None)
    ref = R.run_eager(fx, container, settings, model, inputs)
    fx.restore(saved)
    hidden = inputs["hidden_states"].repeat_interleave(topk, 0) + model.token_embed(
        inputs["topk_index"].flatten())
    _, k_nope, _, k_rope = fx.module.forward_absorb_prepare(hidden)
    step0 = torch.cat([k_nope.flatten(1), k_rope.flatten(1)], -1).view(fx.batch, topk, -1)
    assert R.rel_err(ref.kv[:, :, 0], step0) < TOL  # step 0's rows in their own slots
    graph = R.capture_graph_recorded(fx, container, settings, model)
    fx.restore(saved)
    got = R.run_graph(fx, graph, model, inputs, container)
    fx.restore(saved)
    verdict = R.compare(ref, got, topk, TOL)
    assert verdict.ok and verdict.kv_err < TOL, verdict.problems
