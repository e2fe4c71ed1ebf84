#!/usr/bin/env bash
# The one-GPU acceptance numbers of issues 31, 32 and 33, on the H200 they ask for, one part per
# device command (each under the device tool's 10-minute limit). Carry [".whl"]. Logs and JSON: $OUT.
#
#   tools/h200_acceptance.sh tune | step | iteration | linear | random
#
#   tune       issue 32: the fused experts tuned at V4.1-Flash's expert shape (V41F) in bf16 and mxfp4
#              (tables written into the checkout's epdraft/kernels/experts/configs, where the later
#              parts read them, and returned as $OUT/tables.tar to commit; TUNE_SHAPES, TUNE_WEIGHTS,
#              TUNE_TOKENS override what is tuned, BENCH_SHAPES / BENCH_WEIGHTS what is timed after),
#              then FP4 vs bf16 at T <= 128. The H200's C / D tables predate the tuner's stored-byte
#              tiles; retune them with TUNE_SHAPES=C,D TUNE_WEIGHTS=mxfp4,fp8 BENCH_SHAPES=C,D
#              BENCH_WEIGHTS=bf16,fp8,mxfp4 TUNE_TOKENS=16,128,512
#   step       issues 31 + 32: `bench step --preset v41-flash`, the bf16 draft and the released layout
#              (FP4 experts, FP8 linears as loaded) side by side, N 1 / 8 / 32 / 64, ctx 1k and 8k
#   iteration  issue 33: `bench iteration` on the bench step preset (issue13), N 1..128, ctx 1k and 8k,
#              and on v41-flash at 1k
#   sync       issue 33: `bench sync --ranks 2 4 8 16` on the machine's CPUs (a core per rank at W = 16)
#   linear     issue 32: `bench linear` (the FP8-linears decision, measured on the H200)
#   random     issue 33: the random pair through `epdraft run` with graphs (ms per draft iteration)
#              beside `bench iteration` at its N and context (tools/gpu_iteration.sh random)
set -o pipefail
export PYTHONUNBUFFERED=1
. "$(dirname "$0")/device_env.sh" || exit 1
device_log h200-acceptance
bench() { timeout "${BENCH_TIMEOUT:-540}" python3 -m epdraft.cli bench "$@" 2>&1 | grep -v '^{' | tee -a "$LOG"; }
for part in "${@:-tune}"; do
  echo "=== $part $(date -u +%FT%TZ)" | tee -a "$LOG"
  case $part in
    tune)
      before=$(cd epdraft/kernels/experts/configs && md5sum -- *.json)
      bench kernel --tune "${TUNE_SHAPES:-V41F}" --tune-weights "${TUNE_WEIGHTS:-bf16,mxfp4}" \
        --shapes "${BENCH_SHAPES:-V41F}" --weights "${BENCH_WEIGHTS:-bf16,mxfp4}" --tokens "${TUNE_TOKENS:-16,32,64,128}" \
        --json "$OUT/kernel-tuned.jsonl"
      mkdir -p "$OUT/configs"
      (cd epdraft/kernels/experts/configs && md5sum -- *.json) | while read -r sum f; do  # new or rewritten
        echo "$before" | grep -qxF "$sum  $f" || cp "epdraft/kernels/experts/configs/$f" "$OUT/configs/"
      done
      ls "$OUT/configs" | tee -a "$LOG"  # every table the tune wrote or rewrote
      tar -cf "$OUT/tables.tar" -C "$OUT/configs" . && rm -r "$OUT/configs" ;;  # names with '=' do not come back
    sync) timeout 300 python3 -m epdraft.cli bench sync --ranks 2 4 8 16 2>&1 | tee -a "$LOG" ;;
    step)
      bench step --preset v41-flash --weights bf16,quantized --requests 1,8,32,64 --context "${CONTEXT:-1024,8192}" --steps 20 \
        --warmup 5 --temperature 0.8 --profile "${PROFILE:-8}" --json "$OUT/step-v41-flash.jsonl" ;;
    iteration)
      bench iteration --preset issue13 --requests 1,8,32,64,128 --context 1024,8192 --steps 20 --warmup 5 \
        --json "$OUT/iteration.jsonl"
      bench iteration --preset v41-flash --requests 1,8,32,64 --context 1024 --steps 20 --warmup 5 \
        --json "$OUT/iteration.jsonl" ;;
    linear) bench linear --preset v41-flash --rows 5,40,160,320 --json "$OUT/linear.jsonl" ;;
    random) OUT=$OUT "$(dirname "$0")/gpu_iteration.sh" random ;;
    *) echo "unknown part $part (tune, sync, step, iteration, linear, random)" | tee -a "$LOG"; exit 2 ;;
  esac
done
