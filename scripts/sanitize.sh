#!/usr/bin/env bash
# The pure C++ core (planner, schedules, layouts, env knobs) and its GoogleTests under
# AddressSanitizer + UndefinedBehaviorSanitizer. Any report fails the run. Run by run_tests.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(pwd -P)}  # as setup_env.sh: cache hits across clones
cmake -S . -B build-asan -G Ninja -DBYTESCALE_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build-asan
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
ctest --test-dir build-asan --output-on-failure -j "$(nproc)"
