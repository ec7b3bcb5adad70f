#!/usr/bin/env bash
# SGLang's own EAGLE draft loop on the GPU host, SGLang's backends against specattn's (one
# GPU run; carry .gpu/flashinfer .gpu/install.sh .whl, the wheels of
# tools/sglang_wheels.sh):
#
#   bash tools/sglang_gpu.sh [tools/sglang_gpu.py options, e.g. --budget-s 240]
#
# Unpacks the FlashInfer bundle into /tmp/gpu-site, SGLang (the recompressed wheel: no
# dependencies, so no sglang-kernel) and the light wheels into /tmp/site, runs tools/sglang_gpu.py into $OUT/sglang
# (results.md, results.csv, timing.csv, harness.log), then the quick GPU test
# (tests/gpu/test_sglang_gpu.py, $OUT/sglang/gpu-test.log) on the warm compile caches.
# Budget: install ~30 s + the harness's --budget-s (default here 240 s, plus the case in
# flight) + the test ~60 s (SGLANG_GPU_TEST=0 skips it). The device's copy of .git can be stale: SPECATTN_COMMIT=<sha>.
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
timeout 420 python3 tools/sglang_gpu.py --out "$OUT/sglang" --budget-s 240 "$@" \
  > "$OUT/sglang/harness.log" 2>&1 || status=1
tail -n 5 "$OUT/sglang/harness.log"
if [ "${SGLANG_GPU_TEST:-1}" != 0 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_sglang_gpu.py \
    > "$OUT/sglang/gpu-test.log" 2>&1 || status=1
  tail -n 1 "$OUT/sglang/gpu-test.log"
fi
exit $status
