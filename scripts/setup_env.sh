#!/usr/bin/env bash
# Installs what bytescale needs on a fresh Debian 12 + Python 3.11 machine and builds the extension
# in place (editable install). Idempotent: a second run only rebuilds what changed.
#   BYTESCALE_TORCH   torch requirement (default torch==2.14.1, the CUDA 13.0 build on local disk;
#                     torch==2.13.0 is the CPU build). The CUDA parts compile when torch has CUDA
#                     and nvcc is present, even on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TORCH_REQ=${BYTESCALE_TORCH:-torch==2.14.1}

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v ccache >/dev/null || need_apt+=(ccache)
[ -f /usr/include/gtest/gtest.h ] || need_apt+=(libgtest-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if ! $PY -c "import torch" 2>/dev/null; then
  echo "setup: pip install $TORCH_REQ"
  $PY -m pip install -q "$TORCH_REQ"
fi
$PY -m pip install -q numpy pytest pytest-timeout hypothesis ninja matplotlib transformers pyarrow datasets ray tqdm tensorboard expecttest

export PATH="/usr/lib/ccache:$PATH"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
echo "setup: building bytescale (MAX_JOBS=$MAX_JOBS)"
start=$(date +%s)
log=$(mktemp)
if ! $PY -m pip install --no-build-isolation --no-deps -e . >"$log" 2>&1; then
  echo "setup: building bytescale FAILED; the end of the build log:" >&2
  grep -v "^\s*$" "$log" | tail -n 60 >&2
  exit 1
fi
$PY -c "import bytescale, bytescale._C as C; print('setup: bytescale', bytescale.__version__, 'cuda' if C.with_cuda else 'cpu-only', 'built in', $(date +%s) - $start, 's')"
