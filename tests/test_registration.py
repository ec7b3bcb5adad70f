"""The registration contract of ``__init_subclass__`` (PEP 487): opt-in, validated
declarations, loud duplicates, no inherited registration, no vendor import at import time."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from specattn import DraftBackend, DraftDecodeBackend, DraftExtendBackend
from specattn.errors import DuplicateBackendError, NotRegisteredError, RegistrationError
from specattn.platforms import Platform, is_cpu
from specattn.registry import Dispatcher, Route, default_registry

_BODY = {"init_forward_metadata": lambda self, batch: None,
         "forward": lambda self, *args: None}


def declare(cls_name="Fake", base=DraftDecodeBackend, **keywords):
    return type(cls_name, (base,), {"__module__": "fakes", **_BODY}, **keywords)


# --- opt-in ------------------------------------------------------------------------------------

def test_class_without_name_does_not_register(empty_registry):
    base = declare("IntermediateBase")
    assert not base.is_registered()
    assert empty_registry.names("decode") == []


def test_class_with_name_registers_into_the_active_registry_only(empty_registry):
    before = {k: default_registry.classes(k) for k in ("decode", "extend")}
    cls = declare("Mine", name="mine", aliases=("my",), platforms=is_cpu, models=("mha",),
                  priority={"cpu": 7}, kernel_library="torch")
    assert cls.is_registered() and cls.kind == "decode" and cls.name == "mine"
    assert empty_registry.classes("decode", "mine") == [cls]
    assert empty_registry.canonical("decode", "my") == ("mine", False)
    assert empty_registry.names("extend") == []
    assert {k: default_registry.classes(k) for k in ("decode", "extend")} == before
    assert "mine" not in default_registry.names("decode")


def test_declaration_is_recorded_as_data(empty_registry):
    cls = declare("Mine", base=DraftExtendBackend, name="mine", flavour="x",
                  requires=(("somelib", "some-lib"),), priority=3)
    assert cls.kind == "extend" and cls.flavour == "x"
    assert cls.requires == (("somelib", "some-lib"),)
    assert cls.priority_on(Platform("cuda", (9, 0))) == 3
    assert cls.models == frozenset({"mha", "mla"})
    described = cls.describe()
    assert described["name"] == "mine" and described["kind"] == "extend"
    assert described["class"] == "fakes.Mine"
    json.dumps(described)  # plain data


def test_registration_needs_a_kind(empty_registry):
    with pytest.raises(RegistrationError, match="subclass DraftDecodeBackend or"):
        declare("NoKind", base=DraftBackend, name="nokind")


@pytest.mark.parametrize("bases", [(DraftDecodeBackend, DraftExtendBackend),
                                   (DraftExtendBackend, DraftDecodeBackend)])
def test_one_class_for_both_kinds_fails_at_class_creation(empty_registry, bases):
    """It had registered as the kind its bases list first, to be called with the other's
    arguments."""
    with pytest.raises(RegistrationError) as info:
        type("Both", bases, {"__module__": "fakes", **_BODY}, name="both")
    assert str(info.value) == (
        "fakes.Both: expected a subclass of DraftDecodeBackend or of DraftExtendBackend, got "
        "one of both (one class per kind; the two classes may share name=)")
    assert empty_registry.names("decode") == empty_registry.names("extend") == []


def test_cooperative_keywords_pass_through_a_mixin(empty_registry):
    class Tagged:
        def __init_subclass__(cls, tag=None, **kwargs):
            cls.tag = tag
            super().__init_subclass__(**kwargs)

    cls = type("TaggedDecode", (Tagged, DraftDecodeBackend),
               {"__module__": "fakes", **_BODY}, name="tagged", tag="t1")
    assert cls.tag == "t1" and cls.is_registered()


# --- bad declarations --------------------------------------------------------------------------

@pytest.mark.parametrize("keywords,match", [
    (dict(name="x", colour="red"), "unknown class keyword"),
    (dict(aliases=("y",)), "without name="),
    (dict(name="X"), "lowercase"),
    (dict(name=""), "lowercase"),
    (dict(name=" x"), "lowercase"),
    (dict(name=3), "lowercase"),
    (dict(name="my-backend"), "lowercase identifier"),   # `--option NAME:KEY=VALUE`, paths
    (dict(name="a:b"), "lowercase identifier"),
    (dict(name="a/b"), "lowercase identifier"),
    (dict(name="my backend"), "lowercase identifier"),
    (dict(name="auto"), "not 'auto'"),                    # the request for the best backend
    (dict(name="x", aliases=("auto",)), "not 'auto'"),
    (dict(name="x", aliases=("x-y",)), "tuple of lowercase identifiers"),
    (dict(name="x", aliases="y"), "tuple of lowercase"),
    (dict(name="x", aliases=("Y",)), "tuple of lowercase"),
    (dict(name="x", deprecated_aliases=("",)), "tuple of lowercase"),
    (dict(name="x", flavour=""), "flavour"),
    (dict(name="x", platforms=lambda p: True), "Predicate"),
    (dict(name="x", models=()), "models"),
    (dict(name="x", models=("gqa",)), "models"),
    (dict(name="x", requires=("triton",)), "requires"),
    (dict(name="x", priority="high"), "priority"),
    (dict(name="x", priority=True), "priority"),
    (dict(name="x", priority={"cuda": 1.5}), "priority"),
    (dict(name="x", mla_required_name="x"), "mla_required_name"),
    (dict(name="x", aliases=None), "aliases= must be a tuple"),       # not a bare TypeError
    (dict(name="x", models=None), "models= must be"),
    (dict(name="x", requires=None), "requires= must be"),
    (dict(name="x", kernel_library=3), "kernel_library= must be a non-empty string"),
    (dict(name="x", replace="no"), "replace= must be a bool"),        # had replaced
    (dict(name="x", models=("mla",), mla_required_name=3), "mla_required_name= must be"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_declarations_raise(empty_registry, keywords, match):
    with pytest.raises(RegistrationError, match=match) as info:
        declare("Bad", **keywords)
    assert isinstance(info.value, TypeError)
    assert "fakes.Bad" in str(info.value)
    assert empty_registry.names("decode") == []


def test_a_predicate_that_cannot_be_called_fails_where_it_is_written():
    """``Predicate`` checks its function when built, and combines only with predicates: both
    mistakes had surfaced at the first selection, or as an ``AttributeError``."""
    from specattn.errors import InvalidInputError
    from specattn.platforms import Predicate, is_cuda

    with pytest.raises(InvalidInputError) as info:
        Predicate("cuda", "CUDA")
    assert str(info.value) == "Predicate.fn: expected a callable taking a Platform, got 'cuda'"
    with pytest.raises(InvalidInputError, match="Predicate.description"):
        Predicate(lambda p: True, "")
    with pytest.raises(InvalidInputError) as info:
        is_cuda | (lambda p: True)
    assert str(info.value) == ("the right operand of |: expected a specattn.platforms.Predicate "
                               "(a function wrapped as Predicate(fn, description)), got function")
    with pytest.raises(InvalidInputError, match="right operand of &"):
        is_cuda & "cpu"
    assert repr(is_cuda | is_cpu) == "Predicate('CUDA or the CPU')"


def test_a_predicate_that_raises_is_a_reason_of_its_class_only(scoped_registry):
    """A class's platform predicate that raises rejects that class, with what it raised; the
    others are still listed and selected (it had stopped ``list_backends`` and ``auto``)."""
    import specattn
    from specattn.keys import BackendRequest
    from specattn.platforms import Predicate
    from specattn.selection import select

    def probe(platform):
        raise RuntimeError("probe failed")

    cls = declare("Raises", name="raises", platforms=Predicate(probe, "a probed device"))
    cpu = Platform("cpu")
    assert cls.validate(BackendRequest(kind="decode"), cpu) == [
        "its platforms= predicate (a probed device) raised RuntimeError: probe failed"]
    row = next(r for r in specattn.list_backends(platform=cpu) if r.backend is cls)
    assert not row.runs_here and "raised RuntimeError: probe failed" in row.reason
    assert select("decode", "auto", BackendRequest(kind="decode"), cpu).backend is not None


@pytest.mark.parametrize("base,attend,expected", [
    (DraftDecodeBackend, lambda self, layer, q, k, v: q, "(self, layer, q, k, v)"),
    (DraftExtendBackend, lambda self, step, layer, q, k, v: q, "(self, step, layer, q, k, v)"),
])
def test_an_attend_with_the_other_kinds_arguments_fails_at_class_creation(empty_registry, base,
                                                                          attend, expected):
    """It had registered and failed with a ``TypeError`` at its first ``forward``."""
    kind = base.kind
    args = "step, layer, q, k, v" if kind == "decode" else "layer, q, k, v"
    with pytest.raises(RegistrationError) as info:
        type("Sig", (base,), {"__module__": "fakes", "_attend": attend}, name="sig")
    assert str(info.value) == (f"fakes.Sig: _attend: expected the {kind} hook's arguments "
                               f"(self, {args}, **options), got _attend{expected}")
    # Keyword-only parameters (a backend's own forward options) and defaults are fine.
    type("Kw", (base,), {"__module__": "fakes",
                         "_attend": lambda self, *a, sink=None, **o: a[-3]}, name="kw")


# --- duplicates and replacement ----------------------------------------------------------------

def test_duplicate_name_names_both_classes(empty_registry):
    declare("First", name="dup")
    with pytest.raises(DuplicateBackendError) as info:
        declare("Second", name="dup")
    assert "fakes.First" in str(info.value) and "fakes.Second" in str(info.value)
    assert isinstance(info.value, RegistrationError)
    assert [c.__qualname__ for c in empty_registry.classes("decode", "dup")] == ["First"]


def test_same_name_other_flavour_or_kind_is_fine(empty_registry):
    a = declare("A", name="dup", flavour="one")
    b = declare("B", name="dup", flavour="two")
    c = declare("C", base=DraftExtendBackend, name="dup", flavour="one")
    assert empty_registry.classes("decode", "dup") == [a, b]
    assert empty_registry.classes("extend", "dup") == [c]


def test_a_reloaded_module_replaces_its_own_classes(empty_registry, tmp_path, monkeypatch):
    """The same class statement run again (``importlib.reload``, a notebook cell re-run) is one
    definition: it had been a ``DuplicateBackendError`` naming the same class twice."""
    import importlib

    (tmp_path / "reloaded_backend.py").write_text(
        "from specattn import DraftDecodeBackend\n"
        "class Mine(DraftDecodeBackend, name='reloaded', aliases=('rl',)):\n"
        "    def _attend(self, step, layer, q, k, v):\n"
        "        return q\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("reloaded_backend")
    first = module.Mine
    importlib.reload(module)
    assert module.Mine is not first
    assert empty_registry.classes("decode", "reloaded") == [module.Mine]
    assert empty_registry.canonical("decode", "rl") == ("reloaded", False)
    monkeypatch.delitem(sys.modules, "reloaded_backend")
    with pytest.raises(DuplicateBackendError, match="fakes.Other"):  # another class still fails
        declare("Other", name="reloaded")


def test_replace_true_overrides_and_logs(empty_registry, caplog):
    declare("Old", name="dup")
    with caplog.at_level(logging.WARNING, logger="specattn"):
        new = declare("New", name="dup", replace=True)
    assert empty_registry.classes("decode", "dup") == [new]
    assert any("fakes.New replaces fakes.Old" in r.getMessage() for r in caplog.records)


def test_replace_can_override_a_builtin_in_a_scope(scoped_registry):
    builtin = default_registry.classes("decode", "torch_ref")[0]
    mine = declare("MyRef", name="torch_ref", replace=True)
    assert scoped_registry.classes("decode", "torch_ref") == [mine]
    assert default_registry.classes("decode", "torch_ref") == [builtin]


def test_a_new_flavour_joins_a_builtin_name_and_wins_by_priority(scoped_registry):
    """A third-party class under a built-in name with its own ``flavour=`` is one more
    flavour of it: the name selects it where it fits with the higher priority; without
    ``flavour=`` it would be the name's ``default`` flavour, which ``torch_ref`` has."""
    from specattn.keys import BackendRequest
    from specattn.platforms import current_platform
    from specattn.selection import select
    builtin = default_registry.classes("decode", "torch_ref")[0]
    request = BackendRequest("decode", topk=2, num_steps=3)
    mine = declare("Fast", name="torch_ref", flavour="fast", platforms=is_cpu,
                   priority={"cpu": 1000})
    assert set(scoped_registry.classes("decode", "torch_ref")) == {builtin, mine}
    assert select("decode", "torch_ref", request, current_platform()).backend is mine
    low = declare("Slow", name="torch_ref", flavour="slow", platforms=is_cpu,
                  priority={"cpu": -1000})
    assert select("decode", "torch_ref", request, current_platform()).backend is mine
    assert low in scoped_registry.classes("decode", "torch_ref")
    with pytest.raises(DuplicateBackendError, match="flavour 'default'"):
        declare("Unflavoured", name="torch_ref")


# --- inheritance -------------------------------------------------------------------------------

def test_subclass_of_a_registered_class_does_not_re_register(empty_registry):
    parent = declare("Parent", name="parent", aliases=("pa",))
    child = type("Child", (parent,), {"__module__": "fakes"})
    assert parent.is_registered() and not child.is_registered()
    assert empty_registry.classes("decode", "parent") == [parent]


def test_subclass_may_register_under_its_own_name(empty_registry):
    parent = declare("Parent", name="parent", aliases=("pa",), platforms=is_cpu)
    child = type("Child", (parent,), {"__module__": "fakes"}, name="child")
    assert child.is_registered() and child.name == "child"
    assert child.aliases == ()  # its identity is its own
    assert empty_registry.canonical("decode", "pa") == ("parent", False)


def test_subclass_under_its_own_name_keeps_where_its_parent_runs(empty_registry):
    """A subclass that tweaks a GPU backend had claimed any platform and no library, so
    ``specattn list`` and ``auto`` took it on a machine its kernels cannot run on."""
    from specattn.platforms import is_cuda

    parent = declare("Parent", name="parent", platforms=is_cuda, models=("mla",),
                     requires=(("mylib", "mylib"),), kernel_library="mylib", priority=40)
    child = type("Child", (parent,), {"__module__": "fakes", "max_topk": 4}, name="child")
    assert (child.platforms, child.models, child.requires, child.kernel_library) == (
        is_cuda, frozenset({"mla"}), (("mylib", "mylib"),), "mylib")
    assert child.priority == {} and child.flavour == "default"
    assert child.platform_reasons(Platform("cpu", libraries=frozenset())) == [
        "needs CUDA, this platform is cpu without AMX",
        "needs the 'mylib' package, which is not installed (pip install mylib)"]
    own = type("Own", (parent,), {"__module__": "fakes"}, name="own", platforms=is_cpu,
               models=("mha", "mla"), requires=())
    assert (own.platforms, own.models, own.requires) == (is_cpu, frozenset({"mha", "mla"}), ())


# --- aliases -----------------------------------------------------------------------------------

def test_alias_clashes(empty_registry):
    declare("A", name="alpha", aliases=("al",))
    with pytest.raises(DuplicateBackendError, match="fakes.A"):
        declare("B", name="beta", aliases=("al",))      # alias taken by another name
    with pytest.raises(DuplicateBackendError):
        declare("C", name="gamma", aliases=("alpha",))  # alias equal to a name
    with pytest.raises(DuplicateBackendError):
        declare("D", name="al")                         # name equal to an alias
    # Another flavour of the same name may repeat the alias.
    declare("E", name="alpha", flavour="other", aliases=("al",))
    assert empty_registry.aliases_of("decode", "alpha") == ["al"]


def test_deprecated_alias_is_marked(empty_registry):
    declare("A", name="alpha", deprecated_aliases=("old",))
    assert empty_registry.canonical("decode", "old") == ("alpha", True)
    assert "old" in empty_registry.all_names("decode")


def test_dispatcher_names_are_reserved(empty_registry):
    empty_registry.add_dispatcher(Dispatcher("router", "decode", (Route(is_cpu, "x"),)))
    with pytest.raises(DuplicateBackendError, match="dispatcher"):
        declare("A", name="router")
    with pytest.raises(DuplicateBackendError, match="dispatcher"):
        declare("B", name="beta", aliases=("router",))
    declare("C", base=DraftExtendBackend, name="router")  # other kind: free
    with pytest.raises(DuplicateBackendError):
        empty_registry.add_dispatcher(Dispatcher("router", "extend", ()))
    with pytest.raises(RegistrationError):
        empty_registry.add_dispatcher(Dispatcher("r2", "verify", ()))


def test_unregister(empty_registry):
    a = declare("A", name="alpha", aliases=("al",))
    empty_registry.unregister(a)
    assert empty_registry.names("decode") == []
    assert empty_registry.canonical("decode", "al") == (None, False)
    with pytest.raises(NotRegisteredError, match="is not registered here"):
        empty_registry.unregister(a)
    assert issubclass(NotRegisteredError, LookupError)


# --- built-ins ---------------------------------------------------------------------------------

def test_every_original_name_is_registered_for_both_kinds():
    from oracle import DEPRECATED_ALIASES, ORIGINAL_NAMES

    for kind in ("decode", "extend"):
        names = set(default_registry.all_names(kind))
        missing = set(ORIGINAL_NAMES) | set(DEPRECATED_ALIASES) | {"torch_ref"}
        assert missing <= names, (kind, missing - names)


def test_builtin_declarations_are_consistent():
    for kind in ("decode", "extend"):
        for cls in default_registry.classes(kind):
            assert cls.is_registered() and cls.kind == kind
            assert cls.qualified_name().startswith("specattn.backends.")
            assert cls.models and cls.models <= {"mha", "mla"}


def test_import_specattn_imports_no_vendor_library():
    vendors = ["flashinfer", "flash_attn", "flash_attn_interface", "flash_mla", "aiter",
               "torch_npu", "tokenspeed_mla", "mate", "triton"]
    code = ("import sys, json, specattn, torch; "
            "specattn.list_backends(); "
            f"print(json.dumps([[m for m in {vendors!r} if m in sys.modules], "
            "torch.cuda.is_initialized()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**__import__("os").environ,
                                          "SPECATTN_DISABLE_PLUGIN_AUTOLOAD": "1"})
    imported, cuda_initialized = json.loads(out.stdout.strip().splitlines()[-1])
    assert imported == []
    assert cuda_initialized is False


# --- bugs found by the stateful test (pinned) --------------------------------------------------

def test_refused_registration_leaves_no_trace(empty_registry):
    from specattn.errors import UnknownBackendError
    from specattn.keys import BackendRequest
    from specattn.selection import select

    declare("A", name="alpha", aliases=("al",))
    with pytest.raises(DuplicateBackendError):
        declare("B", name="beta", aliases=("al",))
    assert empty_registry.names("decode") == ["alpha"]
    assert empty_registry.canonical("decode", "beta") == (None, False)
    with pytest.raises(UnknownBackendError):
        select("decode", "beta", BackendRequest(kind="decode"), Platform("cpu"))


def test_aliases_live_while_a_registered_class_declares_them(empty_registry):
    a = declare("A", name="alpha", aliases=("al", "only_a"))
    declare("B", name="alpha", flavour="b", aliases=("al",))
    empty_registry.unregister(a)
    assert empty_registry.canonical("decode", "al") == ("alpha", False)
    assert empty_registry.canonical("decode", "only_a") == (None, False)
    declare("C", name="alpha", flavour="b", aliases=("new",), replace=True)
    assert empty_registry.canonical("decode", "al") == (None, False)
    assert empty_registry.canonical("decode", "new") == ("alpha", False)


# --- capabilities are checked at class creation -------------------------------------------------

def _with(**body):
    return type("Caps", (DraftDecodeBackend,), {"__module__": "fakes", **_BODY, **body},
                name="caps")


@pytest.mark.parametrize("field,value,expected", [
    ("page_sizes", [1, 16], "None or a frozenset of ints >= 1"),
    ("page_sizes", frozenset({0, 16}), "None or a frozenset of ints >= 1"),
    ("max_topk", 0, "None or an int >= 1"),
    ("max_topk", "8", "None or an int >= 1"),
    ("dtypes", ("bfloat16",), "a non-empty tuple of torch dtypes"),
    ("kv_cache_dtypes", ("auto", "fp8"),
     "a non-empty tuple of names from specattn.kv_layouts.KV_CACHE_DTYPES"),
    ("tree_modes", frozenset({"tree"}), "a non-empty frozenset of 'lane' / 'path'"),
    ("head_dims", {64}, "None or a frozenset of ints >= 1"),
    ("supports_cuda_graph", 1, "a bool"),
    ("soft_cap_models", ("mha",), "a frozenset of 'mha' / 'mla'"),
    ("known_limits", ["decode/*"], "a mapping of case-id patterns to reasons (str: str)"),
    ("reads_host_lengths", "False", "a bool"),   # a str had read as True
    ("max_extend_len", "8", "None or an int >= 1"),
])
def test_a_capability_of_the_wrong_type_fails_at_class_creation(empty_registry, field, value,
                                                                 expected):
    with pytest.raises(RegistrationError) as info:
        _with(**{field: value})
    assert str(info.value) == f"fakes.Caps: {field} must be {expected}, got {value!r}"
    assert empty_registry.names("decode") == []


@pytest.mark.parametrize("field,meant", [("max_top_k", "max_topk"), ("page_size", "page_sizes"),
                                         ("kv_cache_dtype", "kv_cache_dtypes"),
                                         ("supports_cuda_graphs", "supports_cuda_graph")])
def test_a_misspelled_capability_fails_at_class_creation(empty_registry, field, meant):
    with pytest.raises(RegistrationError) as info:
        _with(**{field: 8})
    assert str(info.value) == (f"fakes.Caps: {field}: expected a capability name (did you "
                               f"mean {meant!r}?), got {field} = 8")


@pytest.mark.parametrize("field,value", [("platforms", is_cpu), ("models", ("mla",)),
                                         ("aliases", ("my",)), ("requires", (("m", "m"),)),
                                         ("priority", 5), ("flavour", "x")])
def test_a_declaration_keyword_in_the_class_body_fails_at_class_creation(empty_registry, field,
                                                                          value):
    """The declaration is the class statement's keywords; the body's value of one would be
    replaced (``platforms = is_cuda`` ran as ``any_platform``)."""
    with pytest.raises(RegistrationError) as info:
        _with(**{field: value})
    assert str(info.value) == (f"fakes.Caps: {field}: expected a class keyword (class Caps(..., "
                               f"{field}=...)), got {field} = {value!r} in the class body, "
                               "where it would be ignored")
    assert empty_registry.names("decode") == []


def test_a_name_in_the_class_body_fails_instead_of_registering_nothing(empty_registry):
    with pytest.raises(RegistrationError, match="name: expected a class keyword"):
        type("Body", (DraftDecodeBackend,), {"__module__": "fakes", **_BODY, "name": "mine"})


def test_well_typed_capabilities_and_other_attributes_pass(empty_registry):
    import torch

    cls = _with(page_sizes=frozenset({1, 16}), max_topk=8, dtypes=(torch.float32,),
                kv_cache_dtypes=("auto", "fp8_e4m3"), head_dims=None, fused_history=True,
                window=128, _private_page_size=3)
    assert cls.is_registered() and cls.max_topk == 8
    # An intermediate base (no name=) is checked too: its subclasses inherit the values.
    with pytest.raises(RegistrationError, match="page_sizes must be"):
        type("Base", (DraftDecodeBackend,), {"__module__": "fakes", "page_sizes": (16,)})

