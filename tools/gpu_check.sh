#!/usr/bin/env bash
# One GPU check of the tree: every GPU test, the fused-experts benchmark, and `epdraft run` (tiny pair,
# fp32, one rank) on CUDA. Logs go to ${OUT:-./gpu-check}. Parts: tests, bench, run (default: all).
#
# On a machine without internet, put the wheels it lacks (msgspec; Mooncake's cuda13 build for the
# Mooncake tests) in .whl/ first; they are installed into /tmp/site.
set -o pipefail
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=WARNING
. "$(dirname "$0")/device_env.sh" || exit 1
device_log gpu-check
for part in ${@:-tests bench run}; do
  echo "=== $part $(date -u +%FT%TZ)" | tee -a "$LOG"
  case $part in
    tests) timeout ${TEST_TIMEOUT:-560} python3 -m pytest -q -p no:cacheprovider -rfs tests/gpu 2>&1 | tail -15 | tee -a "$LOG" ;;
    bench) timeout 200 python3 -m epdraft.cli bench kernel --json "$OUT/bench-kernel.jsonl" 2>&1 | tee -a "$LOG" ;;
    run)
      SET="--set cluster.nproc_per_node=1 --set draft.attn_dp=1 --set target.dp=1 --set target.tp=1 --set draft.moe_ep=1"
      # shellcheck disable=SC2086
      timeout 120 python3 -m epdraft.cli run configs/h200x8-dp8-ep8.toml $SET --set draft.moe_layout=replicated \
        --json "$OUT/run-tiny.json" 2>&1 | grep -v "^\[rank" | tail -16 | tee -a "$LOG" ;;
    *) echo "unknown part $part (tests, bench, run)" | tee -a "$LOG"; exit 2 ;;
  esac
done
