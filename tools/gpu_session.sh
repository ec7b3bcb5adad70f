#!/usr/bin/env bash
# Every GPU test and the full `specattn bench` record in two back-to-back device calls (the
# offline bundle's FA4 half must be unpacked by an earlier call: a call carries <= 64 MiB).
#
#   call 1, carry .gpu/fa4-first .gpu/install.sh .whl (sgl-flash-mla wheel):
#       bash tools/gpu_session.sh first
#     unpacks fa4-first, installs the FlashMLA wheel, runs the GPU tests that need neither
#     FlashInfer nor FA4 (triton but its stress loop, dsa/dsv4, flashmla).
#   call 2, at once (the machine stays warm 30 s), carry .gpu/flashinfer .gpu/fa4 .gpu/install.sh:
#       bash tools/gpu_session.sh second [--no-bench | --bench-only]
#     runs the Triton stress loop, the FlashInfer and FlashAttention GPU tests and the bench
#     record (every standard case, uniform + ragged, then the quick prefix sweep; flashmla
#     too, through the wheel that call 1 installed in /tmp/site) into $OUT/bench.tgz, Triton
#     at mla-long-k8, and the step parts of FlashInfer at gqa-long / mla-long
#     (`specattn bench --parts`, $OUT/flashinfer-parts.tgz); --bench-only skips the
#     FlashInfer / FlashAttention suites and the step parts.
#
# Logs go to $OUT (one file per suite); the exit status is non-zero if any suite failed.
# The device's copy of .git can be stale: pass the commit, `SPECATTN_COMMIT=<sha> bash ...`.
# Budget: about 7 min (call 1) + 9 min (call 2) of device time on an H200 (session 3:
# 363 s + 465 s; session 4, cold machine: 496 s + 289 s with --bench-only).
set -uo pipefail
: "${OUT:?OUT must name the folder for the logs}"
site=/tmp/gpu-site
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-ws
status=0

suite() {  # suite NAME TIMEOUT_S pytest-args...: one GPU test file, summary to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  { echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)," \
         "$(python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')," \
         "commit ${SPECATTN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}, $(date -u +%F)"
    echo "# python -m pytest $*"
    timeout "$limit" python -m pytest -q -p no:cacheprovider -p no:warnings -rf "$@" 2>&1 \
      | grep -v '^  warn' | tail -n 30
  } > "$OUT/$name.log"
  local summary
  summary=$(tail -n 1 "$OUT/$name.log")
  echo "$name: $summary"
  # pytest's last line: "N passed ..." with no failure or error (a time-out leaves none).
  if ! [[ $summary =~ (passed|skipped) ]] || [[ $summary =~ (failed|error) ]]; then
    status=1
  fi
}

first() {
  bash .gpu/install.sh "$site" fa4-first >/dev/null || exit 3
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  fi
  export PYTHONPATH=/tmp/site:$PWD
  # The 100-batch stress loop runs in 'second': on a cold machine (compiles) the whole file
  # needed more than 420 s (session 4: 19 of 20 tests in 420 s).
  suite triton-gpu-tests 420 tests/gpu/test_triton_gpu.py -k "not stress"
  suite dsa-dsv4-gpu-tests 120 tests/gpu/test_dsa_dsv4_gpu.py
  suite flashmla-gpu-tests 60 tests/gpu/test_flashmla_gpu.py
}

second() {
  local line
  line=$(bash .gpu/install.sh "$site" flashinfer fa4) || {
    echo "fa4-first is missing: the machine went cold; redo 'first' then 'second'" >&2; exit 3; }
  eval "$line"
  export PYTHONPATH=$PWD:$PYTHONPATH
  [ -d /tmp/site/flash_mla ] && export PYTHONPATH=$PYTHONPATH:/tmp/site  # from 'first'

  suite triton-stress-gpu-test 150 tests/gpu/test_triton_gpu.py -k stress
  if [ "${1:-}" != "--bench-only" ]; then
    suite flashinfer-gpu-tests 240 tests/gpu/test_flashinfer_gpu.py
    suite flash-attn-gpu-tests 180 tests/gpu/test_flash_attn_gpu.py
    suite bench-gpu-test 120 tests/test_bench.py -k gpu
  fi
  [ "${1:-}" = "--no-bench" ] && return
  local specattn=(python -m specattn)
  local bench=("${specattn[@]}" bench --out /tmp/bench --backend triton flashinfer fa4 flashmla raw)
  rm -rf /tmp/bench
  timeout 270 "${bench[@]}" --case gqa-long gqa-paged gqa-chain gqa-small --no-sweep \
    > "$OUT/bench.log" 2>&1 || status=1
  timeout 170 "${bench[@]}" --case mla-long mla-long-p64 extend --no-sweep --append \
    >> "$OUT/bench.log" 2>&1 || status=1
  timeout 110 "${bench[@]}" --only-sweep --quick --append >> "$OUT/bench.log" 2>&1 || status=1
  # One archive: the device returns a limited number of files per call.
  [ -d /tmp/bench ] && tar czf "$OUT/bench.tgz" -C /tmp bench
  # MLA at K = 8 (not a standard case; issue #4's per-branch ratio), Triton only.
  timeout 90 "${specattn[@]}" bench --case mla-long-k8 --backend triton --out /tmp/k8 \
    > "$OUT/triton-mla-k8.log" 2>&1 || status=1
  [ "${1:-}" = "--bench-only" ] && return
  # Where a FlashInfer step's time goes: metadata host time, the kernels of one step.
  timeout 120 "${specattn[@]}" bench --case gqa-long mla-long --backend flashinfer --quick \
    --parts --out /tmp/fi > "$OUT/flashinfer-parts.log" 2>&1 || status=1
  [ -d /tmp/fi ] && tar czf "$OUT/flashinfer-parts.tgz" -C /tmp fi
}

case "${1:-}" in
  first) first ;;
  second) shift; second "$@" ;;
  *) echo "usage: $0 first | second [--no-bench | --bench-only]" >&2; exit 2 ;;
esac
exit $status
