#!/usr/bin/env bash
# The wheels SGLang 0.5.23's EAGLE draft path needs on the GPU host (Python 3.12, x86_64, no
# package index) beside the image's torch and triton, downloaded into the repository's .whl/
# (git-ignored) for `tools/sglang_gpu.sh` (carry .whl with .gpu/flashinfer and .gpu/install.sh).
#
#   bash tools/sglang_wheels.sh
#
# SGLang goes in with --no-deps: it pins torch 2.14.1, so its compiled sglang-kernel cannot
# load next to the image's torch 2.11 and is not fetched (tools/sglang_gpu.py installs
# import-only stubs for sgl_kernel, IPython and datasets that raise when called). The list is
# what `import sglang.srt.speculative.draft_utils`, SGLang's Triton and FlashInfer attention
# backends, its EAGLE draft CUDA-graph runner and its attention test kit need that the GPU
# image lacks (docs/sglang.md); apache-tvm-ffi comes with the FlashInfer bundle (.gpu/flashinfer).
# Versions: ones SGLang 0.5.23's metadata accepts (it pins compressed-tensors 0.18.0).
# SGLang's 39 MB wheel is unpacked and recompressed with xz into
# .whl/sglang-0.5.23-cp312.tar.xz (the same files, 21 MB: a GPU run carries at most 64 MiB,
# the repository and .gpu/flashinfer included); tools/sglang_gpu.sh unpacks it.
set -euo pipefail
cd "$(dirname "$0")/.."
# SGLang 0.5.23's wheel is tagged manylinux_2_34 (the GPU image's Python 3.12.3 has a newer glibc).
plat=(--python-version 3.12 --implementation cp --only-binary=:all:
      --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
wheels=(
  sglang==0.5.23
  orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  starlette==1.10.0 fastapi==0.165.0 uvicorn==0.54.0 setproctitle==1.3.8 dill==0.4.1
  compressed-tensors==0.18.0 gguf==0.19.0 partial-json-parser==0.2.1.1.post7
  loguru==0.7.3 openai==2.8.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1
  opentelemetry-api==1.45.2
)
mkdir -p .whl
python3 -m pip download -q --no-deps "${plat[@]}" -d .whl "${wheels[@]:1}"
sglang_xz=.whl/sglang-0.5.23-cp312.tar.xz
if [ ! -f "$sglang_xz" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" "${wheels[0]}"
  mkdir "$tmp/site"
  python3 -c 'import glob, sys, zipfile
zipfile.ZipFile(glob.glob(sys.argv[1] + "/sglang-*.whl")[0]).extractall(sys.argv[1] + "/site")' "$tmp"
  tar cf - -C "$tmp/site" . | xz -T0 -9 > "$sglang_xz.part" && mv "$sglang_xz.part" "$sglang_xz"
  rm -rf "$tmp"
fi
# Anything else in .whl/ travels too (and is installed by tools/sglang_gpu.sh): name it.
python3 - "${wheels[@]}" <<'EOF'
import os, re, sys
want = {re.sub(r"[-_.]+", "_", w.split("==")[0]).lower() for w in sys.argv[1:]}
extra = [f for f in sorted(os.listdir(".whl"))
         if re.sub(r"[-_.]+", "_", f.split("-")[0]).lower() not in want]  # sglang: the .tar.xz
if extra:
    print("sglang_wheels.sh: .whl/ also holds " + ", ".join(extra)
          + " (carried and installed with the others)", file=sys.stderr)
EOF
du -sh .whl
if [ -d .gpu/flashinfer ]; then du -sch .whl .gpu/flashinfer .gpu/install.sh | tail -n 1; fi
