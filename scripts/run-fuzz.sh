#!/usr/bin/env bash
# Builds the libFuzzer targets (preset `fuzz`, clang, ASan+UBSan) and runs each
# from its committed seed corpus (tests/fuzz/corpus/<target>, seeded from real
# traffic by tests/fuzz/capture_seeds.py). Any crash, sanitizer report or
# failed invariant (round trip, split-point independence) fails the script;
# the reproducer is left in build-fuzz/artifacts/.
#
#   scripts/run-fuzz.sh [TOTAL_SECONDS]   bounded run for CI (default 60): fuzzing
#                                         seconds split evenly over the targets,
#                                         FUZZ_JOBS (default: the cores) at a time
#   scripts/run-fuzz.sh --long [RUNS]     RUNS executions per target (default
#                                         10^8; hours to days, see docs/testing.md)
#   FUZZ_TARGETS="frame control" scripts/run-fuzz.sh ...   a subset
#
# Prints executions, coverage (libFuzzer's cov: edges, ft: features) and corpus
# size per target, also written to build-fuzz/fuzz-summary.txt. Inputs found
# are kept in build-fuzz/corpus/<target> (not in the source tree); copy small
# interesting ones into tests/fuzz/corpus/<target> by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
long=0
runs=100000000
total=60
if [[ ${1:-} == --long ]]; then
  long=1
  runs=${2:-$runs}
elif [[ -n ${1:-} ]]; then
  total=$1
fi
read -r -a targets <<<"${FUZZ_TARGETS:-frame control rdma_boot tcp_stream handshake control_stream}"
per=$(( total / ${#targets[@]} ))
(( per >= 1 )) || per=1

cmake --preset fuzz >/dev/null
cmake --build build-fuzz --target "${targets[@]/#/stepmesh_fuzz_}" -j"$(nproc)"

summary=build-fuzz/fuzz-summary.txt
# fuzz_one TARGET: runs one fuzzer; its summary row goes to build-fuzz/row-TARGET.
fuzz_one() {
  local t=$1 work=build-fuzz/corpus/$1 status execs last cov ft corp
  local limit
  mkdir -p "$work" build-fuzz/artifacts
  if (( long )); then
    limit=(-runs="$runs")
    echo "== fuzzing $t for $runs executions"
  else
    limit=(-max_total_time="$per")
    echo "== fuzzing $t for ${per}s"
  fi
  status=0
  ./build-fuzz/tests/fuzz/stepmesh_fuzz_$t "${limit[@]}" -max_len=4096 -timeout=30 \
      -print_final_stats=1 -artifact_prefix=build-fuzz/artifacts/"$t"- \
      "$work" "tests/fuzz/corpus/$t" > "build-fuzz/fuzz-$t.log" 2>&1 || status=$?
  grep -E "^#[0-9]+[[:space:]]+(INITED|DONE)|ERROR|SUMMARY|fuzz_" "build-fuzz/fuzz-$t.log" | tail -4 || true
  if (( status != 0 )); then
    echo "fuzzer $t failed (exit $status); see build-fuzz/fuzz-$t.log" >&2
    tail -30 "build-fuzz/fuzz-$t.log" >&2
    return "$status"
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "build-fuzz/fuzz-$t.log" | tail -1)
  last=$(grep -E "^#[0-9]+[[:space:]]" "build-fuzz/fuzz-$t.log" | tail -1)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([0-9]*\/[0-9a-zA-Z]*\).*/\1/p' <<<"$last")
  printf '%-14s %12s %8s %8s %7s %s\n' "$t" "${execs:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" \
    "$( (( long )) && echo "--long $runs" || echo "${per}s")" > "build-fuzz/row-$t"
}

# Each fuzzer is one process on one core: FUZZ_JOBS of them (default: the
# cores) run at a time, each for its full share, so a 2-core CI pays half the
# wall time for the same executions per target. Output is printed per target
# once it has finished.
fuzz_jobs=${FUZZ_JOBS:-$(nproc)}
(( fuzz_jobs >= 1 )) || fuzz_jobs=1
printf '%-14s %12s %8s %8s %7s %s\n' target executions cov ft corpus mode > "$summary"
failed=0
for (( i = 0; i < ${#targets[@]}; i += fuzz_jobs )); do
  batch=("${targets[@]:i:fuzz_jobs}")
  pids=()
  for t in "${batch[@]}"; do
    rm -f "build-fuzz/row-$t"
    fuzz_one "$t" > "build-fuzz/run-$t.out" 2>&1 &
    pids+=("$!")
  done
  for j in "${!batch[@]}"; do
    status=0
    wait "${pids[j]}" || status=$?
    cat "build-fuzz/run-${batch[j]}.out"
    (( status == 0 )) || failed=$status
  done
  (( failed == 0 )) || exit "$failed"
done
for t in "${targets[@]}"; do
  cat "build-fuzz/row-$t" >> "$summary"
done
cat "$summary"
echo "fuzzing: no findings"
