"""The user docs: they build strictly (no broken link, no missing reference, no page left
out of the navigation), every backend gets its generated page, and every docs file the
package's messages, the README or the changelog cite exists in the repository."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from specattn.registry import default_registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A path ending in .md, not part of a longer path or URL.
MD_REF = re.compile(r"(?<![\w/.:-])((?:[\w.-]+/)*[\w.-]+\.md)\b")
# Files that `specattn bench` writes (named in its messages, not documents to read).
OUTPUT_FILES = {"table.md"}


def _resolves(ref: str, where: pathlib.Path) -> bool:
    if ref in OUTPUT_FILES:
        return True
    return any(p.is_file() for p in (ROOT / ref, ROOT / "docs" / ref, where.parent / ref))


def _message_strings(path: pathlib.Path) -> list[str]:
    """String constants of a module that are not docstrings: what it prints or raises."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value,
                                                                     ast.Constant):
                docstrings.add(id(body[0].value))
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings]


def test_every_docs_file_the_package_cites_exists():
    missing = []
    for path in sorted((ROOT / "specattn").rglob("*.py")):
        text = path.read_text()
        # Anything that names docs/ (messages and docstrings alike) must exist.
        missing += [(path, ref) for ref in MD_REF.findall(text)
                    if ref.startswith("docs/") and not (ROOT / ref).is_file()]
        # What the tools print must point to a file of the repository.
        for string in _message_strings(path):
            missing += [(path, ref) for ref in MD_REF.findall(string)
                        if not _resolves(ref, path)]
    for name in ("README.md", "CHANGELOG.md", "pyproject.toml"):  # mkdocs.yml: the build
        path = ROOT / name
        missing += [(path, ref) for ref in MD_REF.findall(path.read_text())
                    if not _resolves(ref, path)]
    assert not missing, [(str(p.relative_to(ROOT)), ref) for p, ref in missing]


def test_every_relative_link_in_the_docs_resolves():
    """A relative link in a page under docs/ points to a file of the repository (the build
    checks links between pages; this also covers links out of docs/)."""
    link = re.compile(r"\]\(([^)\s]+)\)")
    broken = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for target in link.findall(page.read_text()):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z][a-z0-9+.-]*:", path) and \
                    not (page.parent / path).exists():
                broken.append((str(page.relative_to(ROOT)), target))
    assert not broken, broken


def test_every_backend_the_docs_show_implements_the_hooks():
    """A backend class in the README, the docs or the examples implements the hooks
    (``_plan``, ``_attend``), never the public methods that run the protocol around them:
    a class that overrides ``forward`` or ``init_forward_metadata`` skips the input checks
    and the KV write, and fails the conformance kit."""
    block = re.compile(r"```python\n(.*?)```", re.S)
    backend = re.compile(r"^class \w+\(Draft(Decode|Extend)Backend\b", re.M)
    public = re.compile(r"^\s+def (forward|init_forward_metadata)\(", re.M)
    texts = [(p, block.findall(p.read_text())) for p in
             [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]]
    texts += [(p, [p.read_text()]) for p in sorted((ROOT / "examples").glob("*.py"))]
    shown = [(p, code) for p, codes in texts for code in codes if backend.search(code)]
    assert len(shown) >= 4, [str(p.relative_to(ROOT)) for p, _ in shown]
    bad = [str(p.relative_to(ROOT)) for p, code in shown if public.search(code)]
    assert not bad, bad


# `git show REV:PATH` in a text (REV and PATH may be on the next line).
GIT_SHOW = re.compile(r"git show\s+([^\s:`]+):([^\s`]+)")
LAB_TAG = re.compile(r"\blab-\d{4}-\d{2}-\d{2}-[\w-]+")  # a laboratory's tag, named anywhere


def _history_available() -> str:
    """Why the repository's history cannot be read here ('' when it can)."""
    try:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"git unavailable: {exc}"
    if shallow.returncode != 0:
        return "not a git checkout"
    return "a shallow clone" if shallow.stdout.strip() == "true" else ""


def test_every_git_show_the_docs_cite_reads_a_commit_of_the_history():
    """The results moved out of ``benchmarks/results/`` are cited as ``git show REV:PATH``:
    REV is a commit hash of the history (a tag, or a branch off ``main``, does not travel
    with a clone: its citations went dead) and PATH exists there; ``PATH`` in capitals is
    a placeholder."""
    why = _history_available()
    if why:
        pytest.skip(f"the citations are checked against the git history: {why}")
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "results" / "README.md",
             *sorted((ROOT / "docs").rglob("*.md"))]
    bad = []
    for page in pages:
        bad += [(str(page.relative_to(ROOT)), tag) for tag in LAB_TAG.findall(page.read_text())]
        for rev, path in GIT_SHOW.findall(page.read_text()):
            path = path.rstrip(".,;)")
            if path == "PATH":
                continue
            if "..." in path:  # a pattern (REV:benchmarks/results/...), not one file
                path = path.split("...")[0].rstrip("/")
            named = re.fullmatch(r"[0-9a-f]{7,40}", rev)
            found = subprocess.run(["git", "cat-file", "-e", f"{rev}:{path}"], cwd=ROOT,
                                   capture_output=True).returncode == 0
            if not (named and found):
                bad.append((str(page.relative_to(ROOT)), f"{rev}:{path}"))
    assert not bad, bad


def test_the_tools_cite_the_repositorys_docs_not_the_spec():
    """selection.md / performance.md in a message: written as docs/..., which exists."""
    for path in sorted((ROOT / "specattn").rglob("*.py")):
        for string in _message_strings(path):
            for ref in MD_REF.findall(string):
                if ref.split("/")[-1] in {"selection.md", "performance.md", "semantics.md"}:
                    assert ref.startswith("docs/"), (str(path.relative_to(ROOT)), string)


def test_auto_order_page_is_auto_order_on_each_device():
    """The generated page: per device type and kind, the classes that run there with every
    library installed, in ``auto``'s order; independent of the build's TRITON_INTERPRET."""
    import dataclasses

    from specattn.cli import parse_platform
    from specattn.listing import known_libraries
    from specattn.selection import auto_order

    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    try:
        import backend_pages
    finally:
        sys.path.pop(0)
    page = backend_pages.auto_order_page()
    sections = page.split("\n## ")[1:]
    assert [s.splitlines()[0] for s in sections] == [h for h, _ in backend_pages.ORDER_PLATFORMS]
    for section, (_, text) in zip(sections, backend_pages.ORDER_PLATFORMS):
        plat = dataclasses.replace(parse_platform(text, known_libraries()),
                                   triton_interpret=False)
        for kind, table in zip(("decode", "extend"), section.split("**")[2::2]):
            names = re.findall(r"^\| \d+ \| \[`(\w+)`\]\(\w+\.md\) \| (\w+) \|", table, re.M)
            assert names == [(r.name, r.flavour) for r in auto_order(plat, kind) if r.runs_here]
    hopper = sections[1]
    assert hopper.index("[`fa4`]") < hopper.index("[`flashinfer`]") < hopper.index("[`triton`]")
    assert "[`triton`]" not in sections[-1]  # a plain CPU: no Triton without the interpreter


def test_committed_backend_pages_match_the_registry():
    """docs/backends/*.md are generated: each equals what the registry gives today, so the
    repository's links resolve and the pages cannot drift from the code."""
    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    try:
        import backend_pages
    finally:
        sys.path.pop(0)
    pages = backend_pages.generated_pages()
    assert "backends/triton.md" in pages and "backends/auto-order.md" in pages
    assert backend_pages.stale_pages(pages) == [], "run: python docs/_hooks/backend_pages.py"


def test_backend_pages_name_the_class_each_kind_selects():
    """A backend page says, per kind, which class its name selects: its own, or another
    backend's when the name is an alias of it for that kind (``cutedsl_mla``'s draft extend is
    ``trtllm_mla``'s class), with a link to that page, whose line for the kind names the
    alias; a dispatcher is said to be one."""
    from specattn.keys import KINDS

    sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
    try:
        import backend_pages
    finally:
        sys.path.pop(0)
    pages = backend_pages.backend_pages()

    def kind_lines(name: str) -> dict[str, str]:
        return dict(re.findall(r"^- \*\*(\w+)\*\*: (.*)$", pages[f"backends/{name}.md"], re.M))

    aliased = []
    for path in pages:
        name = path[len("backends/"):-len(".md")]
        lines = kind_lines(name)
        assert sorted(lines) == sorted(KINDS), path
        for kind in KINDS:
            if default_registry.dispatcher(kind, name) is not None:
                assert "dispatcher" in lines[kind], (path, kind)
                continue
            target, _ = default_registry.canonical(kind, name)
            served = [c for c in default_registry.classes(kind, target or name)
                      if c.__module__.startswith("specattn.")]
            assert served or lines[kind].startswith("none"), (path, kind)
            for cls in served:
                assert f"`{cls.qualified_name()}`" in lines[kind], (path, kind)
            if target is not None and target != name:
                aliased.append((kind, name))
                assert f"[`{target}`]({target}.md)" in lines[kind], (path, kind)
                assert f"`{name}`" in kind_lines(target)[kind], (target, kind)
            for alias in default_registry.aliases_of(kind, name):
                assert f"`{alias}`" in lines[kind], (path, kind, alias)
    assert ("extend", "cutedsl_mla") in aliased


def test_docs_build_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="the docs extra: pip install -e '.[docs]'")
    site = tmp_path / "site"
    # Not --quiet: it hides the warnings that --strict counts (the build passed with them).
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = set(default_registry.names("decode")) | set(default_registry.names("extend"))
    for name in names:
        page = (site / "backends" / name / "index.html").read_text()
        assert f"<code>{name}</code>" in page
        for cls in default_registry.classes("decode", name) + default_registry.classes(
                "extend", name):
            assert cls.qualified_name() in page  # the page comes from the registry
    order = (site / "backends" / "auto-order" / "index.html").read_text()
    assert "NVIDIA Hopper" in order and "CPU with Intel AMX" in order
    api = (site / "api" / "factory" / "index.html").read_text()
    assert "create_decode_backend" in api and "explain_decode_backend" in api
    assert (site / "changelog" / "index.html").is_file()


def test_the_kernel_pages_plan_table_is_the_codes():
    """docs/kernels.md's plan table names every plan of ``plans.PLANS``, each with the code's
    block m/n, warps and stages (``M/N, WARPS ..., STAGES``)."""
    from specattn.backends.triton.plans import PLANS

    text = (ROOT / "docs" / "kernels.md").read_text()
    table = text[text.index("## The plan table"):]
    table = table[:table.index("\n## ", 5)]
    rows = {}
    for name, tiles in re.findall(r"^\| `([\w-]+)` \|[^|]*\| ([^|]*) \|", table, re.M):
        m, n = re.match(r"(\d+)/(\d+),", tiles).groups()
        numbers = re.findall(r"\d+", tiles.split(",", 1)[1])
        rows[name] = (int(m), int(n), int(numbers[0]), int(numbers[-1]))
    assert rows == {p.name: (p.block_m, p.block_n, p.num_warps, p.num_stages)
                    for p in PLANS.values()}


def _serving_table(text: str) -> tuple[str, list[list[str]]]:
    """The results folder docs/serving.md's measured section names, and its table's rows."""
    section = text[text.index("## Measured on an H200"):]
    folder = re.search(r"`(benchmarks/results/[\w.-]+)/`", section).group(1)
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| `")]
    return folder, rows


def test_the_serving_pages_table_is_its_runs_bench_csv():
    """Every number of docs/serving.md's table (read floor; triton and flashinfer step and
    its ratio to the read floor; round and host time) is the named run's ``bench.csv``,
    rounded as printed."""
    import csv

    folder, rows = _serving_table((ROOT / "docs" / "serving.md").read_text())
    with open(ROOT / folder / "bench.csv", newline="") as f:
        csv_rows = {(r["case"], r["variant"]): r for r in csv.DictReader(f)
                    if r["lengths"] == "uniform"}
    assert len(rows) >= 10
    for cells in rows:
        case = cells[0].strip("`")
        expected = [f"{float(csv_rows[case, 'read-floor']['time_us']):.1f}"]
        for backend in ("triton", "flashinfer"):
            r = csv_rows[case, backend]
            expected.append(f"{float(r['time_us']):.1f} ({float(r['x_read_floor']):.2f}x)")
        for backend in ("triton", "flashinfer"):
            r = csv_rows[case, backend]
            expected.append(f"{float(r['round_us']):.1f} / {float(r['round_host_us']):.1f}")
        assert cells[2:] == expected, case


def test_the_selection_pages_sample_is_what_select_prints(capsys):
    """docs/selection.md's ``$ specattn select ...`` block: every line it shows (``...`` elides)
    is a line of the command's output, in the same order."""
    import shlex

    from specattn.cli import main

    text = (ROOT / "docs" / "selection.md").read_text()
    block = re.search(r"```text\n\$ specattn (select .*?)\n(.*?)```", text, re.S)
    assert block, "docs/selection.md: the sample of `specattn select`"
    assert main(shlex.split(block.group(1))) == 0
    printed = capsys.readouterr().out.splitlines()
    at = 0
    for line in block.group(2).splitlines():
        if line == "...":
            continue
        assert line in printed[at:], f"docs/selection.md: select does not print {line!r}"
        at = printed.index(line, at) + 1


def _documented_flags(page: pathlib.Path) -> list[tuple[str, str]]:
    """(command, --flag) for every flag written after ``specattn list|select|demo|bench`` on
    the same line of a page."""
    found = []
    for m in re.finditer(r"specattn (list|select|demo|bench)\b([^`\n]*)", page.read_text()):
        found += [(m.group(1), f) for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", m.group(2))]
    return found


def test_every_flag_the_docs_give_a_command_exists():
    """A ``--flag`` the README or a docs page writes after ``specattn <command>`` is an option of
    that command's parser (the demo's: the synthetic or the SmolLM2 one)."""
    import argparse

    from specattn.bench import build_parser as bench_parser
    from specattn.cli import build_parser
    from specattn.demo.cli import build_parser as demo_parser
    from specattn.demo.smollm2.cli import build_parser as smollm2_parser

    def options(*parsers: argparse.ArgumentParser) -> set[str]:
        return {s for p in parsers for a in p._actions for s in a.option_strings}

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    known = {"list": options(top, sub.choices["list"]),
             "select": options(top, sub.choices["select"]),
             "demo": options(top, demo_parser(), smollm2_parser()),
             "bench": options(top, bench_parser())}
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    unknown = [(str(page.relative_to(ROOT)), command, flag) for page in pages
               for command, flag in _documented_flags(page) if flag not in known[command]]
    assert not unknown, unknown


def test_every_environment_variable_the_package_reads_is_documented():
    """docs/environment.md ("every variable specattn reads") has a row for each ``SPECATTN_*``
    name the package's code holds (``__all__`` lists aside)."""
    names = set()
    for path in sorted((ROOT / "specattn").rglob("*.py")):
        tree = ast.parse(path.read_text())
        exported = {id(c) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                    for c in ast.walk(node.value)}
        names |= {node.value for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and re.fullmatch(r"SPECATTN_[A-Z0-9_]+", node.value)
                  and id(node) not in exported}
    table = set(re.findall(r"^\| `(\w+)` \|", (ROOT / "docs" / "environment.md").read_text(),
                           re.M))
    assert len(names) >= 5 and not names - table, sorted(names - table)


def test_the_kit_page_names_every_built_in_declared_limit():
    """docs/conformance.md lists the built-in ``known_limits``: every built-in class that
    declares some is named there."""
    text = (ROOT / "docs" / "conformance.md").read_text()
    section = text[text.index("## Declared limits"):]
    section = section[:section.index("\n## ")]
    named = set(re.findall(r"`(\w+)`", section))
    limited = {cls.name for kind in ("decode", "extend") for cls in default_registry.classes(kind)
               if cls.known_limits and cls.__module__.startswith("specattn.")}
    assert limited and not limited - named, sorted(limited - named)


def test_the_benchmark_page_leaves_out_columns_in_the_codes_order():
    """docs/performance.md's order in which the terminal table leaves columns out is
    ``report.TERMINAL_DROP_ORDER``."""
    from specattn.bench.report import TERMINAL_DROP_ORDER

    text = " ".join((ROOT / "docs" / "performance.md").read_text().split())
    sentence = re.search(r"left out first, then (.*?), in that order", text)
    assert sentence, "docs/performance.md: the columns left out of a narrow table"
    assert tuple(re.findall(r"`([^`]+)`", sentence.group(1))) == TERMINAL_DROP_ORDER


def test_the_install_pages_extras_are_pyprojects():
    """docs/install.md's table of extras: one row per extra of ``pyproject.toml``, naming
    exactly the requirements it installs, version bounds included."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]*) \|",
                           (ROOT / "docs" / "install.md").read_text(), re.M))

    assert set(rows) == set(extras)
    for extra, requirements in extras.items():
        documented = re.findall(r"`([^`]+)`", rows[extra])
        assert sorted(documented) == sorted(requirements), extra


def _python_block(page: str, marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / page).read_text(), re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


def test_the_kit_pages_property_test_sample_runs():
    pytest.importorskip("hypothesis")
    namespace: dict = {}
    exec(_python_block("conformance.md", "def test_mine_matches_reference"), namespace)
    namespace["test_mine_matches_reference"]()


def test_the_kit_pages_case_id_is_one_the_kit_plans():
    """The example test id the kit page shows is a case the kit plans (for ``torch_ref``)."""
    from specattn.testing.plan import plan_cases
    from specattn.testing.target import Target

    shown = re.search(r"test_mine\[([^\]]+)\]", (ROOT / "docs" / "conformance.md").read_text())
    ids = {case.id for case, _ in plan_cases(Target.build("torch_ref"))}
    assert shown and shown.group(1) in ids, sorted(i for i in ids if "numerics" in i)[:5]



def test_the_kit_pages_declared_limit_matches_a_case_the_kit_plans():
    """The ``known_limits`` pattern the kit page shows matches a case the kit plans (a
    pattern that matches none is a limit that never applies)."""
    import fnmatch

    from specattn.testing.plan import plan_cases
    from specattn.testing.target import Target

    shown = re.search(r'known_limits = \{"([^"]+)"', (ROOT / "docs" / "conformance.md").read_text())
    ids = [case.id for case, _ in plan_cases(Target.build("torch_ref"))]
    assert shown and any(fnmatch.fnmatchcase(i, shown.group(1)) for i in ids), \
        sorted(i for i in ids if "engine" in i)[:5]
