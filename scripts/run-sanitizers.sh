#!/usr/bin/env bash
# Builds the unit, transport, end-to-end, reliability and planner tests under
# ASan+UBSan (preset asan) and TSan (preset tsan) and runs them; any sanitizer
# report fails the run (halt_on_error / -fno-sanitize-recover).
#
#   scripts/run-sanitizers.sh [asan|tsan ...]   (default: both)
#
# TSan works with Debian's (uninstrumented) Abseil because stepmesh locks with
# std::mutex (src/base/sync.h), which TSan intercepts; absl::Mutex would be
# invisible to it. The one Abseil state we share between threads is a failed
# absl::Status's reference-counted rep, counted down in uninstrumented code:
# a request's result gets a rep of its own (src/core/request_table.cc).
#
# What runs where (CI time is paid for; every program below is built only for
# the sanitizer that runs it, with -g1 line tables, see CMakePresets.json):
#   both   core_tests, reliability_tests, rdma_tests, cuda_backend_tests,
#          libfabric_tests and their child programs (core_tests and
#          reliability_tests include the libfabric-tcp/-shm rows): the
#          threaded code (transports, receive and
#          send threads, reliability, the fake verbs fabric and fake CUDA
#          streams) and all the byte handling.
#   ASan   planner_tests (single-threaded: nothing for TSan to see) and the
#          example's Gate A, 1A1F, on the CPU engines (afd_launch checks every
#          child's exit status, so a report in the scheduler, attention or FFN
#          process fails it). The model engines and the example (about
#          25 translation units, the heaviest we have) are built once: their
#          kernels run as host functions on the CPU backend's stream threads,
#          and every hand-off between those threads and the transport is the
#          library's (stream order, stream-ordered push/pull, Synchronize),
#          which core_tests' backend and stream-ordered mesh cases run under
#          TSan; the engines add arithmetic, not synchronisation, and their
#          one lock (the first error a host function hit) is an absl::Mutex,
#          which TSan cannot see with Debian's Abseil anyway.
# The multi-process 200-iteration case of core_tests is left to the normal
# suite (the 20-iteration 2A2F process run, "short separate-process run",
# stands in for it); everything else runs.
set -euo pipefail
cd "$(dirname "$0")/.."
presets=("$@")
if (( ${#presets[@]} == 0 )); then
  presets=(asan tsan)
fi
jobs=${JOBS:-$(nproc)}

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/reliability/tsan.supp"

common=(core_tests stepmesh_test_node reliability_tests stepmesh_reliability_node)
exclude='separate processes: 2A2F*'

# Cases tagged [cpu-budget] measure their own process's CPU against a bound
# (the libfabric idle-transport case: 10 ms over an idle second): they run
# after the lanes, alone on the machine, never beside another program.
budget='[cpu-budget]'

# run_lane PRESET BUILD SPEC EXE...: runs the cases of each test executable of
# BUILD that match the Catch2 test spec SPEC (one argument; a space is AND),
# in turn; stops at the first failure (its log's tail printed). The cases of
# the multi-process 200-iteration run are never run here (see above).
run_lane() {
  local preset=$1 build=$2 spec=$3 exe path log names
  shift 3
  for exe in "$@"; do
    path=$(find "$build/tests" -name "$exe" -type f -perm -u+x | head -1)
    if [[ -z $path ]]; then
      echo "$preset: $exe was not built in $build" >&2
      return 1
    fi
    log="$build/$exe.log"
    [[ $spec == "$budget" ]] && log="$build/$exe.budget.log"
    # Catch2 exits non-zero when no case matches: only run where one does
    # (read whole: its exit status is the count, and a grep -q under pipefail
    # would fail on the lister's SIGPIPE).
    if [[ $spec == "$budget" ]]; then
      names=$("$path" --list-test-names-only "$budget" "~$exclude" 2>/dev/null || true)
      [[ $names == *[a-z]* ]] || continue
    fi
    if ! "$path" --order rand --rng-seed time "~$exclude" "$spec" > "$log" 2>&1; then
      echo "$preset: $exe failed; tail of $log:" >&2
      tail -60 "$log" >&2
      return 1
    fi
    echo "-- $exe $spec: $(grep -E "^(All tests passed|test cases:)" "$log" | tail -1)"
  done
}

# gate_a_1a1f PRESET BUILD: the example's Gate A, 1A1F on the CPU engines.
gate_a_1a1f() {
  local preset=$1 build=$2 launch err
  launch=$(find "$build/examples" -name afd_launch -type f -perm -u+x | head -1)
  rm -rf "$build/afd_gate_a"
  if ! "$launch" --attention 1 --ffn 1 --requests 6 --prompt-len 32 --decode-steps 16 \
      --micro-batches 3 --transport tcp --timeout-ms 120000 --deadline-s 600 \
      --work-dir "$build/afd_gate_a" > "$build/afd_gate_a.log" 2>&1 ||
     ! grep -q "^reference check: PASS" "$build/afd_gate_a.log"; then
    echo "$preset: afd_launch Gate A 1A1F failed; tail of $build/afd_gate_a.log:" >&2
    tail -40 "$build/afd_gate_a.log" >&2
    for err in "$build"/afd_gate_a/*.err; do
      [[ -s $err ]] && { echo "== $err" >&2; tail -30 "$err" >&2; }
    done
    return 1
  fi
  echo "-- afd_launch Gate A 1A1F: $(grep "^reference check" "$build/afd_gate_a.log")"
}

for preset in "${presets[@]}"; do
  echo "== $preset: configure + build"
  cmake --preset "$preset" >/dev/null
  build=build-$preset
  targets=("${common[@]}")
  tests=(core_tests reliability_tests)
  gate_a=0
  if [[ $preset == asan ]]; then
    targets+=(planner_tests afd_launch afd_attention afd_ffn)
    tests+=(planner_tests)
    gate_a=1
  fi
  extra=()
  # The RDMA tests (fake verbs; their GPUDirect cases use the fake CUDA API)
  # and the CUDA backend's tests over the fake CUDA API: built wherever the
  # verbs / CUDA headers exist, no NIC or GPU needed.
  # The target list is read whole first: `ninja ... | grep -q` under pipefail
  # fails whenever grep stops reading before ninja has written everything
  # (SIGPIPE), which silently dropped targets late in the list.
  all_targets=$(ninja -C "$build" -t targets all 2>/dev/null)
  for optional in rdma_tests cuda_backend_tests libfabric_tests; do
    if grep -q "^$optional:" <<<"$all_targets"; then
      extra+=("$optional")
    fi
  done
  cmake --build "$build" --target "${targets[@]}" "${extra[@]}" -j"$jobs"
  echo "== $preset: test"
  # The binaries run directly (one process per executable, random order):
  # much faster than ctest's process per case under sanitizers. Two lanes run
  # side by side, one per core: core_tests alone (the longest, about 1.3
  # cores busy under TSan), and the others one after another, then Gate A
  # (reliability_tests mostly waits on its timeouts: about 0.4 of a core).
  # Each lane stops at its first failure; every failure is reported. Then the
  # [cpu-budget] cases, alone: beside core_tests the libfabric idle case took
  # 15.6 ms of its 10 ms under TSan in a fresh-clone CI (fc60559), which had
  # turned the lanes (about 3 minutes) off.
  lane_b=()
  for exe in "${tests[@]}" "${extra[@]}"; do
    [[ $exe == core_tests ]] || lane_b+=("$exe")
  done
  run_lane "$preset" "$build" "~$budget" core_tests > "$build/lane-a.out" 2>&1 &
  lane_a_pid=$!
  lane_b_status=0
  run_lane "$preset" "$build" "~$budget" "${lane_b[@]}" > "$build/lane-b.out" 2>&1 ||
    lane_b_status=$?
  if (( lane_b_status == 0 && gate_a )); then
    gate_a_1a1f "$preset" "$build" >> "$build/lane-b.out" 2>&1 || lane_b_status=$?
  fi
  lane_a_status=0
  wait "$lane_a_pid" || lane_a_status=$?
  cat "$build/lane-a.out" "$build/lane-b.out"
  if (( lane_a_status != 0 || lane_b_status != 0 )); then
    echo "$preset: failed (core_tests lane exit $lane_a_status, other lane exit $lane_b_status)" >&2
    exit 1
  fi
  run_lane "$preset" "$build" "$budget" "${tests[@]}" "${extra[@]}" || exit 1
done
echo "sanitizers: clean"
