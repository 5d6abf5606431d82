#!/usr/bin/env bash
# Builds the libFuzzer targets (preset `fuzz`, clang, ASan+UBSan) and runs each
# from its committed seed corpus (tests/fuzz/corpus/<target>, seeded from real
# traffic by tests/fuzz/capture_seeds.py). Any crash, sanitizer report or
# failed invariant (round trip, split-point independence) fails the script;
# the reproducer is left in build-fuzz/artifacts/.
#
#   scripts/run-fuzz.sh [TOTAL_SECONDS]   bounded run for CI (default 60), split
#                                         evenly over the targets
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
printf '%-14s %12s %8s %8s %7s %s\n' target executions cov ft corpus mode > "$summary"
for t in "${targets[@]}"; do
  work=build-fuzz/corpus/$t
  mkdir -p "$work" build-fuzz/artifacts
  if (( long )); then
    limit=(-runs="$runs")
    echo "== fuzzing $t for $runs executions"
  else
    limit=(-max_total_time="$per")
    echo "== fuzzing $t for ${per}s"
  fi
  set +e
  ./build-fuzz/tests/fuzz/stepmesh_fuzz_$t "${limit[@]}" -max_len=4096 -timeout=30 \
      -print_final_stats=1 -artifact_prefix=build-fuzz/artifacts/"$t"- \
      "$work" "tests/fuzz/corpus/$t" > "build-fuzz/fuzz-$t.log" 2>&1
  status=$?
  set -e
  grep -E "^#[0-9]+[[:space:]]+(INITED|DONE)|ERROR|SUMMARY|fuzz_" "build-fuzz/fuzz-$t.log" | tail -4 || true
  if (( status != 0 )); then
    echo "fuzzer $t failed (exit $status); see build-fuzz/fuzz-$t.log" >&2
    tail -30 "build-fuzz/fuzz-$t.log" >&2
    exit "$status"
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "build-fuzz/fuzz-$t.log" | tail -1)
  last=$(grep -E "^#[0-9]+[[:space:]]" "build-fuzz/fuzz-$t.log" | tail -1)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([0-9]*\/[0-9a-zA-Z]*\).*/\1/p' <<<"$last")
  printf '%-14s %12s %8s %8s %7s %s\n' "$t" "${execs:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" \
    "$( (( long )) && echo "--long $runs" || echo "${per}s")" >> "$summary"
done
cat "$summary"
echo "fuzzing: no findings"
