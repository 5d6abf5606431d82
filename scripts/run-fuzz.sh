#!/usr/bin/env bash
# Builds the libFuzzer targets (preset `fuzz`, clang) and runs each for a
# bounded time from the checked-in seed corpus. Any crash, sanitizer report or
# round-trip mismatch fails the script; the reproducer is left in build-fuzz/.
#
#   scripts/run-fuzz.sh [total seconds, default 60]
#
# Found inputs are kept in build-fuzz/corpus/<target> (not in the source tree);
# copy interesting small ones into tests/fuzz/corpus/<target> by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
total=${1:-60}
targets=(frame control)
per=$(( total / ${#targets[@]} ))
(( per >= 1 )) || per=1

cmake --preset fuzz >/dev/null
cmake --build build-fuzz --target stepmesh_fuzz_frame stepmesh_fuzz_control -j"$(nproc)"

for t in "${targets[@]}"; do
  work=build-fuzz/corpus/$t
  mkdir -p "$work" build-fuzz/artifacts
  echo "== fuzzing $t for ${per}s"
  ./build-fuzz/tests/fuzz/stepmesh_fuzz_$t -max_total_time="$per" -max_len=4096 \
      -print_final_stats=1 -artifact_prefix=build-fuzz/artifacts/"$t"- \
      "$work" "tests/fuzz/corpus/$t" 2>&1 | tee "build-fuzz/fuzz-$t.log" | grep -E "^#|stat::|ERROR|SUMMARY" | tail -6
  status=${PIPESTATUS[0]}
  if (( status != 0 )); then
    echo "fuzzer $t failed (exit $status); see build-fuzz/fuzz-$t.log" >&2
    exit "$status"
  fi
done
echo "fuzzing: no findings"
