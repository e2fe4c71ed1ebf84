# Sourced by the device scripts (gpu_check.sh, gpu_step.sh, kernel_perf.sh): installs the wheels the
# GPU image lacks, carried in .whl/ (../shared/tools/device-wheels.sh), into /tmp/site and puts
# them and the checkout on PYTHONPATH. Returns 1 when a wheel does not install.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
  export PYTHONPATH=/tmp/site:$PWD
fi

# device_log NAME: the device scripts' shared start: $OUT (default ./NAME) made, $LOG = $OUT/NAME.log
# begun with the date and the GPU, and $ONE, the `epdraft run` overrides for one rank on one GPU.
device_log() {
  OUT=${OUT:-./$1}
  mkdir -p "$OUT"
  LOG=$OUT/$1.log
  date -u +%FT%TZ | tee -a "$LOG"  # appended: one device command may run several scripts
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
  ONE="--set cluster.nproc_per_node=1 --set draft.attn_dp=1 --set target.dp=1 --set target.tp=1 --set draft.moe_ep=1"
}
