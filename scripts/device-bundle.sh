#!/usr/bin/env bash
# Packs the GPU checks (issues 3, 5, 16, 19, 20, 28 and 31) for a lent GPU machine. Its image has
# CUDA but none of stepmesh's C++ dependencies (Abseil, hwloc, rdma-core,
# Catch2) and nothing can be installed there, so the test programs are built
# here (nvcc, sm_90) and carried with the shared libraries they need.
#
#   scripts/device-bundle.sh            # builds into build/, writes .device-bundle/
#   then, with the device tool:  run  command="bash benchmarks/gpu/run_device_checks.sh backend" (then issue31, model, gate-c;
#                                     carry=[".device-bundle"]  see docs/cuda.md)
#
# .device-bundle/ is git-ignored; it is rebuilt from scratch each time.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
bundle=.device-bundle
jobs=$(nproc)

scripts/install-deps.sh
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSTEPMESH_BUILD_TESTS=ON -DSTEPMESH_BUILD_BENCHMARKS=ON -DSTEPMESH_BUILD_EXAMPLES=ON \
  -DSTEPMESH_ENABLE_CUDA=ON -DSTEPMESH_ENABLE_RDMA=ON >/dev/null
cmake --build "$build" -j "$jobs" --target cuda_gpu_tests cuda_graph_trigger_gpu_test cuda_latency cuda_probe stepmesh_doctor \
  model_gpu_tests step5_gpu_tests afd_launch afd_attention afd_ffn _stepmesh

# afd_launch starts afd_attention and afd_ffn from its own directory.
programs=("$build/tests/cuda/cuda_gpu_tests" "$build/tests/cuda/cuda_graph_trigger_gpu_test"
          "$build/benchmarks/gpu/cuda_latency"
          "$build/benchmarks/gpu/cuda_probe" "$build/src/tools/doctor/stepmesh_doctor"
          "$build/tests/model_gpu/model_gpu_tests" "$build/tests/step5/step5_gpu_tests"
          "$build/examples/afd_model/afd_launch"
          "$build/examples/afd_model/afd_attention" "$build/examples/afd_model/afd_ffn")
rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib"
for program in "${programs[@]}"; do
  objcopy --strip-debug "$program" "$bundle/bin/$(basename "$program")"
done
module=$(cd "$build" && ls python/stepmesh/_stepmesh*.so)  # for the build's interpreter
# Every shared library but the C/C++ runtime (newer on the image) and CUDA's
# own (the image's toolkit and driver provide those), the Python module's too.
for program in "${programs[@]}" "$build/$module"; do
  ldd "$program" | awk '$3 ~ /^\// {print $3}'
done | sort -u | grep -v -E '/(libc|libm|libdl|libpthread|librt|libgcc_s|libstdc\+\+)\.so|/usr/local/cuda' |
  while read -r library; do cp -L "$library" "$bundle/lib/"; done
# The Python package's parts (issue 28). The device's python3 is another
# CPython (3.12) than the one this build's module is for, so
# benchmarks/gpu/build_python_module.sh compiles the binding there, linking what
# the module's link line here names: the archives (libstepmesh.a, Abseil's,
# CUDA's static runtime) and shared libraries, carried, in link.txt.
mkdir -p "$bundle/python/lib" "$bundle/python/include"
cp -r /usr/include/absl /usr/include/pybind11 "$bundle/python/include/"
ninja -C "$build" -t commands "$module" | tail -1 |
  /usr/bin/python3 scripts/device-bundle-link.py "$build" "$bundle" > "$bundle/python/link.txt"
echo "device bundle: $(du -sh "$bundle" | cut -f1) in $bundle ($(ls "$bundle/lib" | wc -l) libraries)"
