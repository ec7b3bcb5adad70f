"""One page per backend and the ``auto`` order on each device type, generated from the
registry, and (MkDocs hook) the repository's CHANGELOG.md as ``changelog.md``.

The pages say what each backend declares (kinds, flavours, models, platforms, libraries and
their install commands, capabilities) and where it was run; nothing on them is written by
hand. They are committed under ``docs/backends/`` so that links resolve in the repository
too; ``python docs/_hooks/backend_pages.py`` rewrites them from the code, and the docs build
(``on_config``) and ``tests/test_docs.py`` fail when a committed page differs from what the
registry gives. ``on_config`` also puts them into the nav under "Backends".
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections import Counter, defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAV_SECTION = "Backends"


def _registry():
    sys.path.insert(0, str(ROOT))  # document this checkout, whatever is installed
    import specattn  # noqa: F401  (registers the built-in backends)
    from specattn.registry import default_registry

    return default_registry


def _backend_module(cls: type) -> str:
    """The module or package directly under ``specattn.backends`` that holds ``cls``
    (``specattn.backends.dsv4`` for ``specattn.backends.dsv4.backend``)."""
    parts = cls.__module__.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["specattn", "backends"] else cls.__module__


def _summary(classes: list[type]) -> str:
    """The first paragraph of the docstring of the backend module that holds most of the
    name's classes (the first of them on a tie).

    Not the first class's module: a name may have a flavour in another backend's module
    (``dsv4``'s NPU flavour lives in ``ascend``, whose summary is about Ascend). A package's
    docstring, not its ``backend`` submodule's, says what the backend computes."""
    modules = Counter(_backend_module(c) for c in classes)
    doc = sys.modules[modules.most_common(1)[0][0]].__doc__ or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def _class_rows(classes: list[type]) -> list[str]:
    from specattn.install import NOT_ON_PYPI, install_hint

    lines = ["| kind | flavour | class | models | platforms | kernel library | needs | "
             "capabilities | priority (auto) | tested on |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cls in classes:
        d = cls.describe()
        needs = "; ".join(f"`{m}`: " + (NOT_ON_PYPI[req] if req in NOT_ON_PYPI
                                          else f"`{install_hint(req)}`")
                          for m, req in cls.requires) or "-"
        priority = ", ".join(f"{k} {v}" for k, v in sorted(cls.priority.items())) or "-"
        if not cls.auto_eligible:
            priority = "never chosen by auto"
        lines.append("| " + " | ".join(_cell(c) for c in (
            d["kind"], d["flavour"], f"`{d['class']}`", "/".join(d["models"]), d["platforms"],
            d["kernel_library"], needs, ", ".join(d["capabilities"]) or "-", priority,
            d["tested_on"])) + " |")
    return lines


def _dispatcher_rows(dispatchers: list) -> list[str]:
    lines = ["| kind | routes (first that holds) | note |", "|---|---|---|"]
    for kind, disp in dispatchers:
        routes = "; ".join(f"{r.when.description} -> {r.target or 'no backend'}"
                           for r in disp.routes)
        note = disp.note + (f" (logs: {disp.warning})" if disp.warning else "")
        lines.append(f"| {kind} | {_cell(routes)} | {_cell(note) or '-'} |")
    return lines


def _builtin(cls: type) -> bool:
    return cls.__module__.startswith("specattn.")  # not an installed plugin's


def _names(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _kind_line(registry, kind: str, name: str) -> str:
    """What ``name`` gives for ``kind``, from the registry's tables: its own classes (and the
    aliases that reach them), another backend's classes when the name is an alias of it for
    this kind (``cutedsl_mla`` extend), a dispatcher, or nothing."""
    own = [c for c in registry.classes(kind, name) if _builtin(c)]
    if own:
        declared = {a for c in own for a in c.aliases + c.deprecated_aliases}
        aliases = [f"`{a}`" + (" (deprecated)" if registry.canonical(kind, a)[1] else "")
                   for a in registry.aliases_of(kind, name) if a in declared]
        if len(own) == 1:
            text = f"`{own[0].qualified_name()}`."
        else:
            text = "one class per flavour: " + ", ".join(
                f"`{c.qualified_name()}` (`{c.flavour}`)" for c in own) + "."
        if aliases:
            text += f" Aliases for {kind}: " + ", ".join(aliases) + "."
        return f"- **{kind}**: {text}"
    if registry.dispatcher(kind, name) is not None:
        return f"- **{kind}**: a dispatcher: the platform decides the backend (Dispatch below)."
    target, deprecated = registry.canonical(kind, name)
    served = [c for c in registry.classes(kind, target) if _builtin(c)] if target else []
    if served:
        alias = "a deprecated alias" if deprecated else "an alias"
        return (f"- **{kind}**: {_names([c.qualified_name() for c in served])}: `{name}` is "
                f"{alias} of [`{target}`]({target}.md) for {kind}.")
    return f"- **{kind}**: none (`{name}` is not a {kind} name)."


def backend_pages() -> dict[str, str]:
    """``{"backends/<name>.md": markdown}`` for every built-in registered name."""
    registry = _registry()
    from specattn.keys import KINDS

    classes: dict[str, list[type]] = defaultdict(list)
    dispatchers: dict[str, list] = defaultdict(list)
    for kind in KINDS:
        for cls in registry.classes(kind):
            if _builtin(cls):
                classes[cls.name].append(cls)
        for disp in registry.dispatchers(kind):
            dispatchers[disp.name].append((kind, disp))
    pages = {}
    for name in sorted(set(classes) | set(dispatchers)):
        found = classes.get(name, [])
        lines = [f"# `{name}`", "",
                 "*Generated from the registry (`python docs/_hooks/backend_pages.py`): this "
                 "is what the code declares.* `specattn list --pattern " + name + "` says "
                 "whether it runs on your machine.", ""]
        if found:
            lines += [_summary(found), ""]
        lines += ["## Kinds", "", f"What the name `{name}` selects, per kind:", ""]
        lines += [_kind_line(registry, kind, name) for kind in KINDS] + [""]
        if found:
            lines += ["## Classes", ""] + _class_rows(found) + [""]
            tested = sorted({c.tested_on for c in found})
            lines += ["## Where it was run", ""] + [f"- {t}" for t in tested] + [""]
        if name in dispatchers:
            lines += ["## Dispatch", "", "This name routes to another backend, decided by "
                      "the platform (see [How selection works](../selection.md)).", ""]
            lines += _dispatcher_rows(dispatchers[name]) + [""]
        pages[f"backends/{name}.md"] = "\n".join(lines)
    return pages


ORDER_PAGE = "backends/auto-order.md"
# (heading, --platform string) of each device type the order page shows.
ORDER_PLATFORMS = (
    ("NVIDIA Ampere (A100): CUDA 8.0", "cuda:8.0"),
    ("NVIDIA Hopper (H100, H200): CUDA 9.0", "cuda:9.0"),
    ("NVIDIA Blackwell (B200): CUDA 10.0", "cuda:10.0"),
    ("AMD (ROCm)", "hip"),
    ("Huawei Ascend NPU", "npu"),
    ("Moore Threads (MUSA)", "musa"),
    ("Intel GPU (XPU)", "xpu"),
    ("CPU with Intel AMX", "cpu+amx"),
    ("CPU without AMX", "cpu"),
)


def auto_order_page() -> str:
    """The ``auto`` order on each device type (``selection.auto_order``), with every vendor
    library installed: per kind, the classes that run on that device, first tried first."""
    from specattn.cli import parse_platform
    from specattn.listing import known_libraries
    from specattn.selection import auto_order

    registry = _registry()
    libraries = known_libraries(registry)
    kernels = {c.qualified_name(): c.kernel_library
               for kind in ("decode", "extend") for c in registry.classes(kind)}
    lines = ["# The `auto` order", "",
             "*Generated from the registry (`python docs/_hooks/backend_pages.py`).* With no "
             "backend name "
             "(or `auto`), specattn tries the classes below in this order and takes the first "
             "that runs on the machine and accepts the request (model, `topk`, page size, "
             "dtype, ...); model-specific backends (`auto_eligible = False`) are chosen by "
             "name only and are not listed. Each table assumes every vendor library is "
             "installed; classes made for other devices are left out. "
             "`specattn list --order` shows the order on your machine, with what is missing "
             "there, and `specattn select` explains one request "
             "([How selection works](../selection.md)).", ""]
    for heading, text in ORDER_PLATFORMS:
        # Not the environment's TRITON_INTERPRET: the page must not depend on the build.
        platform = dataclasses.replace(parse_platform(text, libraries), triton_interpret=False)
        lines += [f"## {heading}", "", f"`specattn list --order --platform {text}`", ""]
        for kind in ("decode", "extend"):
            rows = [r for r in auto_order(platform, kind, registry) if r.runs_here]
            lines += [f"**{kind}**", "", "| order | name | flavour | priority | models | "
                      "kernel library |", "|---|---|---|---|---|---|"]
            lines += [f"| {n} | [`{r.name}`]({r.name}.md) | {r.flavour} | {r.priority} | "
                      f"{'/'.join(r.models)} | {_cell(kernels[r.qualified_name])} |"
                      for n, r in enumerate(rows, 1)]
            lines.append("")
    return "\n".join(lines)


DOCS = ROOT / "docs"


def generated_pages() -> dict[str, str]:
    """``{path under docs/: markdown}``: the ``auto`` order page and one page per backend."""
    pages = {ORDER_PAGE: auto_order_page()}
    pages.update(backend_pages())
    return {path: text.rstrip("\n") + "\n" for path, text in pages.items()}


def stale_pages(pages: dict[str, str]) -> list[str]:
    """Committed pages that differ from ``pages`` or are missing, and generated-looking pages
    under ``docs/backends/`` that no longer have a backend."""
    stale = [path for path, text in pages.items()
             if not (DOCS / path).is_file() or (DOCS / path).read_text() != text]
    stale += [f"backends/{p.name}" for p in sorted((DOCS / "backends").glob("*.md"))
              if p.name != "index.md" and f"backends/{p.name}" not in pages]
    return stale


def write_pages() -> list[str]:
    """Rewrite the committed pages from the registry; returns the paths it changed."""
    pages = generated_pages()
    changed = stale_pages(pages)
    for path in changed:
        target = DOCS / path
        if path in pages:
            target.write_text(pages[path])
        else:
            target.unlink()
    return changed


_PAGES: dict[str, str] = {}


def on_config(config, **kwargs):
    _PAGES.clear()
    _PAGES.update(generated_pages())
    stale = stale_pages(_PAGES)
    if stale:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"docs/{', docs/'.join(stale)}: out of date with the registry; run "
                          "python docs/_hooks/backend_pages.py")
    for item in config["nav"]:
        if isinstance(item, dict) and NAV_SECTION in item:
            section = item[NAV_SECTION]
            section.append({"auto order": ORDER_PAGE})
            section += [{page.split("/")[-1][:-3]: page} for page in sorted(_PAGES)
                        if page != ORDER_PAGE and page not in section]
    return config


def on_files(files, config, **kwargs):
    from mkdocs.structure.files import File

    changelog = (ROOT / "CHANGELOG.md").read_text()
    files.append(File.generated(config, "changelog.md", content=changelog))
    return files


if __name__ == "__main__":
    changed = write_pages()
    print("\n".join(f"rewrote docs/{path}" for path in changed) or "every page is up to date")
