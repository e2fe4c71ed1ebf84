#!/usr/bin/env bash
# DeepEP (V1 API, `deep_ep.Buffer`) built from source against this machine's torch, NCCL and pip
# NVSHMEM, for images where the `sgl-deep-ep` wheels cannot load (each pins one torch: 0.1.2.post1
# needs torch 2.14.1 and NCCL >= 2.30). Issue 34: commit 567632d of deepseek-ai/DeepEP (its last V1
# API commit), nvidia-nvshmem-cu13 3.4.x, CUDA 13 with its CCCL headers under include/cccl.
#
#   tools/build_deepep.sh --export DIR [REPO]   write the pinned commit's tree to DIR (from a clone
#                                               REPO, default the search tool's mirror), stamped
#   tools/build_deepep.sh DIR                   build DIR in place (~1 min on 16 cores), then
#                                               import it; use with PYTHONPATH=DIR
#
# On a device machine (no internet): export into the checkout's ignored .deepep-src/ here, carry
# it (`carry: [".whl", ".deepep-src"]`, ~12 MB), build there.
set -euo pipefail
COMMIT=567632d
if [ "${1:-}" = --export ]; then
  dir=${2:?usage: tools/build_deepep.sh --export DIR [REPO]}
  repo=${3:-/work/.mirror/deepseek-ai+DeepEP/repo}
  git -C "$repo" cat-file -e "$COMMIT^{commit}" 2>/dev/null \
    || { echo "build_deepep: $repo has no commit $COMMIT (fetch deepseek-ai/DeepEP)" >&2; exit 2; }
  mkdir -p "$dir"
  git -C "$repo" archive "$COMMIT" | tar -x -C "$dir"
  git -C "$repo" rev-parse "$COMMIT" > "$dir/.deepep-commit"
  echo "build_deepep: $COMMIT -> $dir ($(du -sh "$dir" | cut -f1))"
  exit 0
fi
dir=${1:?usage: tools/build_deepep.sh DIR   (or --export DIR [REPO])}
stamp=$(cat "$dir/.deepep-commit" 2>/dev/null || true)
case $stamp in
  "$COMMIT"*) ;;
  *) echo "build_deepep: $dir is not DeepEP $COMMIT (stamp '${stamp}'; make it with --export)" >&2; exit 2 ;;
esac
cccl=${CUDA_HOME:-/usr/local/cuda}/include/cccl
[ -d "$cccl" ] || { echo "build_deepep: no CCCL headers at $cccl" >&2; exit 2; }
python3 -c "import nvidia.nvshmem" 2>/dev/null \
  || { echo "build_deepep: pip NVSHMEM missing (pip install nvidia-nvshmem-cu13): low-latency kernels need it" >&2; exit 2; }
cd "$dir"
# CUDA 13 keeps cuda/std etc. under include/cccl, which DeepEP's setup.py does not add.
grep -q "$cccl" setup.py || sed -i "s|include_dirs = \['csrc/'\]|include_dirs = ['csrc/', '$cccl']|" setup.py
grep -q "$cccl" setup.py || { echo "build_deepep: could not add $cccl to setup.py's include_dirs" >&2; exit 2; }
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} python3 setup.py build_ext --inplace > build.log 2>&1 \
  || { tail -30 build.log >&2; echo "build_deepep: build failed (log: $dir/build.log)" >&2; exit 1; }
PYTHONPATH=$PWD:${PYTHONPATH:-} python3 -c "import deep_ep; print('build_deepep: deep_ep', deep_ep.__file__)"
