#!/usr/bin/env bash
# Issue 34 on one multi-GPU host (2, 4 or 8 GPUs), one part per device command (STEP_TIMEOUT bounds
# every step; the device tool's command limit is 10 minutes, so on 4-8 GPUs run `bench` once per GPU
# count, GPU_COUNTS=2 then 4 then 8, and `step` / `run` with a lower STEP_TIMEOUT):
#
#   bash tools/multigpu_issue34.sh env | deepep | tests | bench | step | run
#
# Carry [".whl", ".deepep-src"]: msgspec's wheel (../shared/tools/device-wheels.sh) and DeepEP's
# source (tools/build_deepep.sh --export .deepep-src); `deepep` builds it (~1 min), the later parts
# find it on PYTHONPATH (a part run on a fresh machine builds it first when it is missing).
#   env     GPUs, topology, versions, what imports
#   deepep  DeepEP 567632d built from .deepep-src
#   tests   every GPU test on this machine's GPUs (NCCL equivalence of every layout incl. torch_fixed
#           under CUDA graphs, DeepEP normal and low-latency, Mooncake EP)
#   bench   `epdraft bench dispatch --device cuda`, every backend side by side at EP 2 / 4 / 8,
#           H 7168, top-8, 16 / 128 / 384 rows per rank (issue 34's point: EP 2, 128 rows; DeepEP's
#           low-latency kernels take T <= 511 rows under NVSHMEM_QP_DEPTH's default 1024)
#   step    the draft iteration sharded vs replicated at N = 64 requests per rank: `epdraft run` of
#           the random pair (issue 13's shape) with graphs, replicated / alltoall (torch_fixed) /
#           gather on all GPUs; each run's "draft iteration ... ms per step" line is the comparison
#   run     `epdraft run` of the random pair (alltoall, EP = all GPUs) and of the tiny V4.1 DSpark
#           draft in DeepSeek's released layout, both with graphs, lossless-checked
# Logs: $OUT (default ./issue34-out): one log per step and summary.txt (exit code, seconds).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/issue34-out}
STEP_TIMEOUT=${STEP_TIMEOUT:-540}
PAIR=${PAIR:-/tmp/issue34-pair}
mkdir -p "$OUT"
. tools/device_env.sh || exit 1
[ -d .deepep-src ] && export PYTHONPATH=$PWD/.deepep-src:${PYTHONPATH:-}
EPDRAFT=(python3 -m epdraft.cli)

# step NAME CMD...: CMD's stdout+stderr to $OUT/NAME.log under STEP_TIMEOUT; its rc and seconds to summary.txt.
step() {
  local name=$1 start rc
  shift
  start=$(date +%s)
  timeout "$STEP_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "$name: rc=$rc ($(( $(date +%s) - start )) s)" | tee -a "$OUT/summary.txt"
  return $rc
}

NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
GPU_COUNTS=${GPU_COUNTS:-$(for n in 2 4 8; do [ "$n" -le "$NGPU" ] && echo "$n"; done)}
# configs/h200x8-dp8-ep8.toml (alltoall, EP 8) on N GPUs.
on_gpus() { echo --set cluster.nproc_per_node="$1" --set draft.attn_dp="$1" --set draft.moe_ep="$1" --set target.dp="$1"; }

have_deepep() { python3 -c "import deep_ep" 2>/dev/null; }
part_deepep() { have_deepep || step deepep_build tools/build_deepep.sh .deepep-src; }

part_env() {
  step env bash -c '
    date -u; nvidia-smi -L; nvidia-smi topo -m
    python3 -c "import sys, torch; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"nccl\", torch.cuda.nccl.version(), \"gpus\", torch.cuda.device_count())"
    for m in triton transformers deep_ep mooncake.mooncake_ep_buffer nvidia.nvshmem; do
      python3 -c "import $m" > /dev/null 2>&1 && echo "import $m: ok" || echo "import $m: missing"
    done'
}

part_tests() {
  part_deepep
  step pytest_gpu python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_dispatch_nccl.py \
    tests/gpu/test_capture_dispatch.py tests/gpu/test_mooncake_ep.py tests/gpu/test_device_sync.py
}

part_bench() {
  part_deepep
  for n in $GPU_COUNTS; do
    # shellcheck disable=SC2046  # on_gpus prints separate words on purpose
    step "bench_dispatch_${n}gpu" "${EPDRAFT[@]}" bench dispatch --config configs/h200x8-dp8-ep8.toml $(on_gpus "$n") \
      --device cuda --rows 16,128,384 --hidden 7168 --top-k 8 --experts 256 --intermediate 2048 \
      --a2a-backends torch,torch_fixed,deepep,deepep_ll,mooncake --steps 20 --warmup 5 \
      --json "$OUT/bench_dispatch_${n}gpu.jsonl"
  done
}

pair() {
  [ -f "$PAIR/prompts.jsonl" ] || step make_random_pair python3 tools/make_random_pair.py "$PAIR" \
    --prompts $((64 * NGPU)) --dtype bfloat16
}

part_step() {
  pair || return
  local layout
  for layout in replicated alltoall gather; do
    # shellcheck disable=SC2046
    step "iteration_${layout}_${NGPU}gpu" "${EPDRAFT[@]}" run configs/h200x8-dp8-ep8.toml $(on_gpus "$NGPU") \
      --set draft.moe_layout="$layout" $([ "$layout" = replicated ] && echo --set draft.moe_ep=1) \
      --set draft.a2a_backend=torch_fixed --set draft.cuda_graphs=true \
      --draft "$PAIR/draft" --target "$PAIR/target" --prompts "$PAIR/prompts.jsonl" --max-new-tokens 32 \
      --json "$OUT/iteration_${layout}_${NGPU}gpu.json"
    grep -h "draft iteration\|lossless" "$OUT/iteration_${layout}_${NGPU}gpu.log" | sed "s/^/$layout: /" \
      | tee -a "$OUT/summary.txt"
  done
}

part_run() {
  pair || return
  # shellcheck disable=SC2046
  step "run_pair_${NGPU}gpu" "${EPDRAFT[@]}" run configs/h200x8-dp8-ep8.toml $(on_gpus "$NGPU") \
    --set draft.a2a_backend=torch_fixed --set draft.cuda_graphs=true --draft "$PAIR/draft" --target "$PAIR/target" \
    --prompts "$PAIR/prompts.jsonl" --max-prompts $((8 * NGPU)) --json "$OUT/run_pair_${NGPU}gpu.json"
  step make_dspark python3 tools/make_deepseek_dspark_draft.py /tmp/issue34-dspark --v41 --quantized || return
  # shellcheck disable=SC2046
  step "run_dspark_${NGPU}gpu" "${EPDRAFT[@]}" run configs/h200x8-dp8-ep8.toml $(on_gpus "$NGPU") \
    --set draft.a2a_backend=torch_fixed --set draft.cuda_graphs=true --draft /tmp/issue34-dspark \
    --json "$OUT/run_dspark_${NGPU}gpu.json"
  grep -h "lossless" "$OUT/run_pair_${NGPU}gpu.log" "$OUT/run_dspark_${NGPU}gpu.log" | tee -a "$OUT/summary.txt"
}

if [ "$NGPU" -lt 2 ] && [ "${1:-}" != env ] && [ "${1:-}" != deepep ]; then
  echo "multigpu_issue34: torch sees $NGPU GPU(s); these parts need 2 or more" | tee -a "$OUT/summary.txt"
  exit 1
fi
for part in "${@:-env}"; do
  case $part in
    env | deepep | tests | bench | step | run) "part_$part" ;;
    *) echo "multigpu_issue34: unknown part '$part' (env, deepep, tests, bench, step, run)" >&2; exit 2 ;;
  esac
done
cat "$OUT/summary.txt"
