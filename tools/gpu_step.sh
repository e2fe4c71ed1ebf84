#!/usr/bin/env bash
# One GPU check of the draft step (issue 13): its GPU tests, `epdraft bench step`, and `epdraft run`
# (tiny pair, one rank, bf16) eager and with CUDA graphs; `random`: the random pair of realistic size
# with graphs, lossless-checked. Parts: ${@:-tests bench run}. Logs go to ${OUT:-./gpu-step}.
# On a machine without internet, put msgspec's wheel in .whl/ first (../shared/tools/device-wheels.sh).
set -o pipefail
export PYTHONUNBUFFERED=1
. "$(dirname "$0")/device_env.sh" || exit 1
device_log gpu-step
for part in ${@:-tests bench run}; do
  echo "=== $part $(date -u +%FT%TZ)" | tee -a "$LOG"
  case $part in
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rfs ${TESTS:-tests/gpu} 2>&1 | tail -25 | tee -a "$LOG" ;;
    bench) timeout 300 python3 -m epdraft.cli bench step --requests ${REQUESTS:-1,8,32,64} --context ${CONTEXT:-1024,8192} \
             --steps 10 --warmup 3 ${PROFILE:+--profile $PROFILE} --json "$OUT/bench-step.jsonl" 2>&1 | grep -v '^{' | tee -a "$LOG" ;;
    run)
      for graphs in false true; do
        # shellcheck disable=SC2086
        timeout 150 python3 -m epdraft.cli run configs/h200x8-dp8-ep8.toml $ONE --set draft.moe_layout=replicated \
          --set draft.cuda_graphs=$graphs --json "$OUT/run-tiny-graphs-$graphs.json" 2>&1 | grep -v "^\[rank" | tail -14 | tee -a "$LOG"
      done ;;
    random)
      # the random-weight pair of realistic size (built here: ~4 GB), graphs on, lossless-checked
      # against the fp32 target's own greedy decode
      timeout 200 python3 tools/make_random_pair.py /tmp/rp --prompts 8 2>&1 | tail -2 | tee -a "$LOG"
      # shellcheck disable=SC2086
      timeout 300 python3 -m epdraft.cli run configs/h200x8-dp8-ep8.toml $ONE --set draft.moe_layout=replicated \
        --set draft.cuda_graphs=true --draft /tmp/rp/draft --target /tmp/rp/target --prompts /tmp/rp/prompts.jsonl \
        --max-prompts 8 --max-new-tokens 32 --json "$OUT/run-random-graphs.json" 2>&1 | grep -v "^\[rank" | tail -14 \
        | tee -a "$LOG" ;;
    *) echo "unknown part $part (tests, bench, run, random)" | tee -a "$LOG"; exit 2 ;;
  esac
done
