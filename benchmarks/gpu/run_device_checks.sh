#!/usr/bin/env bash
# Runs on a lent GPU machine, from the repository root, every GPU check of
# issues 3 and 5 out of .device-bundle/ (made here by scripts/device-bundle.sh):
#   cuda_gpu_tests   the CUDA backend on the device (allocation, both ready-event
#                    modes, stream waits on host flags, the wait kernel in a
#                    captured graph, 1A1F over TCP with device tensors)
#   cuda_latency     record -> send thread sees it (both modes); flag -> stream resumes
#   model_gpu_tests  every model kernel against the CPU at full width, and the
#                    timing table (decode attention vs HBM, expert GEMMs vs cuBLAS)
#   step5_gpu_tests  the Step-5 kernels (indexer scores, top-k block selection,
#                    sparse decode attention) against the CPU, full and tiny widths
# Logs go to $OUT (the device tool brings them back) or .device-bundle/out.
# Each step has its own time limit; one failing does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/../.."
bundle=.device-bundle
out=${OUT:-$bundle/out}
mkdir -p "$out"
if [[ ! -x $bundle/bin/cuda_gpu_tests ]]; then
  echo "run_device_checks: no $bundle; run scripts/device-bundle.sh first and carry it" >&2
  exit 2
fi
export LD_LIBRARY_PATH="$PWD/$bundle/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  nvcc --version 2>/dev/null | tail -1
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"

summary=()
step() {  # name, seconds, command...
  local name=$1 seconds=$2
  shift 2
  echo "== $name"
  timeout "$seconds" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$out/$name.log"
  summary+=("$name: exit $rc")
}
step cuda_gpu_tests 180 "$bundle/bin/cuda_gpu_tests"
step cuda_latency 120 "$bundle/bin/cuda_latency" 2000 0
step model_gpu_tests 300 "$bundle/bin/model_gpu_tests"
if [[ -x $bundle/bin/step5_gpu_tests ]]; then
  step step5_gpu_tests 240 "$bundle/bin/step5_gpu_tests"
else
  summary+=("step5_gpu_tests: not in the bundle (rebuild it with scripts/device-bundle.sh)")
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
! grep -qv 'exit 0$' "$out/summary.txt"
