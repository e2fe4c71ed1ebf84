#!/usr/bin/env bash
# Side by side on one GPU, in one session: `epdraft bench step` and `epdraft bench kernel` of this
# tree and of another checkout of the repo (the tree before a change: `mkdir .before && git archive
# REV | tar -x -C .before`, carried to the device), each bench run for the tree before and then the
# tree after, so a change can be told from run-to-run drift. Usage:
#   tools/bench_side_by_side.sh BEFORE_DIR [step] [kernel]     (default: both)
# Knobs: REQUESTS, CONTEXT (bench step), SHAPES, TOKENS, WEIGHTS (bench kernel), LIMIT (s per bench
# run). Logs and JSON lines go to ${OUT:-./side-by-side}.
set -o pipefail
export PYTHONUNBUFFERED=1
BEFORE=$(cd "$1" && pwd) || exit 2
shift
OUT=${OUT:-./side-by-side}
mkdir -p "$OUT"
. "$(dirname "$0")/device_env.sh" || exit 1
AFTER=$PWD
STEP="bench step --requests ${REQUESTS:-1,8,32,64} --context ${CONTEXT:-1024,8192} --steps 10 --warmup 3 --no-cache-path"
KERNEL="bench kernel --shapes ${SHAPES:-C,D,A,B} --tokens ${TOKENS:-16,128,512} --weights ${WEIGHTS:-bf16,fp8,mxfp4}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/log"
for what in "${@:-step kernel}"; do
  for what1 in $what; do
    args=$STEP
    [ "$what1" = kernel ] && args=$KERNEL
    for tree in before after; do
      dir=$AFTER
      [ "$tree" = before ] && dir=$BEFORE
      echo "=== $what1 $tree ($dir) $(date -u +%FT%TZ)" | tee -a "$OUT/log"
      # shellcheck disable=SC2086
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "${LIMIT:-240}" python3 -m epdraft.cli $args \
        --json "$OUT/$what1-$tree.jsonl") 2>&1 | grep -v '^{' | tee -a "$OUT/log"
    done
  done
done
