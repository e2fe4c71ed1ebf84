#!/usr/bin/env bash
# One GPU check of sampled speculative decoding (issue 30): the sampled graph tests (replay == eager,
# drafts and proposal probabilities bit for bit, no host sync), `bench step` with the sampled column
# beside the greedy graph, the tiny pair at T = 0.8 eager vs graphs (same seeds), and the random
# pair of realistic size at T = 0.8 with graphs. Parts: ${@:-tests bench run random}. Logs: ${OUT:-./gpu-sampling}.
set -o pipefail
export PYTHONUNBUFFERED=1
. "$(dirname "$0")/device_env.sh" || exit 1
device_log gpu-sampling
for part in ${@:-tests bench run random}; do
  echo "=== $part $(date -u +%FT%TZ)" | tee -a "$LOG"
  case $part in
    tests) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rfs \
             ${TESTS:-tests/gpu/test_sample_kernel.py tests/gpu/test_draft_step.py tests/gpu/test_variant_graphs.py} 2>&1 | tail -15 | tee -a "$LOG" ;;
    bench)
      timeout 200 python3 -m epdraft.cli bench step --requests ${REQUESTS:-1,8,32,64} --context ${CONTEXT:-1024,8192} \
        --steps 20 --warmup 5 --no-cache-path --temperature 0.8 --json "$OUT/bench-sampled.jsonl" 2>&1 | grep -v '^{' | tee -a "$LOG"
      timeout 150 python3 -m epdraft.cli bench step --requests 64 --context ${CONTEXT:-1024,8192} \
        --steps 20 --warmup 5 --no-cache-path --temperature 0.8 --top-p 0.9 --json "$OUT/bench-filtered.jsonl" 2>&1 \
        | grep -v '^{' | tee -a "$LOG" ;;
    run)
      for graphs in false true; do
        # shellcheck disable=SC2086
        timeout 150 python3 -m epdraft.cli run configs/h200x8-dp8-ep8.toml $ONE --set draft.moe_layout=replicated \
          --set draft.cuda_graphs=$graphs --temperature 0.8 --seed 3 --output "$OUT/tiny-T0.8-graphs-$graphs.jsonl" \
          --json "$OUT/run-tiny-T0.8-graphs-$graphs.json" 2>&1 | grep -v "^\[rank" | tail -16 | tee -a "$LOG"
      done
      python3 - "$OUT" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
a, b = ([json.loads(l)["output_ids"] for l in open(f"{sys.argv[1]}/tiny-T0.8-graphs-{g}.jsonl")] for g in ("false", "true"))
same = sum(x == y for x, y in zip(a, b))
first = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None) for x, y in zip(a, b)]
print(f"eager vs graphs, T=0.8 seed 3: {same} of {len(a)} requests identical; first differing position per request: {first}")
PY
      ;;
    random)
      timeout 200 python3 tools/make_random_pair.py /tmp/rp --prompts 8 2>&1 | tail -2 | tee -a "$LOG"
      # shellcheck disable=SC2086
      timeout 300 python3 -m epdraft.cli run configs/h200x8-dp8-ep8.toml $ONE --set draft.moe_layout=replicated \
        --set draft.cuda_graphs=true --draft /tmp/rp/draft --target /tmp/rp/target --prompts /tmp/rp/prompts.jsonl \
        --max-prompts 8 --max-new-tokens 32 --temperature 0.8 --seed 1 --json "$OUT/run-random-T0.8-graphs.json" 2>&1 \
        | grep -v "^\[rank" | tail -16 | tee -a "$LOG" ;;
    *) echo "unknown part $part (tests, bench, run, random)" | tee -a "$LOG"; exit 2 ;;
  esac
done
