#!/usr/bin/env bash
# One GPU check of the DeepSeek DSpark drafts (issue 31): graph == eager over 100 steps (tests),
# `bench step` on the V4.1-Flash draft preset against its floor (with the costliest kernels of one
# eager step), and `epdraft run` of the tiny pair with tiny V4 / V4.1 drafts under CUDA graphs
# (LAYOUTS="plain quantized bundle": also in DeepSeek's released layout, alone and inside a target checkpoint).
# Parts: ${@:-tests bench run}. Logs: ${OUT:-./gpu-dspark}.
set -o pipefail
export PYTHONUNBUFFERED=1
. "$(dirname "$0")/device_env.sh" || exit 1
device_log gpu-dspark
for part in ${@:-tests bench run}; do
  echo "=== $part $(date -u +%FT%TZ)" | tee -a "$LOG"
  case $part in
    tests) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -rfs \
             ${TESTS:-tests/gpu/test_deepseek_dspark_graphs.py} 2>&1 | tail -15 | tee -a "$LOG" ;;
    bench)
      timeout ${BENCH_TIMEOUT:-300} python3 -m epdraft.cli bench step --preset v41-flash --requests ${REQUESTS:-1,8,32,64} \
        --context ${CONTEXT:-1024,8192} --steps 20 --warmup 5 --temperature 0.8 --profile ${PROFILE:-12} \
        --json "$OUT/bench-v41-flash.jsonl" 2>&1 | grep -v '^{' | tee -a "$LOG" ;;
    run)
      # LAYOUTS: plain (bf16 export), quantized (DeepSeek's released FP8 / FP4 layout), bundle (that
      # layout as mtp.* inside a tiny target checkpoint); drafts written to /tmp (not carried back)
      for layout in ${LAYOUTS:-plain}; do
        for variant in v4 v41; do
          flags=$([ $variant = v41 ] && echo --v41)
          case $layout in quantized) flags="$flags --quantized" ;; bundle) flags="$flags --bundle" ;; esac
          draft=/tmp/draft-$layout-$variant
          # shellcheck disable=SC2086
          python3 tools/make_deepseek_dspark_draft.py "$draft" $flags > /dev/null || exit 1
          # shellcheck disable=SC2086
          timeout 150 python3 -m epdraft.cli run configs/h200x8-dp8-ep8.toml $ONE --set draft.moe_layout=replicated \
            --set draft.cuda_graphs=true --draft "$draft" --json "$OUT/run-$layout-$variant-graphs.json" 2>&1 \
            | grep -v "^\[rank" | tail -12 | tee -a "$LOG"
          python3 -c "import json,sys; s=json.load(open(sys.argv[1])); print(sys.argv[2], 'lossless', s['lossless'], 'requests', s['requests'], 'failed', s['failed_requests'])" \
            "$OUT/run-$layout-$variant-graphs.json" "$layout $variant" 2>&1 | tee -a "$LOG"
        done
      done ;;
  esac
done
