#!/usr/bin/env bash
# Issue #15/#16/#17/#19 verification on an H200 in two back-to-back device calls: the
# conformance kit on every GPU backend, a random-batch soak (~10,000 rounds in all),
# compute-sanitizer memcheck over small ragged runs and out-of-pool req_to_token entries, the
# GPU test suites, then timings (a quick bench of the changed kernels and the same bench of
# the pre-refactor package, back to back).
#
#   call 1, carry .gpu/fa4-first .gpu/install.sh .whl (the sgl-flash-mla wheel):
#       bash tools/gpu_check.sh first       # triton, gluon MLA, dsa, dsv4, flashmla
#   call 2, at once (the machine stays warm 30 s), carry .gpu/flashinfer .gpu/fa4
#   .gpu/install.sh .before (git archive of the pre-refactor specattn/, e.g.
#   `git archive 15e7525 specattn | tar -x -C .before`):
#       bash tools/gpu_check.sh second      # flashinfer, fa4, fa3, the SGLang adapter, timings
#   Shorter sessions: `fa4-first` (carry .gpu/fa4-first .gpu/install.sh), then at once
#   `followup` (GPU suites of the Triton family, soaks, before/after bench), `soak` (the
#   soak over every GPU backend but flashmla) or `verify` (a Triton kernel change: suites,
#   kit, memcheck, soaks, then the Gluon MLA bench); `flashmla` (carry .gpu/install.sh .whl)
#   and `ws-first` (no carry) stand alone; `gluon-first` (carry .gpu/flashinfer
#   .gpu/install.sh) runs a new Gluon kernel's tests, checks and bench in one call;
#   `cute-probe` (after `fa4-first`, carry .gpu/flashinfer .gpu/fa4 .gpu/install.sh) runs the
#   CuTe-DSL probes; see the functions below.
#
# Correctness jobs run side by side (16 cores, one GPU); timings run alone at the end.
# Logs go to $OUT (at most 8 files come back from a call: pack more into a tar); the exit
# status is non-zero if a job failed.
set -uo pipefail
: "${OUT:?OUT must name the folder for the logs}"
site=/tmp/gpu-site
logs=/tmp/gpu-check-logs  # packed into $OUT/logs.tgz at the end (8 files come back at most)
# This call's logs only: a machine can keep /tmp from an earlier call, even an earlier
# session's, and check() sums up every log in the folder.
rm -rf "$logs"
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-ws
export TRITON_CACHE_DIR=/tmp/triton-cache  # shared by every job and both calls (warm machine)
status=0

header() {
  echo "# $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)," \
       "$(python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')," \
       "commit ${SPECATTN_COMMIT:-?}, $(date -u +%FT%TZ)"
}

job() {  # job NAME TIMEOUT_S command...: output to $logs/NAME.log, exit status at its end
  local name=$1 limit=$2
  shift 2
  { header; echo "# $*"; timeout "$limit" "$@"; echo "# exit status $?"; } \
    > "$logs/$name.log" 2>&1
}

check() {  # every job log ends with "exit status 0"; the logs go back as one archive
  for f in "$logs"/*.log; do
    echo "$(basename "$f" .log): $(tail -n 1 "$f")"
  done | tee "$OUT/summary.txt"
  grep -q -v "# exit status 0$" "$OUT/summary.txt" && status=1
  tar czf "$OUT/logs.tgz" -C "$logs" .
}

# -v: one line per case as it finishes, so a job cut by its time limit still names its cases.
vendor_libs() {  # FlashInfer and FA4 from the bundle (FA4 needs an earlier fa4-first call)
  eval "$(bash .gpu/install.sh "$site" flashinfer fa4)" || exit 3
  export PYTHONPATH=/tmp/site:$PYTHONPATH:$PWD
}

bench_ab() {  # bench_ab "CASES" [ARGS...]: timings, alone on the GPU: a quick bench of CASES
  # (triton, flashinfer, fa4) on this commit with ARGS added, then on the pre-refactor package
  # (.before, no raw baselines), back to back.
  local cases=$1
  shift
  local bench="python -m specattn.cli bench --quick --no-sweep --no-round --case $cases --backend triton flashinfer fa4"
  job bench-after 140 $bench "$@" --out /tmp/bench-after
  # From inside .before: `python -m` puts the working directory first on sys.path.
  (cd .before && job bench-before 110 $bench --no-raw --out /tmp/bench-before)
  cp /tmp/bench-after/table.md "$logs/bench-after.md" 2>/dev/null
  cp /tmp/bench-before/table.md "$logs/bench-before.md" 2>/dev/null
}

KIT="python -m pytest -v -p no:cacheprovider -rfE tests/conformance"
SOAK="python -m specattn.testing.soak"

first() {
  bash .gpu/install.sh "$site" fa4-first >/dev/null || exit 3
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
  job kit-1 560 $KIT -n 4 -k "test_triton or test_dsa or test_flashmla_gpu or (test_dsv4 and not hip and not npu)" &
  job soak-triton 560 $SOAK --backend triton --rounds 20000 --workers 4 --same-config 50 --max-seconds 470 &
  job soak-dsa 560 $SOAK --backend dsa --rounds 20000 --workers 2 --same-config 50 --max-seconds 470 &
  job soak-dsv4 560 $SOAK --backend dsv4 --rounds 20000 --same-config 20 --workers 2 --max-seconds 470 &
  job soak-flashmla 560 $SOAK --backend flashmla --rounds 20000 --same-config 20 --workers 2 --max-seconds 470 &
  job gpu-tests-1 560 python -m pytest -v -p no:cacheprovider -rfE -n 2 tests/gpu/test_triton_gpu.py tests/gpu/test_gluon_mla_gpu.py tests/gpu/test_dsa_dsv4_gpu.py tests/gpu/test_flashmla_gpu.py &
  job memcheck-1 560 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 python tools/oob_run.py --backend triton dsa dsv4 flashmla &
  wait
  check
}

second() {
  vendor_libs
  job kit-2 320 $KIT -n 3 -k "test_flashinfer_gpu or test_fa4_gpu or test_fa3_gpu" &
  job soak-flashinfer 320 $SOAK --backend flashinfer --rounds 20000 --same-config 20 --workers 4 --max-seconds 260 &
  job soak-fa4 320 $SOAK --backend fa4 --rounds 20000 --workers 2 --max-seconds 260 &
  job soak-fa3 320 $SOAK --backend fa3 --rounds 20000 --workers 2 --max-seconds 260 &
  job gpu-tests-2 320 python -m pytest -v -p no:cacheprovider -rfE -n 2 tests/gpu/test_flashinfer_gpu.py tests/gpu/test_flash_attn_gpu.py tests/gpu/test_sglang_adapter_gpu.py &
  job memcheck-2 320 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 python tools/oob_run.py --backend flashinfer fa4 &
  wait
  bench_ab "gqa-long mla-long mla-long-p64 extend" --case mla-k1 mla-small --backend raw
  check
}

# A follow-up call after `install.sh fa4-first` alone (carry .gpu/flashinfer .gpu/fa4
# .gpu/install.sh .before; no room for .whl, so FlashMLA's tests skip): the Triton-family GPU
# tests one name per line, more soak rounds on the fast backends, then the before/after bench.
followup() {
  vendor_libs
  job gpu-tests-1v 330 python -m pytest -v -p no:cacheprovider -rfE -n 3 tests/gpu/test_triton_gpu.py tests/gpu/test_gluon_mla_gpu.py tests/gpu/test_dsa_dsv4_gpu.py &
  job soak-fa4-b 330 $SOAK --backend fa4 --seed 100000 --rounds 20000 --workers 3 --max-seconds 280 &
  job soak-fa3-b 330 $SOAK --backend fa3 --seed 100000 --rounds 20000 --workers 2 --max-seconds 280 &
  job soak-dsv4-b 330 $SOAK --backend dsv4 --seed 100000 --rounds 20000 --same-config 20 --workers 2 --max-seconds 280 &
  job soak-flashinfer-b 330 $SOAK --backend flashinfer --seed 100000 --rounds 20000 --same-config 20 --workers 3 --max-seconds 280 &
  wait
  bench_ab "gqa-long mla-long extend" --no-raw
  check
}

# The soak, after `install.sh fa4-first` (carry .gpu/flashinfer .gpu/fa4 .gpu/install.sh):
# every GPU backend but flashmla (its wheel does not fit beside FA4), 14 worker processes, one
# shared Triton cache, runs of seeds sharing a kernel configuration; beside it the Triton
# family's kit and GPU suites.
soak_only() {
  vendor_libs
  local s="--seed 200000 --rounds 40000 --max-seconds ${SOAK_SECONDS:-480}"
  job soak-triton 560 $SOAK --backend triton $s --workers 3 --same-config 50 &
  job soak-dsa 560 $SOAK --backend dsa $s --workers 2 --same-config 50 &
  job soak-dsv4 560 $SOAK --backend dsv4 $s --workers 2 --same-config 20 &
  # The Triton family's kit and GPU suites beside the soak (flashmla's skip without its wheel).
  job kit-triton 560 $KIT -n 2 -k "test_triton or test_dsa or (test_dsv4 and not hip and not npu)" &
  job gpu-tests-triton 560 python -m pytest -v -p no:cacheprovider -rfE -n 2 tests/gpu/test_triton_gpu.py tests/gpu/test_gluon_mla_gpu.py tests/gpu/test_dsa_dsv4_gpu.py &
  job soak-flashinfer 560 $SOAK --backend flashinfer $s --workers 3 --same-config 20 &
  job soak-fa4 560 $SOAK --backend fa4 $s --workers 2 &
  job soak-fa3 560 $SOAK --backend fa3 $s --workers 2 &
  wait
  check
}

# A Triton-kernel change verified in one call after `install.sh fa4-first` (carry
# .gpu/flashinfer .gpu/fa4 .gpu/install.sh): the Triton family's GPU suites with both stress
# loops, the kit on triton, memcheck on triton, soaks on triton, flashinfer, fa4 and fa3 side by
# side; then, alone on the GPU, the Gluon MLA bench (tools/gluon_session.sh bench, with its
# GLUON_* settings).
verify() {
  vendor_libs
  local s="--seed ${SOAK_SEED:-300000} --rounds 40000 --max-seconds ${SOAK_SECONDS:-250}"
  # Seven Gluon variants do not fit the limit beside the soaks: the default and the work list.
  job gpu-tests-gluon 300 env SPECATTN_GLUON_VARIANTS="${VERIFY_VARIANTS:-default,n64s2-wl}" \
    python -m pytest -v -p no:cacheprovider -rfE tests/gpu/test_gluon_mla_gpu.py &
  job gpu-tests-triton 300 python -m pytest -v -p no:cacheprovider -rfE tests/gpu/test_triton_gpu.py &
  job kit-triton 300 $KIT -n 2 -k test_triton &
  job memcheck-triton 300 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 python tools/oob_run.py --backend triton &
  job soak-triton 300 $SOAK --backend triton $s --workers 4 --same-config 50 &
  job soak-flashinfer 300 $SOAK --backend flashinfer $s --workers 2 --same-config 20 &
  job soak-fa4 300 $SOAK --backend fa4 $s --workers 2 &
  job soak-fa3 300 $SOAK --backend fa3 $s --workers 2 &
  wait
  job gluon-bench 280 bash tools/gluon_session.sh bench
  cp "$OUT/gluon-bench.md" "$logs/" 2>/dev/null
  check
}

# FlashMLA alone (carry .gpu/install.sh .whl: the sgl-flash-mla wheel, which does not fit in
# a carry beside FA4): its kit cases, a soak and memcheck, side by side.
flashmla_only() {
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
  local s="--seed ${SOAK_SEED:-400000} --rounds 40000 --max-seconds ${SOAK_SECONDS:-150}"
  job kit-flashmla 240 $KIT -n 2 -k test_flashmla_gpu &
  job soak-flashmla 240 $SOAK --backend flashmla $s --workers 6 --same-config 20 &
  job memcheck-flashmla 240 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 python tools/oob_run.py --backend flashmla &
  wait
  check
}

# The warp-specialized Gluon MLA kernel's first run (no carry needed): its GPU test variants
# alone, one process, every test under a time limit, because a wrong mbarrier phase hangs
# instead of failing. Then `verify` with GLUON_OPTIONS naming the ws configs.
ws_first() {
  export PYTHONPATH=$PWD
  job gpu-tests-ws 240 env SPECATTN_GLUON_VARIANTS=n64s2-ws,n32s4-ws python -m pytest -v -x -n 0 -p no:cacheprovider -rfE --timeout 90 tests/gpu/test_gluon_mla_gpu.py -k "not stress"
  check
}

# A Gluon MLA kernel's first run and its checks in one call (carry .gpu/flashinfer
# .gpu/install.sh): the GPU tests of GATE_VARIANTS alone (two processes, a limit per test: a
# wrong loop bound hangs instead of failing); only if they pass, side by side the Gluon stress
# loops (STRESS_VARIANTS), the Triton GPU suite, the kit, memcheck and a soak on triton
# (SOAK_OPTION: e.g. 'triton:config=...' for an opt-in kernel); then the Gluon MLA bench
# alone (tools/gluon_session.sh bench, with its GLUON_* settings), with GLUON_PARTS=1 its
# `parts`, and with GLUON_DIAG=1 tools/gluon_diag.py. GATE_VARIANTS=none skips the gate;
# GLUON_CHECKS names the side-by-side checks (default: stress triton kit memcheck soak),
# CHECKS_S their time limit (default 180 s), STRESS_WORKERS the stress loop's processes
# (default 2).
gluon_first() {
  eval "$(bash .gpu/install.sh "$site" flashinfer)" || exit 3
  export PYTHONPATH=$PYTHONPATH:$PWD
  local t="python -m pytest -v -n 2 -p no:cacheprovider -rfE"
  if [ "$GATE_VARIANTS" != none ]; then  # none: kernels unchanged since a passing gate
    job gpu-tests-gate "${GATE_S:-150}" env SPECATTN_GLUON_VARIANTS="$GATE_VARIANTS" $t -x \
      --timeout 120 tests/gpu/test_gluon_mla_gpu.py -k "not stress"
    if ! tail -n 1 "$logs/gpu-tests-gate.log" | grep -q "exit status 0$"; then
      check
      return
    fi
  fi
  local s="--seed ${SOAK_SEED:-500000} --rounds 40000 --max-seconds ${SOAK_SECONDS:-150}"
  local checks=" ${GLUON_CHECKS:-stress triton kit memcheck soak} " limit=${CHECKS_S:-180}
  # The stress loop compiles a kernel per (H, dtype, mode, cap) it draws: 120 s per test
  # cut it in session 8. It now runs as 4 tests (2 workers here) under the job's limit.
  [[ $checks == *" stress "* ]] && job gpu-stress-gluon "$limit" \
    env SPECATTN_GLUON_VARIANTS="${STRESS_VARIANTS:-default}" $t -n "${STRESS_WORKERS:-2}" \
    tests/gpu/test_gluon_mla_gpu.py -k stress &
  [[ $checks == *" triton "* ]] && job gpu-tests-triton "$limit" $t --timeout 120 \
    tests/gpu/test_triton_gpu.py -k "not stress" &
  [[ $checks == *" kit "* ]] && job kit-triton "$limit" $KIT -n 2 -k test_triton &
  [[ $checks == *" memcheck "* ]] && job memcheck-triton "$limit" compute-sanitizer \
    --tool memcheck --report-api-errors no --error-exitcode 1 python tools/oob_run.py \
    --backend triton &
  # SOAK_OPTION: a constructor option for the soak, e.g. a config the default does not run
  # (the soak skips the cases it does not apply to).
  [[ $checks == *" soak "* ]] && job soak-triton "$limit" $SOAK --backend triton $s \
    --workers 3 --same-config 50 ${SOAK_OPTION:+--option "$SOAK_OPTION"} &
  wait
  job gluon-bench "${GLUON_BENCH_S:-230}" bash tools/gluon_session.sh bench
  cp "$OUT/gluon-bench.md" "$logs/" 2>/dev/null
  if [ -n "${GLUON_PARTS:-}" ]; then  # each kernel's time in one step, alone on the GPU
    job gluon-parts "${GLUON_PARTS_S:-120}" bash tools/gluon_session.sh parts
  fi
  if [ -n "${GLUON_DIAG:-}" ]; then  # tools/gluon_diag.py, alone on the GPU
    job gluon-diag "${GLUON_DIAG_S:-150}" bash tools/gluon_session.sh diag
    cp "$OUT/gluon-diag.md" "$logs/" 2>/dev/null
  fi
  check
}

# The CuTe-DSL probes on the GPU (after `fa4-first`; carry .gpu/flashinfer .gpu/fa4
# .gpu/install.sh): tests/gpu/test_cute_probes_gpu.py, a cluster merge of split partials and
# one MLA key tile's wgmma math (#19).
# CUTE_CHECKS adds `kit` (the kit on triton), `sglang` (the SGLang adapter's GPU tests) and
# `triton` (the Triton GPU suite) side by side with the probes, and `cute`: the CuTe-DSL MLA
# kernel (config label CUTE_CONFIG). Its GPU tests (tests/gpu/test_gluon_mla_gpu.py, variant
# `cute`; tests/gpu/test_cute_mla_gpu.py: every cluster shape and the kit with it) run alone
# first; only if they pass, side by side its stress loop, memcheck over a small ragged round
# and a soak on triton with it (CUTE_SIDE picks among those three; CUTE_VARIANTS: the test
# variants, default cute), then how many clusters of each size the GPU runs at
# once, then the MLA bench alone (default kernel, the CuTe kernel as planned and with 3 and
# 8 splits forced, and FlashInfer; GLUON_CASES, GLUON_BENCH_ARGS as in gluon_session.sh;
# CUTE_BENCH_OPTIONS: the Triton variants, as GLUON_OPTIONS there); CUTE_DIAG=1 adds tools/gluon_diag.py on the CuTe and Gluon kernels
# (CUTE_DIAG_CASES) at the end.
CUTE_CONFIG="m64 n64 w8 s2 kv-first gluon cute"

cute_stress_job() {  # cute_stress_job LIMIT_S VARIANT WORKERS: the 100-batch stress loop
  job gpu-stress-cute "$1" env SPECATTN_GLUON_VARIANTS="$2" python -m pytest -v \
    -p no:cacheprovider -rfE -n "$3" tests/gpu/test_gluon_mla_gpu.py -k stress
}

cute_memcheck_job() {  # cute_memcheck_job LABELS [LOG]: memcheck over a small ragged round,
  # the default config and each `;`-separated label (one after the other, one log, default
  # memcheck-cute; LABELS "" for the default alone)
  local options=() c
  IFS=';' read -r -a configs <<< "$1"
  for c in "${configs[@]}"; do options+=(--option "triton:config=$c"); done
  job "${2:-memcheck-cute}" 200 compute-sanitizer --tool memcheck --report-api-errors no \
    --error-exitcode 9 python -m specattn bench --mla --batch 3 --prefix 300 --topk 4 \
    --num-steps 3 --steps --backend triton --check-only --out /tmp/cute-check "${options[@]}"
}

cute_probe() {
  vendor_libs
  local checks=" ${CUTE_CHECKS:-} " t="python -m pytest -v -p no:cacheprovider -rfE"
  job gpu-tests-cute-probes 240 $t tests/gpu/test_cute_probes_gpu.py &
  job memcheck-cute-tile-probe 240 compute-sanitizer --tool memcheck --error-exitcode 1 \
    python tools/cute_mla_tile_probe.py --run &
  [[ $checks == *" kit "* ]] && job kit-triton 300 $KIT -n 2 -k test_triton &
  [[ $checks == *" sglang "* ]] && job gpu-tests-sglang 300 $t \
    tests/gpu/test_sglang_adapter_gpu.py &
  [[ $checks == *" triton "* ]] && job gpu-tests-triton 300 $t -n 2 --timeout 120 \
    tests/gpu/test_triton_gpu.py tests/gpu/test_gluon_mla_gpu.py -k "not stress" &
  if [[ $checks == *" cute "* ]]; then
    job gpu-tests-cute-gate "${GATE_S:-200}" \
      env SPECATTN_GLUON_VARIANTS="${CUTE_VARIANTS:-cute}" $t -n 2 -x \
      --timeout 240 tests/gpu/test_gluon_mla_gpu.py tests/gpu/test_cute_mla_gpu.py -k "not stress"
    if tail -n 1 "$logs/gpu-tests-cute-gate.log" | grep -q "exit status 0$"; then
      local s="--seed ${SOAK_SEED:-600000} --rounds 40000 --max-seconds ${SOAK_SECONDS:-120}"
      local side=" ${CUTE_SIDE:-stress memcheck soak} "
      [[ $side == *" stress "* ]] && cute_stress_job 200 cute 3 &
      [[ $side == *" memcheck "* ]] && cute_memcheck_job "$CUTE_CONFIG" &
      [[ $side == *" soak "* ]] && job soak-triton-cute 200 $SOAK --backend triton $s \
        --workers 3 --same-config 50 --option "triton:config=$CUTE_CONFIG" &
      wait
      job cute-clusters 60 python -c "$CLUSTERS"
      GLUON_OPTIONS="${CUTE_BENCH_OPTIONS:-$CUTE_CONFIG;triton:config=$CUTE_CONFIG,num_splits=3;triton:config=$CUTE_CONFIG,num_splits=8}" job cute-bench "${GLUON_BENCH_S:-230}" \
        bash tools/gluon_session.sh bench
      cp "$OUT/gluon-bench.md" "$logs/" 2>/dev/null
      if [ -n "${CUTE_DIAG:-}" ]; then  # where the CuTe kernel's time goes, beside Gluon's
        job cute-diag "${CUTE_DIAG_S:-240}" python tools/gluon_diag.py \
          --case ${CUTE_DIAG_CASES:-mla-long mla-small mla-wide} \
          --config "$CUTE_CONFIG" "m64 n64 w8 s2 kv-first gluon pf"
      fi
    fi
  fi
  wait
  check
}

# A CuTe kernel change checked in one short call (after `fa4-first`; carry .gpu/flashinfer
# .gpu/fa4 .gpu/install.sh): its GPU tests (the Gluon suite's variants CUTE_VARIANTS,
# default `cute` and `cute-fm`; every cluster shape with and without the fused merge; the kit
# with its config; CUTE_TESTS_K narrows them) beside a soak of the first bench label; then,
# whatever the tests said, CUTE_STAMPS=1 adds tools/cute_stamps.py (where a launch's time
# goes, per CTA) for every bench label, then the MLA bench of the kernel and its `fm` form
# beside the default and FlashInfer (GLUON_CASES; CUTE_BENCH_OPTIONS replaces the
# `;`-separated labels, CUTE_BENCH_ARGS adds bench flags), and tools/gluon_diag.py at two
# prefix lengths (the fixed cost per call and the time per tile; CUTE_NO_DIAG=1 skips it);
# CUTE_PARTS=1 adds `specattn bench --parts` (each kernel's time in one eager step: the CuTe
# kernel, the merge launch, the metadata) on mla-long and mla-small; CUTE_NO_BENCH=1 skips the
# bench (`cute-bench` runs it alone).
cute_quick() {
  vendor_libs
  local t="python -m pytest -v -p no:cacheprovider -rfE"
  local labels="${CUTE_BENCH_OPTIONS:-$CUTE_CONFIG;${CUTE_CONFIG/kv-first/kv-first fm}}"
  job gpu-tests-cute "${GATE_S:-200}" env SPECATTN_GLUON_VARIANTS="${CUTE_VARIANTS:-cute,cute-fm}" \
    $t -n 3 --timeout 240 \
    tests/gpu/test_gluon_mla_gpu.py tests/gpu/test_cute_mla_gpu.py -k "${CUTE_TESTS_K:-not stress}" &
  job soak-triton-cute "${GATE_S:-200}" $SOAK --backend triton --seed "${SOAK_SEED:-800000}" \
    --rounds 40000 --max-seconds "${SOAK_SECONDS:-60}" --workers 2 --same-config 50 \
    --option "triton:config=${labels%%;*}" &
  wait
  if [ -n "${CUTE_STAMPS:-}" ]; then
    IFS=';' read -r -a stamp_labels <<< "$labels"
    job cute-stamps "${STAMPS_S:-120}" python tools/cute_stamps.py \
      --case ${STAMPS_CASES:-mla-long mla-small mla-wide} --config "${stamp_labels[@]}"
  fi
  [ -z "${CUTE_NO_BENCH:-}" ] && cute_bench_job "$labels"
  [ -z "${CUTE_NO_DIAG:-}" ] && job cute-diag "${CUTE_DIAG_S:-120}" python tools/gluon_diag.py \
    --case mla-long --prefix 1024 4096 --config "$CUTE_CONFIG"
  if [ -n "${CUTE_PARTS:-}" ]; then  # each kernel's time in one eager step (torch.profiler)
    job cute-parts "${CUTE_PARTS_S:-120}" python -m specattn bench --quick --no-sweep \
      --case mla-long mla-small --backend triton --option "triton:config=$CUTE_CONFIG" \
      --parts --out /tmp/cute-parts
    cp /tmp/cute-parts/table.md "$logs/cute-parts.md" 2>/dev/null
  fi
  check
}

cute_bench_job() {  # cute_bench_job LABELS: the MLA bench of the `;`-separated labels
  GLUON_OPTIONS="$1" GLUON_BENCH_ARGS="${CUTE_BENCH_ARGS:-}" \
    GLUON_CASES="${GLUON_CASES:-mla-long mla-k1 mla-small mla-wide}" \
    job cute-bench "${GLUON_BENCH_S:-200}" bash tools/gluon_session.sh bench
  cp "$OUT/gluon-bench.md" "$logs/" 2>/dev/null
}

# The bench of `cute-quick` alone (same carry and knobs; a second call on the warm machine
# when the checks and the bench do not fit one call's 600 s).
cute_bench() {
  vendor_libs
  cute_bench_job "${CUTE_BENCH_OPTIONS:-$CUTE_CONFIG;${CUTE_CONFIG/kv-first/kv-first fm}}"
  check
}

# A CuTe kernel made the default, checked in one call (after `fa4-first`; same carry), side
# by side: the GPU tests of the variants CUTE_VARIANTS (default `cute`: the Gluon suite, every
# cluster shape, the kit with each of CUTE_LABEL's `;`-separated labels), the 100-batch
# stress loop of CUTE_STRESS_VARIANT (default `cute`) and memcheck with each label, a soak of
# CUTE_SOAK_LABEL (default the first label); then the stamps of CUTE_STAMP_LABELS
# (`;`-separated; default CUTE_LABEL) on STAMPS_CASES (CUTE_NO_STAMPS=1 skips them), and with
# CUTE_FINAL_BENCH=1 the bench of CUTE_BENCH_OPTIONS (`cute-bench`'s). CUTE_LABEL defaults to
# the kernel's config; CUTE_NO_STRESS=1 skips the stress loop (CUTE_STRESS_S, CUTE_STRESS_WORKERS: its limit and
# workers); session 14: CUTE_VARIANTS=cute,cute-wl CUTE_LABEL="$CUTE_CONFIG;...
# gluon wl cute". The stress loop needs about 180 s alone (four batches side by side): beside
# the rest it can pass its limit (session 13).
cute_final() {
  vendor_libs
  local t="python -m pytest -v -p no:cacheprovider -rfE" label="${CUTE_LABEL:-$CUTE_CONFIG}"
  job gpu-tests-cute "${GATE_S:-260}" env SPECATTN_GLUON_VARIANTS="${CUTE_VARIANTS:-cute}" \
    SPECATTN_CUTE_KIT_LABEL="$label" $t -n 3 --timeout 240 tests/gpu/test_gluon_mla_gpu.py \
    tests/gpu/test_cute_mla_gpu.py -k "not stress" &
  [ -z "${CUTE_NO_STRESS:-}" ] && cute_stress_job "${CUTE_STRESS_S:-260}" "${CUTE_STRESS_VARIANT:-cute}" \
    "${CUTE_STRESS_WORKERS:-2}" &
  cute_memcheck_job "$label" &
  job soak-triton-cute 200 $SOAK --backend triton --seed "${SOAK_SEED:-1000000}" --rounds 40000 \
    --max-seconds "${SOAK_SECONDS:-90}" --workers 2 --same-config 50 \
    --option "triton:config=${CUTE_SOAK_LABEL:-${label%%;*}}" &
  wait
  if [ -z "${CUTE_NO_STAMPS:-}" ]; then
    IFS=';' read -r -a stamp_labels <<< "${CUTE_STAMP_LABELS:-$label}"
    job cute-stamps "${STAMPS_S:-100}" python tools/cute_stamps.py \
      --case ${STAMPS_CASES:-mla-long mla-k1} --config "${stamp_labels[@]}"
  fi
  [ -n "${CUTE_FINAL_BENCH:-}" ] && \
    cute_bench_job "${CUTE_BENCH_OPTIONS:-$CUTE_CONFIG;${CUTE_CONFIG/kv-first/kv-first fm}}"
  check
}

# `cute-quick` as session 12 ran it for a kernel change (same carry): the Gluon suite's
# variant `cute` and every cluster shape without the fused merge or the kit, a longer soak,
# the stamps, and the bench of CUTE_BENCH_OPTIONS (default the kernel alone) on mla-long,
# mla-k1 and mla-wide without whole rounds or the sweep; no diag. Session 12 ran it with a
# trial label beside the kernel's.
cute_next() {
  CUTE_VARIANTS="${CUTE_VARIANTS:-cute}" \
    CUTE_TESTS_K="${CUTE_TESTS_K:-not stress and not fused and not conformance}" \
    GATE_S="${GATE_S:-220}" SOAK_SEED="${SOAK_SEED:-900000}" SOAK_SECONDS="${SOAK_SECONDS:-90}" \
    CUTE_BENCH_OPTIONS="${CUTE_BENCH_OPTIONS:-$CUTE_CONFIG}" CUTE_STAMPS=1 CUTE_NO_DIAG=1 \
    CUTE_BENCH_ARGS="${CUTE_BENCH_ARGS:---no-round --no-sweep}" \
    GLUON_CASES="${GLUON_CASES:-mla-long mla-k1 mla-wide}" GLUON_BENCH_S="${GLUON_BENCH_S:-260}" \
    cute_quick
}

# The default at one row tile by batch size (session 14; after `fa4-first`, same carry): the
# stress loop of CUTE_STRESS_VARIANT (default `cute-wl`; CUTE_NO_STRESS=1 skips it), then,
# alone, `specattn bench` of the `;`-separated CUTE_BENCH_OPTIONS beside the default and
# FlashInfer at MLA H 16, K SWEEP_TOPK (4), 5 steps, each prefix of SWEEP_PREFIX (4096) and
# each batch of SWEEP_BATCHES (8 16), decode only, then the bench of GLUON_CASES (when set)
# with CUTE_BENCH_ARGS.
cute_sweep() {
  vendor_libs
  [ -z "${CUTE_NO_STRESS:-}" ] && cute_stress_job "${CUTE_STRESS_S:-280}" \
    "${CUTE_STRESS_VARIANT:-cute-wl}" "${CUTE_STRESS_WORKERS:-4}"
  local options=() c b n
  IFS=';' read -r -a configs <<< "${CUTE_BENCH_OPTIONS:-$CUTE_CONFIG}"
  for c in "${configs[@]}"; do options+=("triton:config=$c"); done
  for n in ${SWEEP_PREFIX:-4096}; do
    for b in ${SWEEP_BATCHES:-8 16}; do
      job "sweep-b$b-p$n" "${SWEEP_S:-100}" python -m specattn bench --mla --steps \
        --batch "$b" --prefix "$n" --topk "${SWEEP_TOPK:-4}" --num-steps 5 \
        --backend triton flashinfer --option "${options[@]}" --no-sweep --no-round --no-raw \
        --out "/tmp/sweep-b$b-p$n"
      cp "/tmp/sweep-b$b-p$n/table.md" "$logs/sweep-b$b-p$n.md" 2>/dev/null
    done
  done
  [ -n "${GLUON_CASES:-}" ] && cute_bench_job "${CUTE_BENCH_OPTIONS:-$CUTE_CONFIG}"
  check
}

# Carry .gpu/fa4-first .gpu/install.sh .whl (the sgl-flash-mla wheel): unpacks fa4-first and
# the wheel into /tmp for a later call (the machine keeps /tmp while warm), then alone on the
# GPU: the read floors of the cases (the bench's `read-floor` rows: what one launch needs to
# read each case's bytes through its slots) and `specattn bench --parts` at mla-long-p64 on
# flashmla and triton (FlashMLA's own kernels' share of its step: page 64 only).
floors() {
  bash .gpu/install.sh "$site" fa4-first >/dev/null || exit 3
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
  job read-floor "${FLOOR_S:-240}" python -m specattn bench --quick --no-sweep --no-round \
    --no-raw --case ${FLOOR_CASES:-mla-small mla-long mla-k1 gqa-small gqa-long serving} \
    --backend triton --out /tmp/read-floor
  cp /tmp/read-floor/table.md "$logs/read-floor.md" 2>/dev/null
  job parts-p64 "${PARTS_S:-200}" python -m specattn bench --quick --no-sweep --no-round \
    --no-raw --case ${PARTS_CASES:-mla-long-p64} --backend flashmla triton --parts \
    --out /tmp/parts-p64
  cp /tmp/parts-p64/table.md "$logs/parts-p64.md" 2>/dev/null
  check
}

# The triton backend's default config on the H200 (call 2 of session 15, right after
# `floors` or `fa4-first`; carry .gpu/flashinfer .gpu/fa4 .gpu/install.sh), side by side: the
# kit on the default config at the full level (its K 8 cases take the CuTe kernel, the rest
# the Gluon work list) and the quick kit on triton, the Triton GPU suite and the Gluon suite's
# `default` variant with its stress loop, memcheck over a small ragged round; then alone the
# MLA bench of the default beside FlashInfer (and FlashMLA where its wheel is in /tmp/site)
# on DEFAULT_CASES, uniform and ragged, a case at a time into one table (BENCH_S each).
default_check() {
  vendor_libs
  local t="python -m pytest -v -p no:cacheprovider -rfE" limit=${CHECKS_S:-280}
  job kit-default-full "$limit" $t tests/gpu/test_cute_mla_gpu.py -k default_config &
  job kit-triton "$limit" $KIT -n 2 -k test_triton &
  job gpu-tests-triton "$limit" env SPECATTN_GLUON_VARIANTS=default $t -n 3 --timeout 240 \
    tests/gpu/test_triton_gpu.py tests/gpu/test_gluon_mla_gpu.py &
  cute_memcheck_job "" memcheck-triton &
  wait
  local backends="triton flashinfer"
  python -c "import flash_mla" 2>/dev/null && backends="$backends flashmla"
  local c
  for c in ${DEFAULT_CASES:-mla-long mla-k1 mla-small mla-long-p64 mla-wide}; do  # one table
    job "bench-$c" "${BENCH_S:-70}" python -m specattn bench --no-sweep --no-round --no-raw \
      --case "$c" --backend $backends --out /tmp/bench-default --append
    cp /tmp/bench-default/table.md "$logs/bench-default.md" 2>/dev/null
  done
  check
}

CLUSTERS="import torch; torch.cuda.init(); torch.zeros(1, device='cuda')
from specattn.backends.triton.cute_mla import max_active_clusters as c
print('clusters at once, by size:', {s: c(0, s) for s in range(1, 9)})"

# The CuTe-DSL MLA kernel under Nsight Compute (after `fa4-first`; carry .gpu/flashinfer
# .gpu/fa4 .gpu/install.sh): one launch at mla-long, the full set, and the cluster occupancy.
cute_ncu() {
  vendor_libs
  job cute-clusters 60 python -c "$CLUSTERS"
  job cute-ncu 200 ncu --clock-control none --set full -k regex:kernel_cutlass \
    --launch-skip 2 --launch-count 1 python -m specattn bench --case mla-long \
    --backend triton --check-only --out /tmp/cute-ncu --option "triton:config=$CUTE_CONFIG"
  check
}

case "${1:-}" in
  first) first ;;
  second) second ;;
  followup) followup ;;
  soak) soak_only ;;
  verify) verify ;;
  flashmla) flashmla_only ;;
  ws-first) ws_first ;;
  gluon-first) gluon_first ;;
  cute-probe) cute_probe ;;
  cute-ncu) cute_ncu ;;
  cute-quick) cute_quick ;;
  cute-bench) cute_bench ;;
  cute-final) cute_final ;;
  cute-next) cute_next ;;
  cute-sweep) cute_sweep ;;
  floors) floors ;;
  default-check) default_check ;;
  fa4-first) bash .gpu/install.sh "$site" fa4-first ;;
  *) echo "usage: bash tools/gpu_check.sh first|second|fa4-first|followup|soak|verify|flashmla|ws-first|gluon-first|cute-probe|cute-ncu|cute-quick|cute-bench|cute-final|cute-next|cute-sweep|floors|default-check" >&2; exit 2 ;;
esac
exit $status
