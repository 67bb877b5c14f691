#!/usr/bin/env bash
# Installs what bytescale needs on a fresh Debian 12 + Python 3.11 machine and builds the extension
# in place (editable install). Idempotent and quick when nothing changed: packages already present
# are not asked for, and an installed tree is brought up to date by ninja in its build directory
# (build/temp.*), which recompiles only the sources whose inputs changed and relinks only then
# (seconds when nothing did). A first build compiles everything, the CUDA plug-ins included.
#   PYTHON            the interpreter to install into and build with (default python3)
#   BYTESCALE_TORCH   torch requirement (default torch==2.14.1, the CUDA 13.0 build on local disk;
#                     torch==2.13.0 is the CPU build). The CUDA parts compile when torch has CUDA
#                     and nvcc is present, even on a machine without a GPU.
#   MAX_JOBS          parallel compile jobs (default: the number of cores)
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
# Python packages: ask pip only for those missing (pip itself takes seconds even when all are there).
# setuptools >= 64 and wheel: the editable install below runs without build isolation.
missing=$($PY - <<'EOF'
import importlib.util
need = {"numpy": "numpy", "pytest": "pytest", "pytest_timeout": "pytest-timeout", "hypothesis": "hypothesis",
        "ninja": "ninja", "matplotlib": "matplotlib", "transformers": "transformers", "pyarrow": "pyarrow",
        "datasets": "datasets", "ray": "ray", "tqdm": "tqdm", "tensorboard": "tensorboard",
        "expecttest": "expecttest", "wheel": "wheel", "trl": "trl"}
out = [pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None]
try:
    import setuptools
    if int(setuptools.__version__.split(".")[0]) < 64:
        out.append("setuptools>=64")
except ImportError:
    out.append("setuptools>=64")
print(" ".join(out))
EOF
)
if [ -n "$missing" ]; then
  echo "setup: pip install $missing"
  # shellcheck disable=SC2086
  $PY -m pip install -q $missing
fi

# ccache: C++ through Debian's compiler links (recent torch also wraps compilers itself), nvcc
# through PYTORCH_NVCC (setup.py). base_dir set here, not in a user's ccache.conf, so that a clean
# machine (CI) behaves as a configured one: paths inside the tree are hashed relative to it, so a
# second clone finds the first one's objects (a user's CCACHE_BASEDIR wins).
export PATH="/usr/lib/ccache:$PATH"
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(pwd -P)}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
start=$(date +%s)
log=$(mktemp)
trap 'rm -f "$log" "$log.t" "$log.c"' EXIT
# Installed from this tree already (an editable install whose bytescale is ours)? Then bring the
# build up to date in place; otherwise install (the first build). Checked outside the tree and
# without PYTHONPATH, so only a real installation counts.
here=$(pwd -P)
if (cd / && env -u PYTHONPATH "$PY" -c "
import importlib.util, os, sys
spec = importlib.util.find_spec('bytescale')
ok = spec is not None and spec.origin and os.path.realpath(spec.origin) == os.path.realpath(sys.argv[1])
sys.exit(0 if ok else 1)" "$here/bytescale/__init__.py") 2>/dev/null; then
  what="up to date"
  cmd=("$PY" setup.py build_ext --inplace)
else
  echo "setup: building and installing bytescale (MAX_JOBS=$MAX_JOBS; the first build compiles every source)"
  what="built and installed"
  cmd=("$PY" -m pip install -v --no-build-isolation --no-deps -e .)
fi
# CPU seconds (user + sys) of this shell's finished children, from bash's `times` (run in this
# shell: a subshell would count its own children only)
children_cpu() { times >"$log.t"; tail -n 1 "$log.t" | awk '{ t = 0; for (i = 1; i <= NF; i++) { split($i, a, /[ms]/); t += a[1] * 60 + a[2] } printf "%d", t }' >"$log.c"; }
children_cpu
cpu0=$(cat "$log.c")
if ! "${cmd[@]}" >"$log" 2>&1; then
  echo "setup: building bytescale FAILED (${cmd[*]}); the end of the build log:" >&2
  grep -v "^\s*$" "$log" | tail -n 60 >&2
  exit 1
fi
compiled=$(grep -cE "^\s*\[[0-9]+/[0-9]+\] " "$log" || true)  # ninja's steps: one per compiled source
children_cpu
cpu=$(( $(cat "$log.c") - cpu0 ))
$PY -c "import bytescale, bytescale._C as C; print('setup: bytescale', bytescale.__version__, 'cuda' if C.with_cuda else 'cpu-only', '$what in', $(date +%s) - $start, 's ($compiled sources compiled, $cpu s of CPU)', 'from', bytescale.__file__.rsplit('/', 2)[0])"
