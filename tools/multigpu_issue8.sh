#!/usr/bin/env bash
# Issue 8 on one multi-GPU host (2, 4 or 8 GPUs): NCCL/DeepEP/Mooncake EP equivalence tests, the
# dispatch benchmark on 2/4/8 GPUs, and `epdraft run` of a realistic random-weight draft on all GPUs.
#
# Usage, from anywhere (device tool: carry [".whl"] built by ../shared/tools/device-wheels.sh):
#   bash tools/multigpu_issue8.sh [env] [tests] [bench] [run]      (no argument: all four, in this order)
# Each part is bounded by STEP_TIMEOUT seconds (default 540) so a hang cannot eat the others; under
# a 10-minute-per-command limit, run the parts as separate commands. Logs go to $OUT (default
# ./issue8-out) with plain file names: env.log, pytest_gpu.log, bench_dispatch_<N>gpu.{log,jsonl},
# make_random_pair.log, run_<N>gpu.{log,json}, and summary.txt (one line per step: exit code, seconds).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/issue8-out}
STEP_TIMEOUT=${STEP_TIMEOUT:-540}
PAIR=${PAIR:-/tmp/issue8-pair}
mkdir -p "$OUT"

# The GPU image's Python lacks msgspec: the install line of ../shared/tools/device-wheels.sh's header.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-} || exit;
export PYTHONPATH=$PWD:${PYTHONPATH:-}

# The `epdraft` console script without installing the package (an array: `timeout` cannot run a function).
EPDRAFT=(python3 -c 'import sys; from epdraft.cli import main; sys.exit(main())')

# step NAME LOG CMD...: run CMD with stdout+stderr to $OUT/LOG under STEP_TIMEOUT; record rc and time.
step() {
  local name=$1 log=$2 start rc
  shift 2
  start=$(date +%s)
  timeout "$STEP_TIMEOUT" "$@" > "$OUT/$log" 2>&1
  rc=$?
  echo "$name: rc=$rc ($(( $(date +%s) - start )) s) -> $log" | tee -a "$OUT/summary.txt"
}

NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
GPU_COUNTS=$(for n in 2 4 8; do [ "$n" -le "$NGPU" ] && echo "$n"; done)

# Overrides turning configs/h200x8-dp8-ep8.toml (alltoall, EP 8) into the same layout on N GPUs.
on_gpus() { echo --set cluster.nproc_per_node="$1" --set draft.attn_dp="$1" --set draft.moe_ep="$1" --set target.dp="$1"; }

part_env() {
  step env env.log bash -c '
    date -u; nvidia-smi -L; nvidia-smi topo -m
    python3 -c "import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"nccl\", torch.cuda.nccl.version(), \"gpus\", torch.cuda.device_count())"
    python3 -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|safetensors|msgspec|pyyaml|sgl-deep-ep|deep.ep|mooncake)"
    for m in triton transformers deep_ep mooncake.mooncake_ep_buffer; do
      python3 -c "import $m" 2>&1 | tail -1 | sed "s/^/import $m: /"; python3 -c "import $m" 2>/dev/null && echo "import $m: ok"
    done'
}

part_tests() {
  # Every GPU test: fused experts, Mooncake EP and transfer on one GPU, the NCCL equivalence worlds.
  step pytest_gpu pytest_gpu.log python3 -m pytest -q -p no:cacheprovider -rs tests/gpu
}

part_bench() {
  for n in $GPU_COUNTS; do
    # shellcheck disable=SC2046  # on_gpus prints separate words on purpose
    step "bench_dispatch_${n}gpu" "bench_dispatch_${n}gpu.log" "${EPDRAFT[@]}" bench dispatch \
      --config configs/h200x8-dp8-ep8.toml $(on_gpus "$n") --device cuda \
      --rows 1,16,128,512 --hidden 4096,7168 --top-k 2,8 --experts 8 --intermediate 1536 \
      --a2a-backends torch,deepep,deepep_ll,mooncake --steps 20 --warmup 5 --json "$OUT/bench_dispatch_${n}gpu.jsonl"
  done
}

part_run() {
  # 8 experts x 1536 x 4096, 5 draft layers (make_random_pair's defaults), bf16; target: 4-layer Qwen3.
  [ -f "$PAIR/prompts.jsonl" ] || step make_random_pair make_random_pair.log \
    python3 tools/make_random_pair.py "$PAIR" --dtype bfloat16
  # shellcheck disable=SC2046
  step "run_${NGPU}gpu" "run_${NGPU}gpu.log" "${EPDRAFT[@]}" run configs/h200x8-dp8-ep8.toml $(on_gpus "$NGPU") \
    --draft "$PAIR/draft" --target "$PAIR/target" --prompts "$PAIR/prompts.jsonl" --dtype bfloat16 \
    --json "$OUT/run_${NGPU}gpu.json"
}

if [ "$NGPU" -lt 2 ]; then
  echo "multigpu_issue8: torch sees $NGPU GPU(s); issue 8 needs 2 or more" | tee -a "$OUT/summary.txt"
  part_env
  exit 1
fi
parts=${*:-env tests bench run}
for part in $parts; do
  case $part in
    env | tests | bench | run) "part_$part" ;;
    *) echo "multigpu_issue8: unknown part '$part' (env, tests, bench, run)" >&2; exit 2 ;;
  esac
done
cat "$OUT/summary.txt"
