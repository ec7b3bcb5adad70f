#!/usr/bin/env bash
# SGLang's own EAGLE draft loop on the GPU host:  bash tools/sglang_gpu.sh [sglang_gpu.py options]
# (e.g. --preset quick). Carry .gpu/flashinfer, .gpu/install.sh and .whl (tools/sglang_wheels.sh);
# runs tools/sglang_gpu.py into $OUT/sglang, then tests/gpu/test_sglang_gpu.py (SGLANG_GPU_TEST=0
# skips it). SPECATTN_COMMIT names the commit in the report.
set -uo pipefail
: "${OUT:?OUT must name the folder for the results}"
mkdir -p "$OUT/sglang"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-ws TRITON_CACHE_DIR=/tmp/triton-cache
line=$(bash .gpu/install.sh /tmp/gpu-site flashinfer) || { echo "no FlashInfer bundle" >&2; exit 3; }
eval "$line"
[ -f .whl/sglang-0.5.23-cp312.tar.xz ] || { echo ".whl/ lacks SGLang: run tools/sglang_wheels.sh" >&2; exit 3; }
mkdir -p /tmp/site
[ -d /tmp/site/sglang ] || tar xJf .whl/sglang-0.5.23-cp312.tar.xz -C /tmp/site || exit 3
if ! python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>"$OUT/sglang/install.log"; then
  # pip refused a tag: unpack the wheels as they are (install.sh does the same)
  python3 -c 'import sys, zipfile
for w in sys.argv[2:]: zipfile.ZipFile(w).extractall(sys.argv[1])' /tmp/site .whl/*.whl || exit 3
fi
export PYTHONPATH=$PWD:/tmp/site:$PYTHONPATH
status=0
timeout 420 python3 tools/sglang_gpu.py --out "$OUT/sglang" "$@" > "$OUT/sglang/harness.log" 2>&1 || status=1
tail -n 5 "$OUT/sglang/harness.log"
if [ "${SGLANG_GPU_TEST:-1}" != 0 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_sglang_gpu.py \
    > "$OUT/sglang/gpu-test.log" 2>&1 || status=1
  tail -n 1 "$OUT/sglang/gpu-test.log"
fi
exit $status
