#!/usr/bin/env bash
# The Gluon MLA kernel's GPU record in one device call (carry .gpu/flashinfer .gpu/install.sh):
#   bash tools/gluon_session.sh [tests] [memcheck] [bench] [stress] [ncu] [parts] [diag]
# tests: tests/gpu/test_gluon_mla_gpu.py but its stress loop (SPECATTN_GLUON_VARIANTS picks
# variants); memcheck: compute-sanitizer over a small MLA round (uniform and ragged) checked
# against torch_ref (`specattn bench --check-only`; GLUON_CHECK_OPTION adds one --option
# variant, e.g. 'triton:config=m64 n32 w8 s3 kv-first gluon-ov'); bench: `specattn bench` on
# the MLA cases, Triton (the Gluon kernel), more Triton variants (GLUON_OPTIONS: configs or
# whole --option values, separated by ';'; default the tl.dot kernel's config) and
# FlashInfer, into $OUT/gluon-bench.md and .tgz (GLUON_BENCH_ARGS adds arguments, e.g.
# --quick; GLUON_CASES replaces the case list);
# stress: the 100-batch loop; ncu: Nsight Compute (full set) over one launch of the default
# kernel at mla-long, into $OUT/gluon-ncu.txt; diag: tools/gluon_diag.py (the kernel's copies
# alone and its math alone beside the full kernel; GLUON_DIAG_CASES, GLUON_DIAG_CONFIGS: cases,
# and config labels separated by ';'; GLUON_DIAG_PREFIX: prefix lengths to run them at), into $OUT/gluon-diag.md; parts: `specattn
# bench --parts` (each kernel's time in one step) on GLUON_PARTS_CASES (default mla-long
# mla-small), triton and flashinfer (GLUON_PARTS_OPTION: one more triton variant), into
# $OUT/gluon-parts.log. Logs go to $OUT
# (gluon-*.log); exit status non-zero if a part failed.
set -uo pipefail
: "${OUT:?OUT must name the folder for the logs}"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore FLASHINFER_CUDA_ARCH_LIST=9.0a
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-ws
eval "$(bash .gpu/install.sh /tmp/gpu-site flashinfer)" || exit 3
export PYTHONPATH=$PWD:$PYTHONPATH
status=0
# The MLA v3 tl.dot kernel's config (launchers.choose_config at 64+ rows per KV head).
TL_DOT="triton:config=m64 n64 w8 s3 mla3 kv-first"
read -r -a MLA_CASES <<< "${GLUON_CASES:-mla-long mla-long-p64 mla-k1 mla-small mla-wide mla-wide-p64}"
OPTIONS=()
IFS=';' read -r -a configs <<< "${GLUON_OPTIONS:-${TL_DOT#triton:config=}}"
for c in "${configs[@]}"; do  # a config label, or a whole option (triton:split_waves=2)
  if [[ $c == *:* ]]; then OPTIONS+=("$c"); else OPTIONS+=("triton:config=$c"); fi
done
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
               python -m specattn bench --mla --batch 3 --prefix 300 --topk 4 --num-steps 3 \
               --steps --backend triton --check-only --out /tmp/gluon-check \
               ${GLUON_CHECK_OPTION:+--option "$GLUON_CHECK_OPTION"} \
               2>&1 | tail -n 30 | tee "$OUT/gluon-memcheck.log" || status=1 ;;
      bench) rm -rf /tmp/gluon-bench
             timeout "${GLUON_BENCH_S:-300}" python -m specattn bench --case "${MLA_CASES[@]}" \
               --backend triton flashinfer --option "${OPTIONS[@]}" --out /tmp/gluon-bench \
               ${GLUON_BENCH_ARGS:-} 2>&1 | tee "$OUT/gluon-bench.log" || status=1
             # One archive (the device returns a limited number of files per call).
             [ -d /tmp/gluon-bench ] && cp /tmp/gluon-bench/table.md "$OUT/gluon-bench.md" \
               && tar czf "$OUT/gluon-bench.tgz" -C /tmp gluon-bench ;;
      stress) timeout 200 python -m pytest -q -p no:cacheprovider -p no:warnings -rf \
               tests/gpu/test_gluon_mla_gpu.py -k stress 2>&1 | tail -n 20 \
               | tee "$OUT/gluon-stress.log" || status=1 ;;
      ncu) timeout "${GLUON_NCU_S:-150}" ncu --clock-control none --set full \
               -k regex:_gluon_mla_kernel --launch-skip 2 --launch-count 1 \
               python -m specattn bench --case mla-long --backend triton --check-only \
               --out /tmp/gluon-ncu > "$OUT/gluon-ncu.txt" 2>&1 || status=1
             tail -n 5 "$OUT/gluon-ncu.txt" ;;
      parts) rm -rf /tmp/gluon-parts  # each kernel's time in one step (torch.profiler)
             timeout "${GLUON_PARTS_S:-120}" python -m specattn bench \
               --case ${GLUON_PARTS_CASES:-mla-long mla-small} --backend triton flashinfer \
               --parts --quick --no-sweep --no-round --no-raw --out /tmp/gluon-parts \
               ${GLUON_PARTS_OPTION:+--option "$GLUON_PARTS_OPTION"} \
               2>&1 | tail -n 60 | tee "$OUT/gluon-parts.log" || status=1 ;;
      diag) IFS=';' read -r -a diag_cfgs <<< "${GLUON_DIAG_CONFIGS:-m64 n64 w8 s2 kv-first gluon pf}"
             timeout "${GLUON_DIAG_S:-200}" python tools/gluon_diag.py \
               --case ${GLUON_DIAG_CASES:-mla-long mla-wide} --config "${diag_cfgs[@]}" \
               ${GLUON_DIAG_PREFIX:+--prefix $GLUON_DIAG_PREFIX} \
               > "$OUT/gluon-diag.md" 2>&1 || status=1
             cat "$OUT/gluon-diag.md" ;;
    esac
  done
done
exit $status
