#!/usr/bin/env bash
# One GPU check of the engine's draft iteration (issue 33): the commit and iteration GPU tests
# (commit graph == eager write_context, no host sync in an embedded propose + commit),
# `epdraft bench iteration` (commit + propose, graph and eager, against the floor), and `random`:
# the random pair of realistic size through `epdraft run` with graphs (its ms per draft iteration
# beside the bench's). Parts: ${@:-tests bench random}. Logs: ${OUT:-./gpu-iteration}.
set -o pipefail
export PYTHONUNBUFFERED=1
. "$(dirname "$0")/device_env.sh" || exit 1
device_log gpu-iteration
for part in ${@:-tests bench random}; do
  echo "=== $part $(date -u +%FT%TZ)" | tee -a "$LOG"
  case $part in
    tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -rfs \
             ${TESTS:-tests/gpu/test_commit_graphs.py tests/gpu/test_draft_step.py tests/gpu/test_phase_timers.py} \
             2>&1 | tail -15 | tee -a "$LOG" ;;
    bench)
      for preset in ${PRESETS:-issue13}; do
        timeout ${BENCH_TIMEOUT:-300} python3 -m epdraft.cli bench iteration --preset "$preset" \
          --requests ${REQUESTS:-1,8,32,64,128} --context ${CONTEXT:-1024,8192} --steps 20 --warmup 5 \
          --json "$OUT/bench-iteration.jsonl" 2>&1 | grep -v '^{' | tee -a "$LOG"
      done ;;
    random)
      timeout 200 python3 tools/make_random_pair.py /tmp/rp --prompts 8 2>&1 | tail -2 | tee -a "$LOG"
      # shellcheck disable=SC2086
      timeout 300 python3 -m epdraft.cli run configs/h200x8-dp8-ep8.toml $ONE --set draft.moe_layout=replicated \
        --set draft.cuda_graphs=true --draft /tmp/rp/draft --target /tmp/rp/target --prompts /tmp/rp/prompts.jsonl \
        --max-prompts 8 --max-new-tokens 64 --json "$OUT/run-random-graphs.json" 2>&1 | grep -v "^\[rank" | tail -18 \
        | tee -a "$LOG"
      timeout 200 python3 -m epdraft.cli bench iteration --preset issue13 --requests 8 --context 96 --steps 20 \
        --warmup 5 2>&1 | grep -v '^{' | tee -a "$LOG" ;;
    *) echo "unknown part $part (tests, bench, random)" | tee -a "$LOG"; exit 2 ;;
  esac
done
