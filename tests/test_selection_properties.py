"""Properties of selection (``selection.md``): the factory against the table oracle, and
soundness, fidelity, alias transparency, order invariance, irrelevance, `auto` completeness.
"""

from __future__ import annotations

import logging
import random
import warnings
from types import SimpleNamespace

import pytest
from hypothesis import example, find, given, note, settings
from hypothesis import strategies as st

from specattn import DraftBackendFactory, DraftDecodeBackend, DraftExtendBackend, SpecConfig
from specattn._logging import reset_once_registry
from specattn.errors import BackendUnavailableError, SpecAttnError
from specattn.keys import BackendRequest
from specattn.platforms import Platform, Predicate
from specattn.registry import default_registry, scoped_registry
from specattn.selection import select

import oracle
import strategies as s

C = SpecConfig
CUDA10_FI = Platform("cuda", (10, 0), libraries={"flashinfer"})
CUDA9_ALL = Platform("cuda", (9, 0), libraries=set(oracle.LIBRARIES))
CPU_AMX = Platform("cpu", None, cpu_has_amx=True, libraries={"triton"})
CPU = Platform("cpu", None, libraries=frozenset())


def _both(config, mla, num_steps, topk, platform):
    context = f"config={config} mla={mla} num_steps={num_steps} topk={topk} {platform!r}"
    for kind in oracle.KINDS:
        exp = oracle.expected(kind, config, mla, num_steps, topk, platform)
        got = oracle.factory_outcome(kind, config, mla, num_steps, topk, platform)
        note(f"{kind}: oracle {exp!r}, factory {got!r}")
        oracle.assert_matches(exp, got, f"{kind} {context}")


def test_pending_now_is_current():
    """The oracle's PENDING_NOW names exactly the registered names whose classes are pending
    (a name is pending when all its classes are)."""
    by_name: dict[str, list[bool]] = {}
    for kind in oracle.KINDS:
        for cls in default_registry.classes(kind):
            by_name.setdefault(cls.name, []).append(bool(cls.pending))
    pending = {n for n, flags in by_name.items() if all(flags)}
    mixed = {n for n, flags in by_name.items() if any(flags) and not all(flags)}
    assert not mixed, f"partly pending names, refine the oracle: {sorted(mixed)}"
    assert pending == oracle.PENDING_NOW, (
        f"update PENDING_NOW in tests/oracle.py: landed {sorted(oracle.PENDING_NOW - pending)}"
        f", newly pending {sorted(pending - oracle.PENDING_NOW)}")


def test_strategies_reach_every_case():
    """Meta-test: the strategies produce every device, both override states and every kind
    of name (so the properties below are not vacuous). Derandomized: deterministic."""
    seen = {"devices": set(), "names": set(), "flags": set(), "caps": set()}

    @settings(database=None, max_examples=600, derandomize=True)
    @given(config=s.configs(), platform=s.platforms())
    def collect(config, platform):
        seen["devices"].add(platform.device)
        seen["caps"].add(platform.capability)
        seen["flags"].add((platform.device == "cpu", platform.cpu_has_amx,
                           platform.triton_interpret))
        seen["names"].update({config.attention_backend, config.decode_attention_backend,
                              config.prefill_attention_backend,
                              config.speculative_draft_attention_backend})

    collect()
    assert seen["devices"] == set(s.DEVICES)
    caps = seen["caps"] & set(s.CUDA_CAPABILITIES)
    assert len(caps) >= 8 and {(8, 0), (9, 0), (10, 0)} <= caps
    assert caps & {(11, 0), (12, 0), (12, 1)}  # Blackwell beyond SM100
    assert (True, True, True) in seen["flags"] and (True, False, False) in seen["flags"]
    missing = (set(oracle.KNOWN_NAMES) | {"auto", None, ""}) - seen["names"]
    assert not missing, missing
    assert seen["names"] - set(oracle.KNOWN_NAMES) - {"auto", None, ""}  # other strings
    assert find(s.configs(override=True), lambda c: True).speculative_draft_attention_backend
    assert find(s.configs(override=False),
                lambda c: True).speculative_draft_attention_backend is None


# --- outcome == oracle -------------------------------------------------------------------------

@given(config=s.configs(), mla=s.mla_flags, num_steps=s.num_steps, topk=s.topks,
       platform=s.platforms())
@example(config=C(attention_backend="cutedsl_mla", page_size=64), mla=True, num_steps=3,
         topk=1, platform=CUDA10_FI)
@example(config=C(attention_backend="cutedsl_mla"), mla=False, num_steps=3, topk=1,
         platform=CUDA10_FI)
@example(config=C(attention_backend="hybrid_linear_attn"), mla=False, num_steps=4, topk=2,
         platform=CPU_AMX)
@example(config=C(attention_backend="hybrid_linear_attn"), mla=False, num_steps=4, topk=2,
         platform=Platform("cuda", (12, 0), libraries={"triton"}))
@example(config=C(attention_backend="hybrid_linear_attn"), mla=True, num_steps=4, topk=2,
         platform=Platform("cuda", (8, 0), libraries={"flash_attn_interface"}))
@example(config=C(attention_backend="trtllm_mha", page_size=64), mla=False, num_steps=3,
         topk=1, platform=CUDA9_ALL)
@example(config=C(attention_backend="flashinfer"), mla=True, num_steps=3, topk=1,
         platform=CUDA9_ALL)
@example(config=C(attention_backend="fa3"), mla=False, num_steps=3, topk=1,
         platform=Platform("cuda", (9, 0), libraries={"flash_attn.cute"}))
@example(config=C(attention_backend="dsv4"), mla=True, num_steps=3, topk=1,
         platform=Platform("npu", libraries={"torch_npu"}))
@example(config=C(attention_backend="flashmla", page_size=64), mla=False, num_steps=0,
         topk=1, platform=CPU)
@example(config=C(attention_backend="torch_ref", speculative_draft_attention_backend="",
                  prefill_attention_backend="flashinfr"), mla=False, num_steps=2, topk=1,
         platform=CPU)
@example(config=C(attention_backend="triton", decode_attention_backend="nsa",
                  speculative_attention_mode="decode"), mla=True, num_steps=2, topk=4,
         platform=Platform("hip", libraries={"triton"}))
@example(config=C(attention_backend="torch_ref", decode_attention_backend=""), mla=False,
         num_steps=2, topk=1, platform=CPU)
@example(config=C(), mla=False, num_steps=5, topk=4, platform=CPU)
@example(config=C(attention_backend="auto", page_size=128), mla=True, num_steps=5, topk=4,
         platform=Platform("cpu", triton_interpret=True, libraries={"triton"}))
def test_outcome_matches_oracle(config, mla, num_steps, topk, platform):
    _both(config, mla, num_steps, topk, platform)


@pytest.mark.parametrize("override", [True, False], ids=["override-set", "override-unset"])
@given(data=st.data())
def test_outcome_matches_oracle_with_and_without_override(override, data):
    config = data.draw(s.configs(override=override), label="config")
    _both(config, data.draw(s.mla_flags, label="mla"), data.draw(s.num_steps, label="steps"),
          data.draw(s.topks, label="topk"), data.draw(s.platforms(), label="platform"))


# --- rule 1 ------------------------------------------------------------------------------------

@given(config=s.configs(), mla=s.mla_flags, num_steps=s.num_steps, topk=s.topks,
       platform=s.platforms())
def test_decode_is_none_iff_at_most_one_step(config, mla, num_steps, topk, platform):
    got = oracle.factory_outcome("decode", config, mla, num_steps, topk, platform)
    if num_steps <= 1:
        assert got is None
    else:
        assert got is not None  # a class or an error, never a silent None


# --- soundness and explicit-name fidelity ------------------------------------------------------

@given(config=s.configs(), mla=s.mla_flags, num_steps=s.num_steps, topk=s.topks,
       platform=s.platforms(), tree_mode=st.sampled_from(("lane", "path")))
@example(config=C(attention_backend="torch_ref"), mla=True, num_steps=3, topk=4,
         platform=CPU, tree_mode="path")
def test_selected_class_is_sound_and_faithful(config, mla, num_steps, topk, platform,
                                              tree_mode):
    factory = DraftBackendFactory(config, SimpleNamespace(use_mla_backend=mla), topk,
                                  num_steps, tree_mode=tree_mode, platform=platform)
    for kind in oracle.KINDS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                sel = (factory.explain_decode_backend() if kind == "decode"
                       else factory.explain_draft_extend_backend())
            except SpecAttnError:
                continue
        cls = sel.backend
        if cls is None:
            continue
        request = factory.request(kind)
        assert cls.kind == kind
        assert cls.validate(request, platform) == [], "selected class rejects the request"
        assert cls.is_registered()
        name = config.backend_name(kind)
        if name is None or name == "auto":
            assert cls.auto_eligible
            continue
        assert name == cls.name or name in cls.aliases + cls.deprecated_aliases \
            or _dispatches_to(kind, name, platform, cls.name), \
            f"{name!r} gave {cls.qualified_name()} registered as {cls.name!r}"


def _dispatches_to(kind, name, platform, target):
    dispatcher = default_registry.dispatcher(kind, name)
    if dispatcher is None:
        return False
    route = next((r for r in dispatcher.routes if r.when(platform)), None)
    return route is not None and route.target == target


# --- alias transparency ------------------------------------------------------------------------

def _same(a, b):
    if isinstance(a, Exception) or isinstance(b, Exception):
        return type(a) is type(b) and str(a) == str(b) and getattr(a, "reasons", None) == \
            getattr(b, "reasons", None)
    return a is b


@given(kind=s.kinds, mla=s.mla_flags, num_steps=s.num_steps, topk=s.topks,
       platform=s.platforms(), page_size=s.page_sizes,
       field=st.sampled_from(("attention_backend", "speculative_draft_attention_backend",
                              "decode_attention_backend", "prefill_attention_backend")))
def test_nsa_is_dsa(kind, mla, num_steps, topk, platform, page_size, field):
    def outcome(name):
        config = SpecConfig(page_size=page_size, speculative_attention_mode="decode",
                            **{field: name})
        return oracle.factory_outcome(kind, config, mla, num_steps, topk, platform)

    assert _same(outcome("nsa"), outcome("dsa"))


@given(mla=s.mla_flags, num_steps=s.num_steps, topk=s.topks, platform=s.platforms(),
       page_size=s.page_sizes)
@example(mla=True, num_steps=3, topk=1, platform=CUDA10_FI, page_size=64)
def test_cutedsl_mla_extend_is_trtllm_mla_extend(mla, num_steps, topk, platform, page_size):
    def outcome(name):
        return oracle.factory_outcome("extend", SpecConfig(attention_backend=name,
                                                           page_size=page_size),
                                      mla, num_steps, topk, platform)

    assert _same(outcome("cutedsl_mla"), outcome("trtllm_mla"))


# --- fake backends: order invariance, irrelevance, auto completeness ---------------------------

_FAKE_NAMES = ("alpha", "beta", "gamma", "delta")
_FAKE_PREDICATES = (
    Predicate(lambda p: True, "any platform"),
    Predicate(lambda p: p.device == "cuda", "CUDA"),
    Predicate(lambda p: p.device == "cpu", "the CPU"),
    Predicate(lambda p: p.device in ("cuda", "hip"), "CUDA or HIP"),
    Predicate(lambda p: p.cpu_has_amx, "AMX"),
)


@st.composite
def fake_specs(draw):
    """Declarations of fake backend classes: unique (kind, name, flavour) each."""
    n = draw(st.integers(1, 10))
    specs = []
    for i in range(n):
        specs.append({
            "id": i,
            "kind": draw(s.kinds),
            "name": draw(st.sampled_from(_FAKE_NAMES)),
            "flavour": f"f{i}",
            "platforms": draw(st.sampled_from(_FAKE_PREDICATES)),
            "models": draw(st.sampled_from((("mha",), ("mla",), ("mha", "mla")))),
            "priority": draw(st.integers(0, 3)),
            "page_sizes": draw(st.sampled_from((None, frozenset({1}), frozenset({64})))),
            "auto_eligible": draw(st.booleans()),
            "alias": draw(st.booleans()),
        })
    return specs


def _make(spec):
    base = DraftDecodeBackend if spec["kind"] == "decode" else DraftExtendBackend
    body = {"__module__": "fakes", "__qualname__": f"Fake{spec['id']}",
            "page_sizes": spec["page_sizes"], "auto_eligible": spec["auto_eligible"],
            "init_forward_metadata": lambda self, batch: None,
            "forward": lambda self, *args: None}
    aliases = (spec["name"] + "_x",) if spec["alias"] else ()
    return type(f"Fake{spec['id']}", (base,), body, name=spec["name"],
                flavour=spec["flavour"], platforms=spec["platforms"], models=spec["models"],
                priority=spec["priority"], aliases=aliases)


def _build(specs):
    with scoped_registry(empty=True) as registry:
        for spec in specs:
            _make(spec)
    return registry


def _answer(kind, name, request, platform, registry):
    try:
        sel = select(kind, name, request, platform, registry)
    except SpecAttnError as exc:
        return (type(exc).__name__, sorted(getattr(exc, "reasons", {}).items()))
    return None if sel.backend is None else sel.backend.qualified_name()


_QUERY_NAMES = _FAKE_NAMES + tuple(n + "_x" for n in _FAKE_NAMES) + ("auto", None, "omega")


@given(specs=fake_specs(), data=st.data(), platform=s.platforms(), mla=s.mla_flags,
       page_size=st.sampled_from((1, 64)))
def test_order_invariance(specs, data, platform, mla, page_size):
    shuffled = data.draw(st.permutations(specs), label="registration order")
    first, second = _build(specs), _build(shuffled)
    for kind in oracle.KINDS:
        request = BackendRequest(kind=kind, mla=mla, page_size=page_size, num_steps=3)
        for name in _QUERY_NAMES:
            assert _answer(kind, name, request, platform, first) == \
                _answer(kind, name, request, platform, second), (kind, name)


@given(specs=fake_specs(), platform=s.platforms(), mla=s.mla_flags,
       page_size=st.sampled_from((1, 64)))
def test_auto_completeness_on_fake_registries(specs, platform, mla, page_size):
    registry = _build(specs)
    for kind in oracle.KINDS:
        request = BackendRequest(kind=kind, mla=mla, page_size=page_size, num_steps=3)
        eligible = [c for c in registry.classes(kind)
                    if c.auto_eligible and not c.validate(request, platform)]
        try:
            chosen = select(kind, "auto", request, platform, registry).backend
        except BackendUnavailableError:
            assert not eligible, "auto raised although a class can serve the request"
            continue
        assert chosen in eligible, "auto picked a class that is not eligible"
        best = max(c.priority_on(platform) for c in eligible)
        assert chosen.priority_on(platform) == best


@given(config=s.configs(), mla=s.mla_flags, num_steps=s.num_steps, topk=s.topks,
       platform=s.platforms())
def test_auto_completeness_on_builtins(config, mla, num_steps, topk, platform):
    factory = DraftBackendFactory(config, SimpleNamespace(use_mla_backend=mla), topk,
                                  max(num_steps, 2), platform=platform)
    for kind in oracle.KINDS:
        request = factory.request(kind)
        eligible = [c for c in default_registry.classes(kind)
                    if c.auto_eligible and not c.validate(request, platform)]
        try:
            chosen = select(kind, None, request, platform).backend
        except BackendUnavailableError:
            assert not eligible
            continue
        assert chosen.auto_eligible and chosen in eligible
        assert oracle.expected(kind, SpecConfig(page_size=config.page_size), mla,
                               max(num_steps, 2), topk, platform) == \
            ("class", chosen.name, chosen.flavour)


@given(config=s.configs(), mla=s.mla_flags, num_steps=s.num_steps, topk=s.topks,
       platform=s.platforms(), data=st.data())
def test_irrelevant_class_changes_nothing(config, mla, num_steps, topk, platform, data):
    kind = data.draw(s.kinds, label="kind of the new class")
    names = [n for n in default_registry.names(kind) if default_registry.dispatcher(kind, n)
             is None] + ["zeta_new"]
    name = data.draw(st.sampled_from(names), label="name of the new class")
    mla_only = all(c.models == frozenset({"mla"})
                   for c in default_registry.classes(kind, name)) and name != "zeta_new"
    models = ("mla",) if mla_only else data.draw(
        st.sampled_from((("mha",), ("mla",), ("mha", "mla"))), label="models")
    before = oracle.factory_outcome(kind, config, mla, num_steps, topk, platform)
    with scoped_registry() as registry:
        never = Predicate(lambda p: False, "no platform at all")
        base = DraftDecodeBackend if kind == "decode" else DraftExtendBackend
        new = type("Irrelevant", (base,), {"__module__": "fakes",
                                           "init_forward_metadata": lambda self, b: None,
                                           "forward": lambda self, *a: None},
                   name=name, flavour="irrelevant", platforms=never, models=models,
                   priority=10**6)
        after = oracle.factory_outcome(kind, config, mla, num_steps, topk, platform,
                                       registry=registry)
    if isinstance(before, Exception):
        assert type(after) is type(before), (before, after)
        if isinstance(before, BackendUnavailableError):
            extra = {new.qualified_name()}
            assert set(after.reasons) - extra == set(before.reasons)
        elif not isinstance(before, oracle.UnknownBackendError):
            assert str(after) == str(before)
        else:
            assert str(after).split(".")[0] == str(before).split(".")[0]
    else:
        assert after is before


# --- warnings ----------------------------------------------------------------------------------

def test_nsa_warns_deprecation_once():
    reset_once_registry()
    config = SpecConfig(attention_backend="nsa")
    factory = DraftBackendFactory(config, SimpleNamespace(use_mla_backend=True), 1, 3,
                                  platform=CPU)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with pytest.raises(BackendUnavailableError):
                factory.resolve_decode_backend()
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1, [str(w.message) for w in caught]
    assert "'nsa'" in str(deprecations[0].message) and "'dsa'" in str(deprecations[0].message)
    reset_once_registry()
    with pytest.warns(DeprecationWarning, match="nsa"):
        with pytest.raises(BackendUnavailableError):
            factory.resolve_draft_extend_backend()


@pytest.mark.parametrize("mla", [True, False])
def test_flashmla_extend_is_none_with_the_original_warning(caplog, mla):
    reset_once_registry()
    factory = DraftBackendFactory(SpecConfig(attention_backend="flashmla", page_size=64),
                                  SimpleNamespace(use_mla_backend=mla), 1, 3,
                                  platform=CUDA9_ALL)
    with caplog.at_level(logging.WARNING, logger="specattn"):
        assert factory.resolve_draft_extend_backend() is None
        assert factory.create_draft_extend_backend() is None
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert oracle.FLASHMLA_EXTEND_WARNING in messages
    assert messages.count(oracle.FLASHMLA_EXTEND_WARNING) == 1  # once per process


def test_random_order_of_builtins_is_irrelevant():
    """Re-register the built-in classes in random orders: every answer stays the same."""
    builtins = [c for k in oracle.KINDS for c in default_registry.classes(k)]
    rng = random.Random(0)
    requests = [BackendRequest(kind=k, mla=m, page_size=p, num_steps=3)
                for k in oracle.KINDS for m in (False, True) for p in (1, 64)]
    platforms = [CPU, CPU_AMX, CUDA10_FI, CUDA9_ALL, Platform("hip", libraries={"triton"})]
    answers = None
    for _ in range(3):
        order = builtins[:]
        rng.shuffle(order)
        with scoped_registry(empty=True) as registry, warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            for cls in order:
                registry.register(cls)
            for d in default_registry.dispatchers("decode") + \
                    default_registry.dispatchers("extend"):
                registry.add_dispatcher(d)
            got = [_answer(r.kind, n, r, p, registry) for r in requests for p in platforms
                   for n in oracle.KNOWN_NAMES + ("auto",)]
        assert answers is None or got == answers
        answers = got
