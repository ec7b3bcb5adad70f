#!/usr/bin/env bash
# The Gluon MLA kernel's GPU record in one device call (carry .gpu/flashinfer .gpu/install.sh):
#   bash benchmarks/gluon_session.sh [tests] [memcheck] [bench] [stress]
# tests: tests/gpu/test_gluon_mla_gpu.py but its stress loop (SPECATTN_GLUON_VARIANTS picks
# variants); memcheck: compute-sanitizer over a small ragged round; bench:
# benchmarks/bench_gluon_mla.py (GLUON_BENCH_ARGS adds arguments); stress: the 100-batch
# loop. Logs go to $OUT (gluon-*.log); exit status non-zero if a part failed.
set -uo pipefail
: "${OUT:?OUT must name the folder for the logs}"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-ws
eval "$(bash .gpu/install.sh /tmp/gpu-site flashinfer)" || exit 3
export PYTHONPATH=$PWD:$PYTHONPATH
status=0
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
  python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  date -u +%F; } | tee "$OUT/gluon-env.log"
for part in "${@:-tests memcheck bench stress}"; do
  for p in $part; do
    case $p in
      tests) timeout "${GLUON_TESTS_S:-240}" python -m pytest -q -p no:cacheprovider \
               -p no:warnings -rf --maxfail=8 tests/gpu/test_gluon_mla_gpu.py -k "not stress" \
               2>&1 | tail -n 40 | tee "$OUT/gluon-tests.log" || status=1 ;;
      memcheck) timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 \
               python benchmarks/bench_gluon_mla.py --small --variants "${GLUON_CHECK_VARIANTS:-gluon}" \
               2>&1 | tail -n 30 | tee "$OUT/gluon-memcheck.log" || status=1 ;;
      bench) timeout "${GLUON_BENCH_S:-300}" python benchmarks/bench_gluon_mla.py --out "$OUT" \
               ${GLUON_BENCH_ARGS:-} 2>&1 | tee "$OUT/gluon-bench.log" || status=1 ;;
      stress) timeout 200 python -m pytest -q -p no:cacheprovider -p no:warnings -rf \
               tests/gpu/test_gluon_mla_gpu.py -k stress 2>&1 | tail -n 20 \
               | tee "$OUT/gluon-stress.log" || status=1 ;;
    esac
  done
done
exit $status
