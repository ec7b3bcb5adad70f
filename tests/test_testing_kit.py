"""The conformance kit itself: a one-file backend passes it, broken ones fail it with a message
that says what broke, and the kit's own plumbing (reports, plans, declared limits, pytest
entry) behaves as documented."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from specattn import DraftDecodeBackend, DraftExtendBackend
from specattn.backends.torch_ref import reference_decode, reference_extend
from specattn.data import AttentionLayer, DraftBatch
from specattn.errors import InvalidInputError
from specattn.fp8 import KV_DTYPES_WITH_FP8
from specattn.platforms import any_platform
from specattn.testing import ConformanceError, check_backend, conformance_tests
from specattn.testing.plan import plan_cases
from specattn.testing.soak import _round_case, soak, soak_parallel
from specattn.testing.target import Target

# --- a backend as a user writes it, with the graph protocol on fixed buffers ----------------


class _Decode(DraftDecodeBackend):
    """Reference math on the base class's protocol; the graph path keeps its own copy of the
    round (as a backend with kernel-side buffers does). The class attributes switch on one
    mistake each (the kit must catch every one)."""

    supports_cuda_graph = True
    path_as_lane = False      # computes path trees as lanes
    skip_kv_write = False     # claims its kernel stores the new KV, then never does
    stale_padding = False     # a replay refreshes only the requests that are not padding
    ignore_scales = False     # reads FP8 codes as values (k_scale = v_scale = 1)
    stale_scales = False      # keeps the FP8 scale values of its first call (a host copy)
    fixed_scaling = False     # softmax scale 1/sqrt(head width) instead of layer.scaling
    parents_at_plan = False   # a graph round reads `parents` when its metadata is made
    int64_lengths = False     # reads the lengths' storage as int64 whatever their dtype
    empty_prefix_nan = False  # merges an empty prefix's pass as 0 / 0 (NaN lanes)
    q_shaped_output = False   # allocates its output like q (the key width, not v_head_dim)

    def _kernel_writes_kv(self):
        return self.skip_kv_write

    def _alloc_graph_buffers(self, max_bs, max_num_tokens):
        dev = self.runner.device
        self.mine = DraftBatch(torch.zeros(max_bs, dtype=torch.long, device=dev),
                               torch.zeros(max_bs, dtype=torch.long, device=dev),
                               torch.zeros(max_bs, self.topk, self.num_steps, dtype=torch.long,
                                           device=dev))

    def _plan_graph(self, batch, *, capture):
        rows = batch.batch_size
        if self.stale_padding and not capture:
            rows = int((batch.req_pool_indices != 0).sum())  # engines pad with request 0
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
            getattr(self.mine, name)[:rows] = getattr(batch, name)[:rows]
        bs = batch.batch_size
        parents = batch.parents
        if self.parents_at_plan and parents is not None:
            parents = parents.clone()  # the draft loop fills them later, inside the graph
        self.batch = DraftBatch(self.mine.req_pool_indices[:bs], self.mine.seq_lens[:bs],
                                self.mine.out_cache_loc[:bs], parents)

    def _attend(self, step, layer, q, k, v):
        mode = "lane" if self.path_as_lane else self.tree_mode
        if self.ignore_scales:
            layer = AttentionLayer(layer.layer_id, layer.scaling, layer.logit_cap)
        if self.stale_scales:
            kept = self.__dict__.setdefault("kept", (float(layer.k_scale),
                                                     float(layer.v_scale)))
            layer = AttentionLayer(layer.layer_id, layer.scaling, layer.logit_cap, *kept)
        if self.fixed_scaling:
            layer = AttentionLayer(layer.layer_id, 1 / math.sqrt(q.shape[-1]),
                                   layer.logit_cap, layer.k_scale, layer.v_scale)
        batch = self.batch
        if self.int64_lengths and batch.seq_lens.dtype != torch.int64:
            # A kernel given an int64 pointer: entry b reads int32 entries 2b and 2b + 1.
            raw = batch.seq_lens.contiguous()
            lens = torch.cat([raw, torch.zeros_like(raw)]).view(torch.int64)[:raw.numel()]
            batch = DraftBatch(batch.req_pool_indices, lens, batch.out_cache_loc,
                               batch.parents)
        out = reference_decode(self.runner, layer, q, batch, step, mode)
        if self.empty_prefix_nan:
            empty = (batch.seq_lens == 0).repeat_interleave(self.topk)
            out[empty] = float("nan")
        return _like_q(out, q) if self.q_shaped_output else out


def _like_q(out, q):
    """``out`` written into a buffer of ``q``'s shape, as a kernel that sizes its output
    from the query would."""
    buf = torch.zeros_like(q)
    width = min(out.shape[-1], q.shape[-1])
    buf[..., :width] = out[..., :width]
    return buf


class _Extend(DraftExtendBackend):
    scale_output = 1.0  # != 1: an extend off by a few percent
    q_shaped_output = False

    def _attend(self, layer, q, k, v):
        out = reference_extend(self.runner, layer, q, self.batch) * self.scale_output
        return _like_q(out, q) if self.q_shaped_output else out


def _register(scoped_registry, decode_attrs=None, extend_attrs=None):
    """A registered decode + extend pair named ``mine`` with the given mistakes switched on."""

    class MyDecode(_Decode, name="mine", platforms=any_platform, priority=-5):
        pass

    class MyExtend(_Extend, name="mine", platforms=any_platform, priority=-5):
        pass

    for cls, attrs in ((MyDecode, decode_attrs), (MyExtend, extend_attrs)):
        for key, value in (attrs or {}).items():
            setattr(cls, key, value)
    return MyDecode, MyExtend


def _failures(report) -> dict[str, str]:
    return {r.case: r.detail for r in report.failures}


def test_a_correct_one_file_backend_passes(scoped_registry):
    _register(scoped_registry)
    report = check_backend("mine", models=("mha", "mla"))
    assert report.ok and report.failed == 0
    assert report.passed >= 60, str(report)
    graph = [r for r in report.results if r.case.startswith("decode/") and "/graph/" in r.case]
    assert graph and all(r.status == "passed" for r in graph), str(report)


def test_path_trees_computed_as_lanes_fail(scoped_registry):
    _register(scoped_registry, {"path_as_lane": True})
    with pytest.raises(ConformanceError) as info:
        check_backend("mine", kinds=("decode",), models=("mha",))
    failed = _failures(info.value.report)
    assert failed and all("/path/" in case or "/path" in case for case in failed), failed
    assert not any("/lane/" in case for case in failed), failed
    detail = next(iter(failed.values()))
    assert detail.startswith("step 1") or detail.startswith("step 2"), detail
    assert "first difference at lane" in detail and "(request" in detail, detail


def test_a_missing_kv_write_fails_and_says_so(scoped_registry):
    _register(scoped_registry, {"skip_kv_write": True})
    report = check_backend("mine", kinds=("decode",), models=("mla",),
                           raise_on_failure=False, select="numerics")
    assert report.failed and report.passed == 0
    for detail in _failures(report).values():
        assert "was never written (still poisoned)" in detail, detail
        assert detail.startswith("step 0, layer 1: pool kv_buffer[1]"), detail


def test_an_extend_off_by_three_percent_fails(scoped_registry):
    _register(scoped_registry, extend_attrs={"scale_output": 1.03})
    report = check_backend("mine", kinds=("extend",), models=("mha",), raise_on_failure=False,
                           select="numerics")
    failed = _failures(report)
    # Every dtype fails, bf16 included, through the relative error norm.
    assert {c.split("/")[3] for c in failed} == {"fp32", "bf16", "fp16"}, failed
    bf16 = next(d for c, d in failed.items() if "/bf16/" in c)
    assert "relative error norm" in bf16, bf16


def test_padding_rows_left_stale_fail(scoped_registry):
    _register(scoped_registry, {"stale_padding": True})
    report = check_backend("mine", kinds=("decode",), models=("mha",),
                           raise_on_failure=False, select="graph")
    failed = _failures(report)
    assert failed and all("/graph/" in case for case in failed), failed
    for detail in failed.values():  # a stray write into the pool, or a lane reading it
        assert detail.startswith("after replay 1: pool") and "no token writes it" in detail \
            or detail.startswith("replay 1 (2 requests padded to 3)"), detail


def test_fp8_cases_run_for_a_declared_fp8_backend_and_catch_ignored_scales(scoped_registry):
    dec, _ = _register(scoped_registry, {"kv_cache_dtypes": KV_DTYPES_WITH_FP8})
    report = check_backend("mine", kinds=("decode",), models=("mha", "mla"), select="kv-fp8")
    ids = {r.case for r in report.results if r.status == "passed"}
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        for model in ("mha", "mla"):
            assert {f"decode/{model}/numerics/bf16/k2/p16/path/kv-{kv}/ragged",
                    f"decode/{model}/engine/uint8_pools/bf16/k2/p1/path/kv-{kv}",
                    f"decode/{model}/graph/bf16/k2/p16/path/kv-{kv}/scale_change"} <= ids, ids
    dec.ignore_scales = True
    failed = _failures(check_backend("mine", kinds=("decode",), models=("mha",),
                                     select="kv-fp8", raise_on_failure=False))
    assert len(failed) == 6 and all("first difference at lane" in d for d in failed.values())


def test_a_graph_that_keeps_the_first_scales_fails_at_the_replay(scoped_registry):
    _register(scoped_registry, {"kv_cache_dtypes": KV_DTYPES_WITH_FP8, "stale_scales": True})
    report = check_backend("mine", kinds=("decode",), models=("mla",), select="scale_change",
                           raise_on_failure=False)
    failed = _failures(report)
    assert len(failed) == 2 and all(d.startswith("replay 1") for d in failed.values()), failed


def test_a_softmax_scale_from_the_head_width_fails(scoped_registry):
    """The kit's layers scale by ``1.25 / sqrt(width)``: a backend that derives the scale
    from the head width (DeepSeek's MLA is not scaled that way) instead of reading
    ``layer.scaling`` fails every numerics case, MHA and MLA."""
    _register(scoped_registry, {"fixed_scaling": True})
    report = check_backend("mine", kinds=("decode",), models=("mha", "mla"),
                           select="numerics/fp32", raise_on_failure=False)
    failed = _failures(report)
    assert report.passed == 0 and {c.split("/")[1] for c in failed} == {"mha", "mla"}, failed
    assert all("first difference at lane" in d for d in failed.values()), failed


def test_a_graph_that_reads_the_parents_with_the_metadata_fails(scoped_registry):
    """The draft loop writes ``parents[i]`` inside the graph just before step ``i``; a
    backend that takes them when the capture/replay metadata is made reads zeros."""
    _register(scoped_registry, {"parents_at_plan": True})
    report = check_backend("mine", kinds=("decode",), models=("mha",), select="graph",
                           raise_on_failure=False)
    failed = _failures(report)
    assert failed and all("/path" in case for case in failed), failed
    assert not any(case.endswith("/lane") for case in failed), failed
    assert all(d.startswith("capture batch, step 1") for d in failed.values()), failed


def test_an_eager_backend_that_keeps_the_first_scales_fails(scoped_registry):
    """A backend without CUDA graphs gets eager ``scale_change`` rounds instead: tensor
    scales whose values change between two rounds on one backend object."""
    _register(scoped_registry, {"kv_cache_dtypes": KV_DTYPES_WITH_FP8, "stale_scales": True,
                                "supports_cuda_graph": False})
    report = check_backend("mine", kinds=("decode",), models=("mla",), select="scale_change",
                           raise_on_failure=False)
    failed = _failures(report)
    assert set(failed) == {f"decode/mla/numerics/bf16/k2/p1/path/kv-{kv}/scale_change"
                           for kv in ("fp8_e4m3", "fp8_e5m2")}, failed
    assert all(d.startswith("round 1 (one-element tensor scales") for d in failed.values())


def test_a_backend_that_reads_int32_lengths_as_int64_fails(scoped_registry):
    """Engines pass int32 index tensors too (vLLM does; validation accepts both): the kit's
    ``engine/int32_index`` rounds give them, and only those fail here."""
    _register(scoped_registry, {"int64_lengths": True})
    report = check_backend("mine", kinds=("decode",), models=("mha", "mla"),
                           select="engine", raise_on_failure=False)
    failed = _failures(report)
    assert failed and all("/engine/int32_index" in case for case in failed), failed
    assert report.passed > 0


def test_a_backend_that_fails_an_empty_prefix_fails(scoped_registry):
    """A request may have no prefix yet (``seq_lens`` 0): ``numerics/.../empty_prefix``
    gives one, whose lanes attend their history only."""
    _register(scoped_registry, {"empty_prefix_nan": True})
    report = check_backend("mine", kinds=("decode",), models=("mha", "mla"),
                           select="numerics", raise_on_failure=False)
    failed = _failures(report)
    assert failed and all(case.endswith("/empty_prefix") for case in failed), failed
    assert report.passed > 0


def test_an_output_sized_like_the_query_fails_the_narrow_value_cases(scoped_registry):
    """MHA values may be narrower than the keys (``v_head_dim < head_dim``): the
    ``narrow_v`` cases catch an output sized from ``q``, which every other case accepts."""
    _register(scoped_registry, {"q_shaped_output": True}, {"q_shaped_output": True})
    report = check_backend("mine", models=("mha",), select="numerics",
                           raise_on_failure=False)
    failed = _failures(report)
    assert set(failed) == {"decode/mha/numerics/fp32/k2/p1/path/narrow_v",
                           "extend/mha/numerics/fp32/p1/narrow_v"}, failed
    assert all("shape" in d for d in failed.values()), failed
    assert report.passed > 10


def test_known_limits_are_reported_not_run(scoped_registry):
    dec, _ = _register(scoped_registry, {"path_as_lane": True})
    dec.known_limits = {"decode/*/path/*": "paths computed as lanes (on purpose, for a test)",
                        "decode/*/*/path": "as above", "decode/*/*/*/path": "as above",
                        "decode/*/*/*/*/*/path/*": "as above"}
    report = check_backend("mine", kinds=("decode",), models=("mha",))
    limited = [r for r in report.results if r.status == "declared limit"]
    assert limited and all("path" in r.case for r in limited)
    assert "declared limits" in report.summary()


def test_plan_reads_capabilities(scoped_registry):
    dec, _ = _register(scoped_registry)
    dec.max_topk = 1
    dec.tree_modes = frozenset({"lane"})
    dec.page_sizes = frozenset({1})
    dec.dtypes = (torch.bfloat16,)
    ids = [c.id for c, why in plan_cases(Target.build("mine"), kinds=("decode",),
                                         models=("mha",)) if why is None]
    assert ids and all("/k1/" in i or "/refuses/" in i for i in ids), ids
    assert not any("/path" in i or "/p16/" in i or "/fp16/" in i for i in ids), ids


def test_an_unregistered_class_pair_can_be_checked(empty_registry):
    class Dec(_Decode):
        pass

    class Ext(_Extend):
        pass

    report = check_backend([Dec, Ext], models=("mha",), select="numerics/fp32")
    assert report.ok and report.passed >= 6


def test_unknown_names_and_bad_levels_are_refused():
    with pytest.raises(ValueError, match="Did you mean 'triton'"):
        check_backend("tritn")
    with pytest.raises(InvalidInputError, match="level"):
        check_backend("torch_ref", level="everything")


def test_report_text_lists_failures_first(scoped_registry):
    _register(scoped_registry, extend_attrs={"scale_output": 1.03})
    report = check_backend("mine", kinds=("extend",), models=("mha",), raise_on_failure=False,
                           select="extend/mha/numerics/fp32/p1/ragged")
    lines = str(report).splitlines()
    assert lines[0].startswith("specattn conformance of mine on cpu")
    assert lines[1].lstrip().startswith("FAIL  extend/mha/numerics/fp32/p1/ragged: layer 1:")


# The one-line pytest entry, as a third-party package uses it (torch_ref: fast, exact).
test_torch_ref_through_the_pytest_entry = conformance_tests(
    "torch_ref", models=("mla",), kinds=("extend",))


# A known bug as a strict xfail: the broken extend must fail these cases (an XPASS would fail).
test_known_bug_marked_as_expected_failure = conformance_tests(
    type("OffBy3", (_Extend,), {"scale_output": 1.03}), models=("mha",),
    kinds=("extend",), expected_failures={"extend/mha/numerics/*": "off by 3% on purpose",
                                          "extend/mha/isolation/*": "as above",
                                          "extend/mha/engine/*": "as above"})


def test_pytest_entry_warns_when_nothing_runs_here(scoped_registry):
    """A backend whose library is missing: every case skips, and a warning (shown by a plain
    ``pytest -q``, which hides skip reasons) says why instead of a bare "4 skipped"."""
    import warnings

    from specattn.testing import NothingRunsHereWarning

    class NeedsLib(_Decode, name="needs_lib", requires=(("no_such_lib_38", "no-such-lib"),)):
        pass

    with pytest.warns(NothingRunsHereWarning,
                      match=r"kit for needs_lib: no case runs here \(.*'no_such_lib_38' "
                            r"package, which is not installed.*`pytest -rs`"):
        conformance_tests("needs_lib")
    with warnings.catch_warnings():
        warnings.simplefilter("error", NothingRunsHereWarning)
        conformance_tests("torch_ref", kinds=("decode",))  # cases run: no warning


def test_check_backend_warns_when_no_case_ran(scoped_registry):
    """A constructor that refuses every shape the kit tries: every case skips and the
    report is ``ok``, so the kit says that nothing ran."""
    from specattn.errors import BackendUnavailableError
    from specattn.testing import NothingRunsHereWarning

    def refuse(self, *args, **kwargs):
        raise BackendUnavailableError("mine: refuses every shape", "mine")

    _register(scoped_registry, {"__init__": refuse})
    with pytest.warns(NothingRunsHereWarning, match=r"kit for mine: no case ran \(.*accepts "
                                                    r"none of the kit's shapes"):
        report = check_backend("mine", kinds=("decode",), models=("mha",))
    assert report.ok and report.passed == 0


def test_a_declared_soft_cap_that_is_refused_fails(scoped_registry):
    """A class that declares a soft cap (``soft_cap_models``) must serve it: refusing one
    fails the soft-cap cases; a class that declares none has them skipped, with why."""
    from specattn.errors import InvalidInputError as Refused

    def no_cap(self, step, layer, q, k, v):
        if layer.logit_cap > 0:
            raise Refused("layer.logit_cap", "0", layer.logit_cap)
        return _Decode._attend(self, step, layer, q, k, v)

    decode, _ = _register(scoped_registry, {"_attend": no_cap})
    with pytest.raises(ConformanceError) as info:
        check_backend("mine", kinds=("decode",), models=("mha",), select="softcap")
    assert any("refused a valid input" in d for d in _failures(info.value.report).values())
    decode.soft_cap_models = frozenset()
    from specattn.testing import NothingRunsHereWarning

    with pytest.warns(NothingRunsHereWarning):  # the only cases selected are skipped
        report = check_backend("mine", kinds=("decode",), models=("mha",), select="softcap")
    assert report.passed == 0 and report.skipped > 0
    assert all("declares no logit soft cap for MHA" in r.detail for r in report.results)


def test_a_refusal_that_blames_another_argument_fails(scoped_registry):
    """The kit's refusals check which argument the error blames, not that the name shows up
    somewhere in the message (``q`` or ``k`` nearly always do)."""
    def blame_seq_lens(self, step, layer, q, k, v):
        raise InvalidInputError("batch.seq_lens", "anything", "q and k look fine")

    _register(scoped_registry, {"forward": blame_seq_lens})
    with pytest.raises(ConformanceError) as info:
        check_backend("mine", kinds=("decode",), models=("mha",), select="refuses/q_wrong")
    failures = _failures(info.value.report)
    assert failures and all("does not name 'q' as the argument" in d for d in failures.values())


def test_check_backend_says_first_that_it_raises_on_a_failure():
    summary = check_backend.__doc__.split("\n\n")[0]
    assert "return its report" in summary and "raise ``ConformanceError``" in summary
    assert "``raise_on_failure=False``" in summary


def test_pytest_entry_rejects_unknown_options():
    with pytest.raises(TypeError, match="unexpected options"):
        conformance_tests("torch_ref", colour="blue")


def test_cases_are_frozen_values():
    case = plan_cases(Target.build("torch_ref"))[0][0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        case.id = "x"


# --- the soak -----------------------------------------------------------------------------------


def test_soak_gives_every_mismatch_its_seed_and_the_seed_replays_it(scoped_registry):
    _register(scoped_registry, extend_attrs={"scale_output": 1.03})
    lines: list[str] = []
    result = soak("mine", rounds=16, seed=100, graph_every=0, max_len=40, log=lines.append)
    assert result.rounds == 16 and result.passed + len(result.failures) + result.skipped == 16
    seeds = [seed for seed, _, _ in result.failures]
    assert seeds and set(seeds) <= set(range(100, 116))
    assert all(case.startswith(f"soak/{seed}/extend/") for seed, case, _ in result.failures)
    assert result.passed > 0  # the decode rounds are right
    assert any(f"seed {seeds[0]}" in line for line in lines)
    again = soak("mine", rounds=1, seed=seeds[0], graph_every=0, max_len=40, log=lines.append)
    assert [case for _, case, _ in again.failures] == [result.failures[0][1]]


def test_soak_leaves_out_the_rounds_of_a_declared_limit(scoped_registry):
    """A round whose case id matches one of the class's ``known_limits`` is not run (not
    applicable, as the kit reports such a case), so a declared limit is not a mismatch."""
    _register(scoped_registry, extend_attrs={
        "scale_output": 1.03, "known_limits": {"*/extend/*": "scaled on purpose"}})
    result = soak("mine", rounds=16, seed=100, graph_every=0, max_len=40, log=lambda *_: None)
    assert not result.failures and result.skipped > 0 and result.passed > 0


def test_soak_split_over_workers_runs_the_same_rounds():
    one = soak("torch_ref", rounds=6, seed=7, max_len=30, graph_every=0, log=lambda *_: None)
    two = soak_parallel("torch_ref", rounds=6, seed=7, workers=2, max_len=30, graph_every=0,
                        log=print)
    assert (two.rounds, two.passed, two.skipped) == (one.rounds, one.passed, one.skipped)
    assert one.passed >= 5 and not one.failures and not two.failures


def test_soak_draws_fp8_mha_pools_int32_indices_and_uint8_pools():
    """The soak's rounds cover what the kit gained after seeds were recorded: FP8 MHA pools
    (with scales other than 1), int32 index tensors, uint8 FP8 storage (only over FP8 pools);
    drawn from streams of their own, so the older draws of a seed stay what they were."""
    target = Target.build("torch_ref")
    cases = [_round_case(target, s, 0, 50, 1) for s in range(200)]
    mha_fp8 = [c for c in cases if c.model == "mha" and c.kv_cache_dtype != "auto"]
    assert {c.kind for c in mha_fp8} == {"decode", "extend"}
    assert {c.kv_cache_dtype for c in mha_fp8} == {"fp8_e4m3", "fp8_e5m2"}
    assert all(c.params["scales"] != (1.0, 1.0) for c in mha_fp8)
    styles = [c.params["style"] for c in cases]
    assert any(s.int32_index for s in styles) and not all(s.int32_index for s in styles)
    assert any(s.uint8_pools for s in styles)
    assert all(c.kv_cache_dtype != "auto" for c in cases if c.params["style"].uint8_pools)


def test_soak_same_config_shares_the_kernel_configuration_in_runs_of_seeds():
    target = Target.build("torch_ref")

    def config(seed: int, same: int) -> tuple[str, ...]:
        return tuple(_round_case(target, seed, 0, 50, same).id.split("/")[2:9])

    assert len({config(s, 10) for s in range(200, 210)}) == 1
    assert len({config(s, 10) for s in range(200, 260)}) > 1
    assert len({config(s, 1) for s in range(200, 210)}) > 1
    # Lengths still vary from seed to seed inside a run.
    lens = {str(_round_case(target, s, 0, 50, 10).params["lens"]) for s in range(200, 210)}
    assert len(lens) > 1


def test_soak_option_reaches_the_constructor_of_the_classes_that_take_it(scoped_registry,
                                                                         capsys):
    """``--option`` as in ``specattn bench``: a keyword goes to the classes whose constructor
    takes it (here decode only), the summary names it, and a bad one is refused."""
    from specattn.errors import InvalidInputError
    from specattn.testing.soak import main

    class SkewedDecode(_Decode, name="mine", platforms=any_platform, priority=-5):
        def __init__(self, runner, topk, num_steps, *, tree_mode="lane", skew: float = 1.0):
            super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
            self.skew = skew

        def _attend(self, step, layer, q, k, v):
            return super()._attend(step, layer, q, k, v) * self.skew

    class MyExtend(_Extend, name="mine", platforms=any_platform, priority=-5):
        pass

    common = ["--backend", "mine", "--rounds", "12", "--seed", "3", "--graph-every", "0",
              "--max-len", "40"]
    assert main(common) == 0
    assert "soak mine: 12 random rounds" in capsys.readouterr().out
    assert main(common + ["--option", "mine:skew=1.05"]) == 1
    out = capsys.readouterr().out
    assert "soak mine[skew=1.05]: 12 random rounds" in out and "/decode/" in out
    assert "/extend/" not in out  # the extend class does not take it: untouched
    with pytest.raises(InvalidInputError, match="--option"):
        main(common + ["--option", "mine:nope=1"])


def test_soak_option_keywords_split_between_the_classes_as_the_factory_splits_them(
        scoped_registry):
    """One option with a decode-only keyword and a shared one: the soak gives the extend
    class the shared keyword, as ``DraftBackendFactory`` does with the same
    ``backend_options`` (each keyword to every class that takes it), not nothing."""
    from specattn import DraftBackendFactory, SpecConfig
    from specattn.bench.options import parse_option
    from specattn.data import DraftRunner
    from specattn.testing.soak import _options_for

    class SkewedDecode(_Decode, name="mine", platforms=any_platform, priority=-5):
        def __init__(self, runner, topk, num_steps, *, tree_mode="lane", skew: float = 1.0,
                     chunk: int = 1):
            super().__init__(runner, topk, num_steps, tree_mode=tree_mode)

    class ChunkedExtend(_Extend, name="mine", platforms=any_platform, priority=-5):
        def __init__(self, runner, *, topk: int = 1, num_steps: int = 1, chunk: int = 1):
            super().__init__(runner, topk=topk, num_steps=num_steps)

    opt = parse_option("mine:skew=1.05,chunk=4")
    decode, extend, texts = _options_for("mine", [opt])
    assert decode == {"skew": 1.05, "chunk": 4} and extend == {"chunk": 4}
    assert texts == ["skew=1.05,chunk=4"]
    runner = DraftRunner.mha(2, 2, 16, num_layers=1, num_slots=64, max_reqs=2,
                             max_context_len=32)
    factory = DraftBackendFactory(SpecConfig(attention_backend="mine"), runner, 2, 3,
                                  backend_options={"mine": dict(opt.kwargs)})
    assert factory._options_for(SkewedDecode) == decode
    assert factory._options_for(ChunkedExtend) == extend


def test_an_option_a_class_refuses_for_a_case_skips_that_case(scoped_registry):
    """A caller's constructor option that the class refuses for some cases (here MLA, as the
    Triton backend refuses a Gluon ``config`` on MHA) skips those cases and names the option;
    the cases it fits still run (H200 soak, session 9: a forced config crashed every round it
    did not fit)."""

    class PickyDecode(_Decode, name="mine", platforms=any_platform, priority=-5):
        def __init__(self, runner, topk, num_steps, *, tree_mode="lane", flavor: str = "any"):
            super().__init__(runner, topk, num_steps, tree_mode=tree_mode)
            if flavor == "mha-only" and runner.use_mla_backend:
                raise InvalidInputError("flavor", "an MHA runner for 'mha-only'", flavor)

    class MyExtend(_Extend, name="mine", platforms=any_platform, priority=-5):
        pass

    report = check_backend("mine", models=("mha", "mla"),
                           decode_options={"flavor": "mha-only"})
    assert report.ok, str(report)
    decode = [r for r in report.results if r.case.startswith("decode/")]
    mla = [r for r in decode if "/mla/" in r.case]
    mha = [r for r in decode if "/mha/" in r.case]
    assert mla and all(r.status == "skipped" and "option 'flavor' does not apply" in r.detail
                       for r in mla), mla
    assert any(r.status == "passed" for r in mha)


def test_an_unregistered_subclass_is_labelled_by_its_own_name():
    """``check_backend([C])`` of an unregistered subclass of a registered class: its report
    is labelled ``C`` (it inherited the parent's ``name`` and read ``torch_ref``)."""
    from specattn.backends.torch_ref import TorchRefDecode, TorchRefExtend
    from specattn.testing import check_backend

    class Variant(TorchRefDecode):
        pass

    report = check_backend([Variant, TorchRefExtend], kinds=("decode",), models=("mha",),
                           level="quick", raise_on_failure=False)
    assert report.target == "Variant/torch_ref" and report.ok
