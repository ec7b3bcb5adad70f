"""``Registry`` against a dict model (Hypothesis ``RuleBasedStateMachine``): register,
replace, unregister, dispatchers, alias lookups and copies, with failures leaving no trace.

Model semantics: a name exists while a class or dispatcher holds it; an alias exists while a
registered class declares it; a failed registration changes nothing.
"""

from __future__ import annotations

import itertools

from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from specattn import DraftDecodeBackend, DraftExtendBackend
from specattn.errors import DuplicateBackendError
from specattn.platforms import any_platform
from specattn.registry import Dispatcher, Registry, Route, use_registry

NAMES = ("alpha", "beta", "gamma")
ALIASES = ("al", "be", "old_al", "old_be")  # "old_*" are declared deprecated
FLAVOURS = ("default", "x")
KINDS = ("decode", "extend")
_BASES = {"decode": DraftDecodeBackend, "extend": DraftExtendBackend}
_counter = itertools.count()


def _new_class(registry, kind, name, flavour, aliases, replace):
    qual = f"C{next(_counter)}"
    deprecated = tuple(a for a in aliases if a.startswith("old_"))
    plain = tuple(a for a in aliases if not a.startswith("old_"))
    with use_registry(registry):
        return type(qual, (_BASES[kind],), {
            "__module__": "stateful", "__qualname__": qual,
            "init_forward_metadata": lambda self, b: None, "forward": lambda self, *a: None,
        }, name=name, flavour=flavour, aliases=plain, deprecated_aliases=deprecated,
            replace=replace)


class RegistryMachine(RuleBasedStateMachine):
    registered = Bundle("registered")

    def __init__(self):
        super().__init__()
        self.registry = Registry()
        self.classes: dict[tuple[str, str, str], type] = {}   # (kind, name, flavour) -> cls
        self.dispatchers: set[tuple[str, str]] = set()        # (kind, name)

    # --- the model ---------------------------------------------------------------------------

    def model_aliases(self, kind):
        table = {}
        for (k, _, _), cls in sorted(self.classes.items()):
            if k == kind:
                for a in cls.aliases + cls.deprecated_aliases:
                    table[a] = cls.name
        return table

    def model_names(self, kind):
        return {n for (k, n, _) in self.classes if k == kind} | {
            n for (k, n) in self.dispatchers if k == kind}

    def registration_clashes(self, kind, name, aliases):
        owners = self.model_aliases(kind)
        if (kind, name) in self.dispatchers or owners.get(name, name) != name:
            return True
        names = self.model_names(kind)
        return any(a in names or owners.get(a, name) != name for a in aliases)

    # --- rules -------------------------------------------------------------------------------

    @rule(target=registered, kind=st.sampled_from(KINDS), name=st.sampled_from(NAMES),
          flavour=st.sampled_from(FLAVOURS),
          aliases=st.lists(st.sampled_from(ALIASES), max_size=2, unique=True),
          replace=st.booleans())
    def register(self, kind, name, flavour, aliases, replace):
        key = (kind, name, flavour)
        expect_error = self.registration_clashes(kind, name, aliases) or (
            key in self.classes and not replace)
        try:
            cls = _new_class(self.registry, kind, name, flavour, aliases, replace)
        except DuplicateBackendError:
            assert expect_error, f"unexpected DuplicateBackendError for {key} {aliases}"
            return None
        assert not expect_error, f"{key} {aliases} should have been refused"
        self.classes[key] = cls
        return cls

    @rule(cls=registered)
    def unregister(self, cls):
        if cls is None:
            return
        key = (cls.kind, cls.name, cls.flavour)
        if self.classes.get(key) is cls:
            self.registry.unregister(cls)
            del self.classes[key]
        else:
            try:
                self.registry.unregister(cls)
            except LookupError:
                return
            raise AssertionError(f"unregistering a replaced/removed {cls} did not fail")

    @rule(kind=st.sampled_from(KINDS), name=st.sampled_from(NAMES + ALIASES))
    def add_dispatcher(self, kind, name):
        taken = name in self.model_names(kind) or name in self.model_aliases(kind)
        try:
            self.registry.add_dispatcher(Dispatcher(name, kind, (Route(any_platform, None),)))
        except DuplicateBackendError:
            assert taken
            return
        assert not taken
        self.dispatchers.add((kind, name))

    @rule()
    def copy_is_equal_and_independent(self):
        snapshot = self.registry.copy()
        for kind in KINDS:
            assert snapshot.all_names(kind) == self.registry.all_names(kind)
            assert snapshot.classes(kind) == self.registry.classes(kind)
        if self.classes:
            key, cls = sorted(self.classes.items())[0]
            snapshot.unregister(cls)
            assert cls in self.registry.classes(key[0], key[1])

    # --- invariants --------------------------------------------------------------------------

    @invariant()
    def names_and_classes_agree(self):
        for kind in KINDS:
            assert self.registry.names(kind) == sorted(self.model_names(kind))
            for name in NAMES + ALIASES:
                expected = sorted((c for (k, n, _), c in self.classes.items()
                                   if k == kind and n == name),
                                  key=lambda c: c.qualified_name())
                assert self.registry.classes(kind, name) == expected
            assert sorted(self.registry.classes(kind), key=id) == sorted(
                (c for (k, _, _), c in self.classes.items() if k == kind), key=id)

    @invariant()
    def aliases_agree(self):
        for kind in KINDS:
            aliases = self.model_aliases(kind)
            names = self.model_names(kind)
            for word in NAMES + ALIASES + ("nothing",):
                if word in names:
                    expected = (word, False)
                elif word in aliases:
                    expected = (aliases[word], word.startswith("old_"))
                else:
                    expected = (None, False)
                assert self.registry.canonical(kind, word) == expected, (kind, word)
            assert self.registry.all_names(kind) == sorted(names | set(aliases))
            for name in NAMES:
                assert self.registry.aliases_of(kind, name) == sorted(
                    a for a, n in aliases.items() if n == name)


TestRegistryStateful = RegistryMachine.TestCase
