#!/usr/bin/env bash
# Fused-experts work on one GPU in one call: kernel tests, tuning into a scratch copy of the shipped
# tables, and the benchmark with the shipped and the tuned tables side by side. Logs and results go
# to ${OUT:-./kernel-perf}; the tuned tables come back as tables.tar (their names hold '=' and ',').
#
# Usage: tools/kernel_perf.sh PHASE...   with PHASE one of
#   tests[:EXPR]           pytest $TESTS (default tests/gpu/test_fused_moe.py tests/gpu/test_fused_moe_quant.py) [-k EXPR]
#   tune:SHAPES:TOKENS     e.g. tune:A,B:16,128,512,2048 (tables into $TABLES, default /tmp/tables)
#   bench:shipped|tuned[:SHAPES]  epdraft bench kernel (default A-D; T = 16/128/512/2048) with the
#                          shipped tables or those in $TABLES; results in bench-<which>.jsonl
# Weight formats: tune:* tunes $TUNE_WEIGHTS (default bf16), bench:* times $BENCH_WEIGHTS side by side
# (default bf16; e.g. bf16,fp8,mxfp4, or bf16,mxfp4-bits,mxfp4-dot-scaled for both MXFP4 upcasts).
# On a machine without internet, put the msgspec wheel in .whl/ first (../shared/tools/device-wheels.sh).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-./kernel-perf}
TABLES=${TABLES:-/tmp/tables}
mkdir -p "$OUT" "$TABLES"
. "$(dirname "$0")/device_env.sh" || exit 1
[ -n "$(ls -A "$TABLES")" ] || cp epdraft/kernels/experts/configs/*.json "$TABLES"/
LOG=$OUT/kernel-perf.log
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee -a "$LOG"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$LOG"
for phase in "$@"; do
  echo "=== $phase $(date -u +%FT%TZ)" | tee -a "$LOG"
  case $phase in
    tests|tests:*)
      expr=${phase#tests}; expr=${expr#:}
      # shellcheck disable=SC2086
      timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -q -p no:cacheprovider -rf \
        ${TESTS:-tests/gpu/test_fused_moe.py tests/gpu/test_fused_moe_quant.py} \
        ${expr:+-k "$expr"} 2>&1 | tail -25 | tee -a "$LOG" ;;
    tune:*)
      IFS=: read -r _ shapes tokens <<< "$phase"
      timeout "${TUNE_TIMEOUT:-420}" python3 -m epdraft.cli bench kernel --tune "$shapes" --shapes "" --tokens "$tokens" \
        --weights "${TUNE_WEIGHTS:-bf16}" --config-dir "$TABLES" 2>&1 | tee -a "$LOG"
      tar -cf "$OUT/tables.tar" -C "$TABLES" . ;;
    bench:*)
      IFS=: read -r _ which shapes <<< "$phase"
      dir=epdraft/kernels/experts/configs; [ "$which" = tuned ] && dir=$TABLES
      timeout "${BENCH_TIMEOUT:-240}" python3 -m epdraft.cli bench kernel --shapes "${shapes:-A,B,C,D}" \
        --weights "${BENCH_WEIGHTS:-bf16}" --config-dir "$dir" --json "$OUT/bench-$which.jsonl" 2>&1 | tee -a "$LOG" ;;
    *) echo "unknown phase $phase" | tee -a "$LOG"; exit 2 ;;
  esac
done
echo "=== end $(date -u +%FT%TZ)" | tee -a "$LOG"
