#!/usr/bin/env bash
# bash tools/sglang_wheels.sh: into .whl/ (git-ignored), for tools/gpu.sh sglang, the wheels
# SGLang 0.5.23's EAGLE draft path needs on the GPU host (Python 3.12, no index) beside the
# image's torch and triton: SGLang with --no-deps (it pins torch 2.14.1; import-only stand-ins
# replace sglang-kernel) and what its draft path imports that the image lacks (docs/sglang.md).
# SGLang's 39 MB wheel is recompressed with xz (21 MB): .whl, .gpu/flashinfer and the
# repository fit one 64 MiB transfer.
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
du -sh .whl
if [ -d .gpu/flashinfer ]; then du -sch .whl .gpu/flashinfer .gpu/install.sh | tail -n 1; fi
