# Sourced by the device scripts (gpu_check.sh, gpu_step.sh, kernel_perf.sh): installs the wheels the
# GPU image lacks, carried in .whl/ (../shared/tools/device-wheels.sh), into /tmp/site and puts
# them and the checkout on PYTHONPATH. Returns 1 when a wheel does not install.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
  export PYTHONPATH=/tmp/site:$PWD
fi
