"""The ``specattn`` command (also ``python -m specattn``): which draft backends run here,
and why.

    specattn [--log-level LEVEL] COMMAND ...
    specattn list [--kind decode|extend] [--pattern GLOB] [--available] [--details] [--json]
    specattn list --order [--kind ...] [--platform P] [--with-library NAME ...] [--json]
    specattn select --attention-backend cutedsl_mla --mla --platform cuda:10.0 \\
        --with-library flashinfer [--explain]
    specattn demo ...         (the main job: ``specattn.demo.cli_main``)
    specattn bench ...        (``specattn.bench.cli_main``)

``list`` and ``select`` accept ``--platform`` (``cuda:9.0``, ``cpu``, ``cpu+amx``, ``hip``,
``npu``, ``musa``, ``xpu``; ``+interpret`` adds ``TRITON_INTERPRET=1``) and
``--with-library NAME ...`` to answer for another machine; without ``--with-library`` the
vendor libraries are probed on this one (never imported). Tables go through ``rich``
(``specattn._console``); the commands are described in ``docs/commands.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import sys
import warnings
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, Optional

from ._argparse import CommandParser
from .kv_layouts import KV_CACHE_DTYPES
from .listing import known_libraries

__all__ = ["main", "parse_platform"]

LOG_LEVELS = ("debug", "info", "warning", "error")
_PLATFORM_HELP = ("cuda:MAJOR.MINOR (e.g. cuda:9.0), cpu, cpu+amx, hip, npu, musa or xpu; "
                  "append +interpret for TRITON_INTERPRET=1 (on the CPU it follows the "
                  "environment by default)")


# --- platform override -----------------------------------------------------------------------

def _check_libraries(libs: frozenset) -> None:
    """Every ``--with-library`` name is a module some registered backend needs (a typo
    would otherwise answer for a machine without the library, silently)."""
    import difflib

    from .errors import InvalidInputError
    from .plugins import load_plugins

    load_plugins()
    known = known_libraries()
    for lib in sorted(libs - set(known)):
        close = difflib.get_close_matches(lib, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise InvalidInputError("--with-library", f"a module a backend needs, or 'none' "
                                f"(`specattn list --details` names them{hint})", repr(lib))


def parse_platform(text: Optional[str], libraries: Optional[Sequence[str]] = None):
    """``--platform`` / ``--with-library`` as a ``Platform`` (``None``: detect this machine).

    ``libraries=None`` keeps probing this machine's libraries; ``["none"]`` is the empty set.
    Raises ``InvalidInputError`` for a malformed platform string.
    """
    from .errors import InvalidInputError
    from .platforms import DEVICE_TYPES, Platform, detect, triton_interpret_enabled

    libs = None if libraries is None else frozenset(
        lib for lib in libraries if lib.lower() != "none")
    if libs:
        _check_libraries(libs)
    if text is None:
        here = detect()
        return here if libs is None else dataclasses.replace(here, libraries=libs)
    device, *flags = text.strip().lower().split("+")
    device, _, cap_text = device.partition(":")
    if device not in DEVICE_TYPES:
        raise InvalidInputError("--platform", _PLATFORM_HELP, repr(text))
    unknown = set(flags) - {"amx", "interpret"}
    if unknown:
        raise InvalidInputError("--platform", "flags +amx or +interpret", repr(text))
    capability = None
    if cap_text:
        major, _, minor = cap_text.partition(".")
        if not (major.isdigit() and (minor or "0").isdigit()):
            raise InvalidInputError("--platform", "a capability like cuda:9.0", repr(text))
        capability = (int(major), int(minor or 0))
    elif device == "cuda":
        raise InvalidInputError("--platform", "a compute capability for cuda, e.g. cuda:9.0",
                                repr(text))
    interpret = "interpret" in flags or (
        device == "cpu" and triton_interpret_enabled())
    return Platform(device, capability, cpu_has_amx="amx" in flags, libraries=libs,
                    triton_interpret=interpret)


def _libraries_line(platform, registry_libs: Sequence[str]) -> str:
    """Which vendor libraries the decision assumes (given, or probed here)."""
    if platform.libraries is not None:
        given = ", ".join(sorted(platform.libraries)) or "none"
        return f"libraries: {given} (given with --with-library)"
    found = [m for m in registry_libs if platform.has_library(m)]
    missing = [m for m in registry_libs if not platform.has_library(m)]
    return (f"libraries found here: {', '.join(found) or 'none'}; "
            f"not found: {', '.join(missing) or 'none'}")




# --- list --------------------------------------------------------------------------------------

def _merge_rows(rows: list) -> list[dict[str, Any]]:
    """One entry per (name, flavour) when its decode and extend rows agree, else one per kind."""
    merged: list[dict[str, Any]] = []
    index: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        key = (r.name, r.flavour, r.models, r.platforms, r.kernel_library, r.tested_on,
               r.runs_here, r.reason)
        entry = index.get(key)
        if entry is None:
            entry = {"row": r, "kinds": [], "aliases": {}, "capabilities": []}
            index[key] = entry
            merged.append(entry)
        entry["kinds"].append(r.kind)
        for alias in r.aliases:
            entry["aliases"].setdefault(alias, []).append(r.kind)
        for cap in r.capabilities:
            if cap not in entry["capabilities"]:
                entry["capabilities"].append(cap)
    return merged


def _alias_text(entry: dict[str, Any]) -> str:
    kinds = entry["kinds"]
    parts = []
    for alias, alias_kinds in entry["aliases"].items():
        parts.append(alias if alias_kinds == kinds else f"{alias} ({'+'.join(alias_kinds)})")
    return ", ".join(parts) or "-"


def _runs_text(r) -> str:
    if r.flavour == "dispatcher":
        target = r.reason.split(",")[0][len("here -> "):] if r.reason.startswith("here -> ") \
            else "none"
        return f"-> {target}" + ("" if r.runs_here else " (no)")
    return "yes" if r.runs_here else "no"


def _compact_sizes(capability: str) -> str:
    """``page 16/32/.../512`` -> ``page 16-512 (multiples of 16)``: a long list of numbers
    would be folded mid-number by any table."""
    label, _, values = capability.rpartition(" ")
    parts = values.split("/")
    if len(parts) < 5 or not all(v.isdigit() for v in parts):
        return capability
    nums = [int(v) for v in parts]
    step = nums[1] - nums[0]
    if step <= 0 or any(b - a != step for a, b in zip(nums, nums[1:])) or nums[0] % step:
        return capability
    return f"{label} {nums[0]}-{nums[-1]} (multiples of {step})"


def _details(entry: dict[str, Any]) -> str:
    r = entry["row"]
    parts = [f"{'+'.join(entry['kinds'])}, {r.flavour}, {'/'.join(r.models)}"]
    if entry["aliases"]:
        parts.append(f"aliases: {_alias_text(entry)}")
    parts.append(f"platforms: {r.platforms}")
    if r.flavour != "dispatcher":
        parts += [f"kernels: {r.kernel_library}",
                  "capabilities: " + (", ".join(_compact_sizes(c) for c in entry["capabilities"])
                                   or "-"),
                  f"tested on: {r.tested_on}"]
    if r.reason:
        label = ("here" if r.flavour == "dispatcher"
                 else "note" if r.runs_here else "why not")
        text = r.reason[len("here "):] if r.reason.startswith("here -> ") else r.reason
        parts.append(f"{label}: {text}")
    return "; ".join(parts)


def _render_list(rows: list, platform, console) -> None:
    """The ``list`` table: one row per name and flavour (decode and extend merged when their
    declarations agree), then how many there are and how many run here."""
    from ._console import make_table, print_unpadded

    console.print(f"platform: {platform}")
    console.print(_libraries_line(platform, known_libraries()))
    entries = _merge_rows(rows)
    table = make_table("NAME", "RUNS HERE?", "KINDS, FLAVOUR, MODELS; DETAILS",
                       no_wrap=("NAME", "RUNS HERE?"))
    for entry in entries:
        r = entry["row"]
        table.add_row(r.name, _runs_text(r), _details(entry), end_section=True)
    print_unpadded(console, table)
    classes = [r for r in rows if r.flavour != "dispatcher"]
    usable = sum(1 for r in classes if r.runs_here)
    dispatchers = len(rows) - len(classes)
    console.print(f"{len(entries)} entries: {len(classes)} backend classes ({usable} run here) "
                  f"and {dispatchers} dispatchers, decode and extend counted apart; "
                  "`specattn list --json` gives every field")


def _brief_entries(rows: list) -> list[tuple[str, str, str]]:
    """(name, runs here, short reason) per backend name: a name runs here when one of
    its classes (or its dispatcher's target) does; the reason is each row's first one without
    the platform (printed above), or, when it runs, the note on which kernels run."""
    by_name: dict[str, list] = {}
    for r in rows:
        by_name.setdefault(r.name, []).append(r)
    entries = []
    for name, group in by_name.items():
        classes = [r for r in group if r.flavour != "dispatcher"]
        if not classes:  # a dispatcher: where it goes here
            runs = _runs_text(group[0])
            why = "" if group[0].runs_here else group[0].reason.removeprefix("here -> ")
        else:
            group = classes
            runs = "yes" if any(r.runs_here for r in group) else "no"
            pick = [r for r in group if r.runs_here] or group
            why = _short_reason([r.reason for r in pick if r.reason])
        entries.append((name, runs, why))
    return entries


_CC = "CUDA compute capability "


def _short_reason(reasons: list[str]) -> str:
    """One name's reason in a few words, from each class's first reason without the platform
    (printed above): the flavours whose platform fits say what else they need (a package,
    ``TRITON_INTERPRET=1``); when none fits, their platforms in one ``needs CUDA compute
    capability 8.x/9.0 or MUSA``."""
    firsts = [r.split("; ")[0] for r in reasons]
    near = [f for f in firsts if ", this platform is" not in f]
    if near or not firsts:
        return "; ".join(dict.fromkeys(near))
    needs = list(dict.fromkeys(f.split(", this platform is")[0].removeprefix("needs ")
                               for f in firsts))
    capabilities = [n.removeprefix(_CC) for n in needs if n.startswith(_CC)]
    return "needs " + " or ".join(([_CC + "/".join(capabilities)] if capabilities else [])
                                  + [n for n in needs if not n.startswith(_CC)])


def _render_brief(rows: list, platform, console) -> None:
    """The default ``list``: one line per backend name, whether it runs here and why not."""
    from ._console import make_table, print_unpadded

    found = [m for m in known_libraries() if platform.has_library(m)]
    given = " (given with --with-library)" if platform.libraries is not None else ""
    console.print(f"platform: {platform}; libraries found: {', '.join(found) or 'none'}{given}")
    table = make_table("NAME", "RUNS HERE?", "WHY NOT / NOTE", no_wrap=("NAME", "RUNS HERE?"),
                       truncate=("WHY NOT / NOTE",))
    entries = _brief_entries(rows)
    for entry in entries:
        table.add_row(*entry)
    # Only the reason gives way to a narrow terminal: cut with an ellipsis, one line a row.
    fixed = sum(max([len(e[i]) for e in entries] + [len(c.header)])
                for i, c in enumerate(table.columns[:2]))
    table.columns[2].max_width = max(console.width - fixed - 4, 10)  # 4: the column gaps
    print_unpadded(console, table)
    usable = sum(1 for e in entries if e[1] == "yes" or (e[1].startswith("->")
                                                          and not e[1].endswith("(no)")))
    console.print(f"{len(entries)} backends, {usable} run here; --details: every declaration "
                  "and reason")


def _platform_json(platform) -> dict[str, Any]:
    return {"device": platform.device,
            "capability": list(platform.capability) if platform.capability else None,
            "cpu_has_amx": platform.cpu_has_amx,
            "triton_interpret": platform.triton_interpret,
            "libraries": sorted(platform.libraries) if platform.libraries is not None else None,
            "libraries_found": [m for m in known_libraries() if platform.has_library(m)],
            "description": str(platform)}


def _row_json(r) -> dict[str, Any]:
    data = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "backend"}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}


def _order_rows(args: argparse.Namespace, platform) -> list:
    """``auto``'s order on ``platform`` (``selection.auto_order``), filtered like ``list``
    (``--kind``, ``--pattern``, ``--available``); ranks stay ``auto``'s."""
    import fnmatch

    from .selection import auto_order

    rows = auto_order(platform, args.kind)
    if args.pattern:
        rows = [r for r in rows if fnmatch.fnmatch(r.name, args.pattern)]
    if args.available:
        rows = [r for r in rows if r.runs_here]
    return rows


def _render_order(rows: list, platform, console) -> None:
    """One table per kind: rank, name, flavour, priority, models, runs here or why not."""
    from ._console import make_table, print_unpadded

    console.print(f"platform: {platform}")
    console.print(_libraries_line(platform, known_libraries()))
    for kind in ("decode", "extend"):
        of_kind = [r for r in rows if r.kind == kind]
        if not of_kind:
            continue
        console.print()
        console.print(f"{kind}: auto tries these in this order")
        table = make_table("RANK", "NAME", "FLAVOUR", "PRIORITY", "MODELS", "RUNS HERE?",
                           no_wrap=("RANK", "NAME", "FLAVOUR", "PRIORITY", "MODELS"))
        for r in of_kind:
            table.add_row(str(r.rank), r.name, r.flavour, str(r.priority), "/".join(r.models),
                          "yes" if r.runs_here else f"no: {r.reason}")
        print_unpadded(console, table)
    console.print()
    console.print("auto takes the first row that runs here and accepts the request (model, "
                  "topk, page size, dtype, ...)" + _by_name_only_note()
                  + ". `specattn select` explains one request.")


def _by_name_only_note() -> str:
    """``"; dsa and dsv4 ... by name only"``: the classes ``auto`` never picks."""
    from .registry import active_registry

    registry = active_registry()
    names = sorted({c.name for kind in ("decode", "extend") for c in registry.classes(kind)
                    if not c.auto_eligible})
    return f"; {', '.join(names)}: model-specific, chosen by name only" if names else ""


def _cmd_list(args: argparse.Namespace) -> int:
    from . import list_backends

    platform = parse_platform(args.platform, args.with_library)
    if args.order:
        rows, key, render = _order_rows(args, platform), "order", _render_order
    else:
        rows = list_backends(kind=args.kind, pattern=args.pattern,
                             available_only=args.available, platform=platform)
        key, render = "backends", _render_list if args.details else _render_brief
    if args.json:
        print(json.dumps({"platform": _platform_json(platform),
                          key: [_row_json(r) for r in rows]}, indent=2))
        return 0
    from ._console import make_console

    render(rows, platform, make_console())
    return 0


# --- select ------------------------------------------------------------------------------------

class _Collect(logging.Handler):
    """Collects the warnings selection logs, to print them next to the decision."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


_ERROR_STEPS = {
    "UnknownBackendError": ["not a known name, alias or dispatcher (rule 3)"],
    "ModelMismatchError": ["an MLA-only backend and use_mla_backend is False; checked before "
                           "any platform check (rule 8)"],
}


@dataclasses.dataclass
class _Outcome:
    """One kind's answer: the short text, the steps behind it (``--explain``), the warnings
    selection logged or raised on the way, and the selection error, if any."""

    answer: str
    trace: list[str]
    notes: list[str]
    error: Optional[BaseException] = None


def _resolve_kind(factory, config, kind: str) -> _Outcome:
    explain = (factory.explain_decode_backend if kind == "decode"
               else factory.explain_draft_extend_backend)
    handler = _Collect()
    log = logging.getLogger("specattn")
    log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                sel = explain()
            except Exception as exc:  # every selection error is reported, not raised
                from .errors import SpecAttnError
                from .selection import describe_error

                if not isinstance(exc, (SpecAttnError, ValueError)):
                    raise
                steps = [f"name precedence (rule 2): {s}" for s in config.name_trail(kind)]
                for qualname, reasons in getattr(exc, "reasons", {}).items():
                    steps.append(f"{qualname}: rejected: " + "; ".join(reasons))
                steps += _ERROR_STEPS.get(type(exc).__name__, [])
                trace = [f"{kind}: requested {config.backend_name(kind)!r}"]
                trace += [f"  {i}. {s}" for i, s in enumerate(steps, 1)]
                trace.append(f"  => {type(exc).__name__}: {exc}")
                return _Outcome(f"error: {describe_error(exc)}", trace,
                                _notes(handler.messages, caught), exc)
    finally:
        log.removeHandler(handler)
    trace = sel.explain().splitlines()
    if sel.backend is None:
        answer = "None"
        trace.append("  => None: no backend for this kind (see the last step)")
    else:
        cls = sel.backend
        answer = f"{cls.qualified_name()} (name {cls.name!r}, flavour {cls.flavour!r})"
        trace.append(f"  => {answer}")
        note = cls.runtime_note(sel.platform, sel.request)
        answer += f"; {note}" if note else ""  # which kernel runs here (e.g. Gluon MLA)
    return _Outcome(answer, trace, _notes(handler.messages, caught))


def _notes(logged: list[str], caught: list) -> list[str]:
    return [f"warning: {m}" for m in logged] + [f"{w.category.__name__}: {w.message}"
                                                for w in caught]


def _cmd_select(args: argparse.Namespace) -> int:
    from . import DraftBackendFactory, SpecConfig
    from .errors import InvalidInputError, UnknownBackendError
    from .selection import describe_error

    try:
        platform = parse_platform(args.platform, args.with_library)
        config = SpecConfig(
            attention_backend=args.attention_backend,
            decode_attention_backend=args.decode_attention_backend,
            prefill_attention_backend=args.prefill_attention_backend,
            speculative_draft_attention_backend=args.speculative_draft_attention_backend,
            speculative_attention_mode=args.speculative_attention_mode,
            page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype)
        runner = SimpleNamespace(use_mla_backend=args.mla, page_size=args.page_size)
        factory = DraftBackendFactory(config, runner, args.topk, args.num_steps,
                                      tree_mode=args.tree_mode, platform=platform)
    except InvalidInputError as exc:
        print(f"specattn select: error: {exc}", file=sys.stderr)
        return 2
    outcomes = {kind: _resolve_kind(factory, config, kind) for kind in ("decode", "extend")}
    unknown = [o.error for o in outcomes.values() if isinstance(o.error, UnknownBackendError)]
    if unknown and not args.explain:  # a misspelled name: the one line that corrects it
        for text in dict.fromkeys(describe_error(e) for e in unknown):
            print(f"specattn select: error: {text}", file=sys.stderr)
        return 1
    set_fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                  if getattr(config, f.name) != f.default}
    print(f"platform: {platform}")
    print(_libraries_line(platform, known_libraries()))
    print(f"model: {'MLA' if args.mla else 'MHA'}; topk={args.topk} num_steps={args.num_steps} "
          f"tree_mode={args.tree_mode}")
    print("config: SpecConfig(" + ", ".join(f"{k}={v!r}" for k, v in set_fields.items()) + ")")
    if args.explain:
        for outcome in outcomes.values():
            print()
            print("\n".join(outcome.trace))
    print()
    print("answer:")
    decode, extend = outcomes["decode"].answer, outcomes["extend"].answer
    if decode == extend:
        print(f"  decode, extend: {decode}")
    else:
        print(f"  decode: {decode}\n  extend: {extend}")
    for note in dict.fromkeys(n for o in outcomes.values() for n in o.notes):
        print(note)
    if not args.explain:
        print("(--explain: every step of the choice and each candidate's reasons)")
    return 1 if any(o.error for o in outcomes.values()) else 0


# --- demo / bench --------------------------------------------------------------------------------

def _cmd_demo(argv: list[str]) -> int:
    try:
        from .demo import cli_main
    except ImportError as exc:  # the package, or its cli_main, is missing; not a bug inside it
        if exc.name != "specattn.demo":
            raise
        print(f"specattn demo: the demo (specattn.demo.cli_main) is not available in this "
              f"installation ({exc})", file=sys.stderr)
        return 2
    import specattn

    # From the process's start (specattn._STARTED): the total includes starting Python and
    # importing torch.
    return int(cli_main(argv, started=specattn._STARTED) or 0)


def _cmd_bench(argv: list[str]) -> int:
    from .bench import cli_main  # lazy: the benchmark imports nothing until asked for

    return int(cli_main(argv) or 0)


# --- argument parsing --------------------------------------------------------------------------

def _add_platform_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--platform", metavar="P", help=_PLATFORM_HELP)
    p.add_argument("--with-library", metavar="NAME", nargs="+", action="extend",
                   help="vendor modules to assume installed (e.g. flashinfer "
                        "flash_attn.cute); 'none' for none; default: probe this machine")


_NAME_HELP = {
    "attention-backend": "the engine's attention backend; used for both kinds unless a field "
                         "below overrides it (rule 2)",
    "decode-attention-backend": "backend of decode; also of extend with "
                                "--speculative-attention-mode decode",
    "prefill-attention-backend": "backend of draft extend in the default 'prefill' mode",
    "speculative-draft-attention-backend": "the draft model's backend: overrides the three "
                                           "above for both kinds",
}


def _add_select_args(p: argparse.ArgumentParser) -> None:
    names = p.add_argument_group("backend names (precedence: rule 2 of docs/selection.md; "
                                 "none set or 'auto': specattn chooses)")
    for field, text in _NAME_HELP.items():
        names.add_argument(f"--{field}", metavar="NAME", help=text)
    p.add_argument("--speculative-attention-mode", choices=("prefill", "decode"),
                   default="prefill", help="which field names the draft-extend backend: "
                   "prefill-attention-backend or decode-attention-backend (default: prefill)")
    p.add_argument("--page-size", type=int, default=1, metavar="P",
                   help="KV cache page size in tokens (default: 1)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   metavar="DTYPE", help="KV cache dtype: " + ", ".join(KV_CACHE_DTYPES)
                   + " (auto: the model's dtype; fp8_ds_mla and fp8_ds_v4: the DeepSeek FP8 "
                   "layouts) (default: auto)")
    p.add_argument("--topk", type=int, default=1, metavar="K",
                   help="draft branches (lanes) per request (default: 1)")
    p.add_argument("--num-steps", type=int, default=3, metavar="S",
                   help="draft steps; 1 or less needs no decode backend (rule 1) (default: 3)")
    p.add_argument("--mla", action="store_true", help="the draft model uses MLA "
                   "(use_mla_backend=True) (default: MHA/GQA)")
    p.add_argument("--tree-mode", choices=("lane", "path"), default="lane",
                   help="lane: each lane attends to its own history, as upstream engines do; "
                        "path: the exact EAGLE ancestry (default: lane)")
    p.add_argument("--explain", action="store_true",
                   help="print every step of the choice, each candidate's reasons and the "
                        "full error messages (default: the answers only)")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = CommandParser(
        prog="specattn", description="Attention backends for the draft phase of "
        "speculative decoding: list them, explain a selection, run the demo or the "
        "benchmark. Docs: docs/index.md in the repository.")
    parser.add_argument("--version", action="version", version=f"specattn {__version__}")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                        help="level of the 'specattn' loggers printed on stderr "
                             "(default: warning)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("list", help="every backend and whether it runs here",
                       description="Every registered backend and dispatcher, one line each: "
                       "whether it runs here and, if not, what it needs. --details: kinds, "
                       "models, platforms, kernel library, capabilities, where it was tested "
                       "and every reason.")
    p.add_argument("--kind", choices=("decode", "extend"),
                   help="only this kind (default: both)")
    p.add_argument("--pattern", metavar="GLOB",
                   help="fnmatch pattern on names and aliases, e.g. 'fa*' (default: all)")
    p.add_argument("--available", action="store_true",
                   help="only what runs here (dispatchers: only when their target does)")
    p.add_argument("--order", action="store_true",
                   help="the order in which auto tries the backends here (or on --platform), "
                        "one table per kind: rank, priority, runs here or why not")
    p.add_argument("--details", action="store_true",
                   help="the full table: every declaration and every reason (default: one "
                        "line per backend)")
    p.add_argument("--json", action="store_true", help="every field, as JSON")
    _add_platform_args(p)

    p = sub.add_parser("select", help="which backends a configuration gets, and why",
                       description="Resolve a SpecConfig for draft decode and draft extend: "
                       "the answer for each; --explain prints every step (rule numbers: "
                       "docs/selection.md). Exit status 1 when a kind has no backend because "
                       "of an error.")
    _add_select_args(p)
    _add_platform_args(p)

    sub.add_parser("demo", help="run the draft-model demo (specattn demo --help)",
                   add_help=False)
    sub.add_parser("bench", help="time every backend that runs here (specattn bench --help)",
                   add_help=False)
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (not when it was made)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def _set_log_level(level: str) -> None:
    """Print the package's log records at ``level`` and above on stderr (one handler per
    process, however often it is called)."""
    log = logging.getLogger("specattn")
    log.setLevel(level.upper())
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        log.addHandler(_StderrHandler())


def _pop_log_level(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """``--log-level L`` anywhere on the line (so it works for demo and bench too)."""
    for i, arg in enumerate(argv):
        if arg == "--log-level" and i + 1 < len(argv) and argv[i + 1] in LOG_LEVELS:
            return argv[i + 1], argv[:i] + argv[i + 2:]
        if arg.startswith("--log-level=") and arg.split("=", 1)[1] in LOG_LEVELS:
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
    return None, argv


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``specattn`` console script; returns the exit status.

    Run as the program (``argv`` None), it freezes the garbage collector's objects once the
    command is done: the process exits next, and the collections at interpreter exit over
    torch's objects would take another third of a second after the printed total."""
    if argv is None:
        try:
            return _main(sys.argv[1:])
        finally:
            gc.freeze()
    return _main(argv)


def _main(argv: Sequence[str]) -> int:
    argv = list(argv)
    level, argv = _pop_log_level(argv)
    if level is not None:
        _set_log_level(level)
    if argv and argv[0] == "demo":
        return _cmd_demo(argv[1:])
    if argv and argv[0] == "bench":
        return _cmd_bench(argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "list":
            return _cmd_list(args)
        return _cmd_select(args)
    except BrokenPipeError:  # `specattn list | head`
        return 0
    except Exception as exc:
        from .errors import InvalidInputError

        if isinstance(exc, InvalidInputError):
            print(f"specattn {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
