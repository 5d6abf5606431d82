#!/usr/bin/env bash
# Builds stepmesh with CUDA and runs the GPU checks:
#   1. cuda_backend_tests  (fake CUDA, always runs)
#   2. cuda_gpu_tests      (real device; exit 77 = no GPU)
#   3. cuda_latency        (ready-event and flag->stream latencies)
# Exits 77 when no GPU is usable, after building, so compile errors still fail.
#
# Environment: BUILD_DIR (default <repo>/build-gpu), JOBS (default nproc),
# ITERATIONS (cuda_latency iterations, default 2000), DEVICE (default 0).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${BUILD_DIR:-$root/build-gpu}
jobs=${JOBS:-$(nproc)}
iterations=${ITERATIONS:-2000}
device=${DEVICE:-0}

if ! command -v nvcc >/dev/null 2>&1 && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "run_gpu_checks: no nvcc, the CUDA backend cannot be built; skipping" >&2
  exit 77
fi

benchmarks=OFF
[[ -f "$root/benchmarks/CMakeLists.txt" ]] && benchmarks=ON
cmake -S "$root" -B "$build" -G Ninja \
  -DSTEPMESH_ENABLE_CUDA=ON -DSTEPMESH_BUILD_TESTS=ON \
  -DSTEPMESH_BUILD_EXAMPLES=OFF -DSTEPMESH_BUILD_BENCHMARKS="$benchmarks"

targets=(cuda_backend_tests cuda_gpu_tests)
# The target list read whole first: `grep -q` on a pipe exits at the first
# match, and under pipefail the writer's SIGPIPE would read as "not found".
target_list="$(cmake --build "$build" --target help)"
if grep -q '^cuda_latency:' <<<"$target_list"; then
  targets+=(cuda_latency)
else
  echo "run_gpu_checks: cuda_latency is not part of the build" \
       "(benchmarks/CMakeLists.txt should add_subdirectory(gpu)); timing skipped" >&2
fi
cmake --build "$build" --target "${targets[@]}" -j "$jobs"

echo "== cuda_backend_tests (fake CUDA)"
"$build/tests/cuda/cuda_backend_tests"

echo "== cuda_gpu_tests (device 0)"
set +e
"$build/tests/cuda/cuda_gpu_tests"
rc=$?
set -e
if [[ $rc -eq 77 ]]; then
  echo "run_gpu_checks: no usable GPU; GPU tests and timing skipped" >&2
  exit 77
fi
[[ $rc -eq 0 ]] || { echo "run_gpu_checks: cuda_gpu_tests failed ($rc)" >&2; exit "$rc"; }

if [[ " ${targets[*]} " == *" cuda_latency "* ]]; then
  echo "== cuda_latency ($iterations iterations, device $device)"
  latency=$(find "$build" -name cuda_latency -type f -perm -u+x | head -n 1)
  "$latency" "$iterations" "$device"
fi
echo "run_gpu_checks: all GPU checks passed"
