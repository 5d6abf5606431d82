#!/usr/bin/env bash
# The README's main command: installs the Debian packages, builds only what
# the AFD example needs and runs tiny-Step-3 disaggregated as 2 attention + 2
# FFN processes over TCP on 127.0.0.1, then prints the report and the Gate A
# check against the monolithic reference. The exit status follows the
# reference check.
#
#   scripts/run-example.sh [extra afd_launch flags, e.g. --chrome-trace t.json]
#   scripts/run-example.sh --model tiny-step5     # the Step-5-Preview model
#
# BUILD_DIR (default build) and BUILD_TYPE (default RelWithDebInfo) may be
# set in the environment.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${BUILD_DIR:-build}"
build_type="${BUILD_TYPE:-RelWithDebInfo}"
cd "$root"

"$root/scripts/install-deps.sh"

if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  # First configure only: a CPU-only build without tests or benchmarks keeps
  # the build short on small machines; an existing cache is left as it is.
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE="$build_type" \
    -DSTEPMESH_ENABLE_CUDA=OFF -DSTEPMESH_BUILD_TESTS=OFF \
    -DSTEPMESH_BUILD_BENCHMARKS=OFF
fi
cmake --build "$build_dir" -j "$(nproc)" \
  --target afd_attention afd_ffn afd_launch stepmesh_scheduler

# 2A2F: 9 requests per attention instance in 3 micro-batches, 32-token
# prompts, 16 greedy decode steps. A Step-5 model (--model tiny-step5) gets
# 112-token prompts instead, so its global layers' block selection really
# drops history; an explicit --prompt-len wins.
prompt_len=32
args=("$@")
for ((i = 0; i < ${#args[@]}; ++i)); do
  case "${args[i]}" in
    --prompt-len) prompt_len="" ;;
    --model|--config)
      if [[ -n $prompt_len && ${args[i+1]:-} == *step5* ]]; then prompt_len=112; fi ;;
  esac
done
exec "$build_dir/examples/afd_model/afd_launch" --attention 2 --ffn 2 \
  --requests 9 ${prompt_len:+--prompt-len "$prompt_len"} --decode-steps 16 \
  --micro-batches 3 --transport tcp --backend cpu_mock "$@"
