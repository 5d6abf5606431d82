#!/usr/bin/env bash
# Builds and runs the GPU checks of the example model's CUDA kernels
# (tests/model_gpu): every CUDA kernel against its CPU twin at Step-3's full
# widths, plus a timing table (decode attention vs HBM, GEMMs vs cuBLAS).
# Meant for a machine with an H200 (or any sm_90 GPU); run from anywhere.
#
#   benchmarks/model_gpu/run_model_gpu_checks.sh [build-dir]
#
# The CMake build needs stepmesh's dependencies (abseil, hwloc, Catch2). If
# configuring fails (e.g. a bare CUDA image), the script falls back to
# compiling the three pieces that matter (afd_model, afd_model_cuda and the
# test) directly with nvcc and g++: none of them uses those dependencies.
# STEPMESH_MODEL_GPU_DIRECT=1 forces the direct build.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="${1:-${root}/build-gpu}"
jobs="${JOBS:-16}"
nvcc="${NVCC:-/usr/local/cuda/bin/nvcc}"
cd "${root}"

binary=""
if [[ "${STEPMESH_MODEL_GPU_DIRECT:-0}" != 1 ]] &&
   cmake -S . -B "${build}" -G Ninja -DCMAKE_BUILD_TYPE=Release \
       -DSTEPMESH_BUILD_TESTS=ON -DSTEPMESH_BUILD_BENCHMARKS=OFF \
       -DSTEPMESH_ENABLE_RDMA=OFF -DCMAKE_CUDA_COMPILER="${nvcc}"; then
  cmake --build "${build}" --target afd_model_cuda model_gpu_tests -j "${jobs}"
  binary="${build}/tests/model_gpu/model_gpu_tests"
else
  echo "run_model_gpu_checks: CMake configure unavailable, building directly" >&2
  out="${build}/direct"
  mkdir -p "${out}"
  cuda_home="$(dirname "$(dirname "${nvcc}")")"
  objects=()
  pids=()
  for source in examples/afd_model/cuda/*.cu; do
    object="${out}/$(basename "${source}").o"
    "${nvcc}" -std=c++17 -O2 -I. \
      --generate-code=arch=compute_90,code=[sm_90,compute_90] \
      -Xcompiler=-fPIC -c "${source}" -o "${object}" &
    pids+=($!)
    objects+=("${object}")
  done
  for source in examples/afd_model/{attention_side,config,ffn_side,model_weights,reference}.cc \
                examples/afd_model/kernels/cpu_kernels.cc tests/model_gpu/model_gpu_tests.cc; do
    object="${out}/$(basename "${source}").o"
    g++ -std=c++20 -O2 -ftree-vectorize -fvect-cost-model=dynamic -I. \
      -I"${cuda_home}/include" \
      -DAFD_MODEL_CONFIG_DIR="\"${root}/examples/afd_model/configs\"" \
      -c "${source}" -o "${object}" &
    pids+=($!)
    objects+=("${object}")
  done
  for pid in "${pids[@]}"; do wait "${pid}"; done
  binary="${out}/model_gpu_tests"
  g++ -o "${binary}" "${objects[@]}" -L"${cuda_home}/lib64" \
    -lcublas -lcublasLt -lcudart -lpthread -Wl,-rpath,"${cuda_home}/lib64"
fi

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv || true
fi
set +e
"${binary}"
status=$?
set -e
case "${status}" in
  0) echo "run_model_gpu_checks: all checks passed" ;;
  77) echo "run_model_gpu_checks: no GPU, checks skipped" ;;
  *) echo "run_model_gpu_checks: FAILED (exit ${status})" ;;
esac
exit "${status}"
