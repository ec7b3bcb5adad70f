#!/usr/bin/env bash
# The GPU script: run it from the repository root on a GPU host without network (the H200).
#
#   bash tools/gpu.sh fa4-first            unpack the first half of FlashAttention-4 into
#                                          /tmp/gpu-site (carry .gpu/install.sh .gpu/fa4-first;
#                                          a transfer holds 64 MiB: the next command, on the
#                                          same warm machine, carries .gpu/fa4)
#   bash tools/gpu.sh check [PYTEST_ARGS]  tests/gpu but the slow stress loops (PYTEST_ARGS
#                                          added), the conformance kit on every GPU backend,
#                                          compute-sanitizer memcheck over tools/oob_run.py
#                                          and the kit's CUDA-graph cases;
#                                          CHECK_STEPS="stress" runs the stress loops
#   bash tools/gpu.sh bench [ARGS]         python -m specattn bench ARGS, results in $OUT/bench/
#                                          and $OUT/bench.tgz
#   bash tools/gpu.sh sglang [ARGS]        SGLang's own EAGLE draft loop, stock against specattn
#                                          (tools/sglang_gpu.py ARGS, e.g. --preset quick) into
#                                          $OUT/sglang, then tests/gpu/test_sglang_gpu.py
#                                          (SGLANG_GPU_TEST=0 skips it); carry .gpu/install.sh,
#                                          .gpu/flashinfer and .whl (tools/sglang_wheels.sh)
#   bash tools/gpu.sh ab REF [ARGS]        that bench of REF/specattn (`mkdir -p .ab && git
#                                          archive TAG specattn | tar -x -C .ab`) and of this
#                                          tree, A B A B; times and ratio in $OUT/ab.md; with
#                                          AB_B=DIR, of DIR/specattn instead of this tree,
#                                          into $OUT/ab-<DIR's name>.md (several A/Bs in one
#                                          call, each B a folder like REF)
#   bash tools/gpu.sh host-ab REF ARGS     the replay metadata call's host time of REF/specattn
#                                          against this tree's, alternating in one process
#                                          (tools/host_ab.py REF ARGS: --case ... --backend
#                                          ...); the table in $OUT/host_ab.md
#
# Every command but fa4-first first unpacks the offline bundle (.gpu/, git-ignored: carry
# .gpu/install.sh with .gpu/flashinfer, and .gpu/fa4 after fa4-first), installs carried
# .whl/*.whl and prints the GPU and the library versions.
# Environment: OUT (the folder whose files come back; the GPU host sets it); GPU_PARTS (bundle
# parts to unpack; default: those carried); CHECK_STEPS (default "gpu-tests kit memcheck");
# KIT_K (the kit's -k; default: every GPU backend); GPU_TESTS (the gpu-tests and stress steps'
# paths; default tests/gpu), GPU_TESTS_N (gpu-tests' pytest-xdist workers; default 0, at most 4),
# GPU_TEST_TIMEOUT_S (one test's limit; default 240); BENCH_APPEND=1 (keep the last bench's
# folder: pass --append); AB_ROUNDS (default 2); STEP_TIMEOUT_S (per step; default none); GPU_COMMIT (the tree's commit, named in
# summary.md); GPU_DRY_RUN=1 (print the commands, run nothing).
# Output: $OUT/summary.md (a line per step), $OUT/logs.tgz (each step's log) and the command's
# results. Every step runs; the exit status is 1 when one failed.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
die() { echo "gpu.sh: $*" >&2; exit 3; }

[ $# -ge 1 ] || usage
cmd=$1
shift
case "$cmd" in fa4-first | check | bench | sglang | ab | host-ab) ;; *) usage ;; esac
: "${OUT:?OUT must name the folder whose files come back (the GPU host sets it)}"

BUNDLE=${GPU_BUNDLE:-.gpu}
SITE=${GPU_SITE:-/tmp/gpu-site}
WHEELS=/tmp/site
PY=${PYTHON:-python}
DRY=${GPU_DRY_RUN:-}
LOGS=$OUT/logs
SUMMARY=$OUT/summary.md
KIT_K=${KIT_K:-"test_triton or test_dsa or (test_dsv4 and not hip and not npu) or test_flashinfer_gpu or test_fa4_gpu or test_fa3_gpu or test_flashmla_gpu"}
failed=0
mkdir -p "$LOGS"
: > "$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME COMMAND...: its output into $LOGS/NAME.log, a pass/FAIL line into summary.md.
step() {
  local name=$1 rc=0 start=$SECONDS last
  shift
  if [ -n "$DRY" ]; then echo "$name: $(printf '%q ' "$@")"; return 0; fi
  echo "== $name: $*"
  { echo "# $*"; timeout "${STEP_TIMEOUT_S:-0}" "$@"; } > "$LOGS/$name.log" 2>&1 || rc=$?
  last=$(grep -v '^[[:space:]]*$' "$LOGS/$name.log" | tail -n 1 | cut -c1-160)
  if [ "$rc" = 0 ]; then
    note "- $name: pass ($((SECONDS - start)) s): $last"
  else
    note "- $name: FAIL (exit $rc, $((SECONDS - start)) s): $last"
    failed=1
  fi
}

setup() {
  local parts=${GPU_PARTS-} line
  if [ -z "${GPU_PARTS+set}" ]; then
    [ -d "$BUNDLE/flashinfer" ] && parts=flashinfer
    if [ -d "$BUNDLE/fa4" ]; then
      compgen -G "$SITE/.parts/*.part-0" > /dev/null \
        || die "$BUNDLE/fa4 needs the first half: run 'bash tools/gpu.sh fa4-first' in the call before"
      parts="$parts fa4"
    fi
  fi
  export FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/fi-ws PYTHONUNBUFFERED=1
  if [ ! -f "$BUNDLE/install.sh" ]; then echo "setup: no $BUNDLE/install.sh carried: no vendor libraries"
  elif [ -n "$DRY" ]; then echo "setup: eval \"\$(bash $BUNDLE/install.sh $SITE $parts)\""
  else
    line=$(bash "$BUNDLE/install.sh" "$SITE" $parts) || die "$BUNDLE/install.sh $parts failed"
    eval "$line"
  fi
  if compgen -G ".whl/*.whl" > /dev/null; then
    if [ -n "$DRY" ]; then echo "setup: $PY -m pip install ... --target $WHEELS .whl/*.whl"
    else  # a wheel pip refuses (its tags) is unpacked as it is, as install.sh does
      "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WHEELS" .whl/*.whl \
        || "$PY" -c 'import sys, zipfile
for w in sys.argv[2:]: zipfile.ZipFile(w).extractall(sys.argv[1])' "$WHEELS" .whl/*.whl
    fi
    export PYTHONPATH=$WHEELS${PYTHONPATH:+:$PYTHONPATH}
  fi
  LIBPATH=${PYTHONPATH:-}
  export PYTHONPATH=$PWD${LIBPATH:+:$LIBPATH}  # this tree first
  [ -n "$DRY" ] && return 0
  # The host's copy of .git may lag the tree it runs: GPU_COMMIT names the tree's commit.
  if [ -n "${GPU_COMMIT:-}" ]; then export SPECATTN_COMMIT=$GPU_COMMIT; fi
  note "# $cmd on $(date -u +%FT%TZ)${GPU_COMMIT:+, commit $GPU_COMMIT}; bundle parts: ${parts:-none}"
  nvidia-smi -L 2>&1 | tee -a "$SUMMARY" || true
  "$PY" - << 'EOF' 2>&1 | tee -a "$SUMMARY" || true
import importlib, importlib.metadata as md, torch
dists = {"triton": "triton", "flashinfer": "flashinfer-python", "flash_attn": "flash-attn-4",
         "cutlass": "nvidia-cutlass-dsl", "flash_mla": "sgl-flash-mla"}
print(f"torch {torch.__version__} (CUDA {torch.version.cuda})", end="")
for mod, dist in dists.items():
    try:
        m = importlib.import_module(mod)
        try:
            v = getattr(m, "__version__", None) or md.version(dist)
        except md.PackageNotFoundError:
            v = "?"
        print(f", {mod} {v}", end="")
    except Exception as exc:  # not carried, or broken: say which
        print(f", {mod} not importable ({type(exc).__name__})", end="")
print()
EOF
}

sanitizer() {  # compute-sanitizer from PATH, else beside nvcc (the CUDA toolkit's bin/)
  local c d
  command -v compute-sanitizer && return 0
  d=$(dirname "$(command -v nvcc || echo /none/nvcc)")
  for c in "$d/compute-sanitizer" "$d/../extras/compute-sanitizer/compute-sanitizer"; do
    if [ -x "$c" ]; then echo "$c"; return 0; fi
  done
}

check() {
  local steps=" ${CHECK_STEPS:-gpu-tests kit memcheck} " cs limit
  setup
  # -v names each test as it ends, so a step stopped by its limit still says which ran;
  # --timeout (pytest-timeout, when installed) fails a test that hangs instead of the step.
  limit=$("$PY" -c 'import pytest_timeout' 2>/dev/null \
    && echo "--timeout=${GPU_TEST_TIMEOUT_S:-240}" || true)
  # shellcheck disable=SC2086  # GPU_TESTS: a list of paths; limit: empty or one option
  [[ $steps != *" gpu-tests "* ]] || step gpu-tests "$PY" -m pytest -v -n "${GPU_TESTS_N:-0}" \
    -p no:cacheprovider -rfE --durations=15 --continue-on-collection-errors $limit \
    -m "gpu and not slow" ${GPU_TESTS:-tests/gpu} "$@"
  # shellcheck disable=SC2086
  [[ $steps != *" stress "* ]] || step stress "$PY" -m pytest -v -n 4 -p no:cacheprovider -rfE \
    $limit -m "gpu and slow" ${GPU_TESTS:-tests/gpu}
  [[ $steps != *" kit "* ]] || step kit "$PY" -m pytest -v -n 4 -p no:cacheprovider -rfE \
    tests/conformance -k "$KIT_K"
  [[ $steps == *" memcheck "* ]] || return 0
  cs=$(sanitizer)
  if [ -n "$cs" ]; then
    step memcheck "$cs" --tool memcheck --report-api-errors no --error-exitcode 1 \
      "$PY" tools/oob_run.py --backend triton
    # The kit's CUDA-graph cases: replays whose metadata (slot lists, CSRs, FlashInfer's MLA
    # schedule) device launches write, at ragged and padded batches.
    step memcheck-graphs "$cs" --tool memcheck --report-api-errors no --error-exitcode 1 \
      "$PY" -m pytest -q -p no:cacheprovider -p no:xdist -o addopts= tests/conformance \
      -k "graph and ($KIT_K)"
  else
    note "- memcheck: skipped (no compute-sanitizer on PATH or beside nvcc)"
  fi
}

bench() {  # the bench's text files into $OUT/bench/, everything into $OUT/bench.tgz
  local f
  setup
  [ -n "$DRY" ] || [ -n "${BENCH_APPEND:-}" ] || rm -rf /tmp/gpu-bench
  step bench "$PY" -m specattn bench --out /tmp/gpu-bench "$@"
  [ -n "$DRY" ] && return 0
  mkdir -p "$OUT/bench"
  for f in table.md bench.csv sweep.csv parts.csv versions.json; do
    if [ -f "/tmp/gpu-bench/$f" ]; then cp "/tmp/gpu-bench/$f" "$OUT/bench/"; fi
  done
  if [ -d /tmp/gpu-bench ]; then tar czf "$OUT/bench.tgz" -C /tmp/gpu-bench .; fi
}

sglang() {
  local src=.whl/sglang-0.5.23-cp312.tar.xz
  [ -f "$src" ] || die ".whl/ lacks SGLang: run 'bash tools/sglang_wheels.sh' here first"
  setup
  if [ -z "$DRY" ] && [ ! -d "$WHEELS/sglang" ]; then mkdir -p "$WHEELS"; tar xJf "$src" -C "$WHEELS"; fi
  export PYTHONWARNINGS=ignore STEP_TIMEOUT_S=${STEP_TIMEOUT_S:-420}
  step sglang "$PY" tools/sglang_gpu.py --out "$OUT/sglang" "$@"
  [ "${SGLANG_GPU_TEST:-1}" = 0 ] || STEP_TIMEOUT_S=150 step sglang-test "$PY" -m pytest -q \
    -p no:cacheprovider -rs tests/gpu/test_sglang_gpu.py
}

ref_package() {  # ref_package DIR: DIR's absolute path, when it holds a specattn/ package
  local ref
  ref=$(cd "$1" && pwd) || die "no folder $1"
  [ -d "$ref/specattn" ] || die "$ref holds no specattn/ package (here: mkdir -p .ab && git archive TAG specattn | tar -x -C .ab)"
  echo "$ref"
}

ab() {
  [ $# -ge 1 ] || usage
  local label=$1 ref b="" name=ab prefix="" r
  ref=$(ref_package "$1") || exit 3
  shift
  if [ -n "${AB_B:-}" ]; then  # B: another package folder; its steps and files named by it
    b=$(ref_package "$AB_B") || exit 3
    name=ab-$(basename "$b")
    prefix=$name-
  fi
  setup
  local runs=/tmp/gpu-$name
  # A (and a B folder) from inside it: `python -m` puts the working directory first on
  # sys.path, so its specattn package runs, not this tree's.
  local a_in=(env -C "$ref" PYTHONPATH="$ref${LIBPATH:+:$LIBPATH}") b_in=()
  [ -z "$b" ] || b_in=(env -C "$b" PYTHONPATH="$b${LIBPATH:+:$LIBPATH}")
  [ -n "$DRY" ] || rm -rf "$runs"
  for r in $(seq 1 "${AB_ROUNDS:-2}"); do
    step "${prefix}a$r" "${a_in[@]}" "$PY" -m specattn bench --out "$runs/a$r" "$@"
    step "${prefix}b$r" ${b_in[@]+"${b_in[@]}"} "$PY" -m specattn bench --out "$runs/b$r" "$@"
  done
  step "$name-table" "$PY" tools/ab_table.py "$runs" --a-label "$label" \
    ${b:+--b-label "$AB_B"} --out "$OUT/$name.md"
  if [ -z "$DRY" ] && [ -d "$runs" ]; then tar czf "$OUT/$name.tgz" -C "$runs" .; fi
}

host-ab() {
  [ $# -ge 1 ] || usage
  ref_package "$1" > /dev/null || exit 3
  setup
  step host-ab "$PY" tools/host_ab.py "$@" --out "$OUT/host_ab.md"
}

case "$cmd" in
  fa4-first)
    if [ -n "$DRY" ]; then echo "fa4-first: bash $BUNDLE/install.sh $SITE fa4-first"
    else bash "$BUNDLE/install.sh" "$SITE" fa4-first > /dev/null && note "- fa4-first: unpacked into $SITE"
    fi ;;
  *) "$cmd" "$@" ;;  # check, bench, sglang, ab, host-ab
esac
if [ -z "$DRY" ] && compgen -G "$LOGS/*" > /dev/null; then tar czf "$OUT/logs.tgz" -C "$LOGS" .; fi
rm -rf "$LOGS"
exit "$failed"
