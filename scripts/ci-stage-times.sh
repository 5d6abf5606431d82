#!/usr/bin/env bash
# Measures what each stage of .ci/run costs, as CI pays it (a fresh clone: no
# ccache hits, so CCACHE_DISABLE=1, and no build directories), in CPU seconds
# (user + sys of the stage and all its children) and wall seconds. CPU seconds
# are what to compare on a shared machine; wall is only meaningful when the
# machine is otherwise idle. Removes build-asan, build-tsan, build-fuzz and
# build first (they are rebuilt by the stages).
#
#   scripts/ci-stage-times.sh [OUT]    table to OUT (default ci-stage-times.txt)
#
# A failing stage is reported with its exit status and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-ci-stage-times.txt}
export CCACHE_DISABLE=1
rm -rf build-asan build-tsan build-fuzz build
printf '%-26s %9s %9s %9s %4s\n' stage cpu_s wall_s user+sys rc > "$out"
stage() {
  local name=$1
  shift
  local t
  t=$(mktemp)
  /usr/bin/time -f '%U %S %e' -o "$t" "$@" > "ci-stage-$name.log" 2>&1
  local rc=$?
  read -r user sys wall < <(tail -1 "$t")
  rm -f "$t"
  awk -v n="$name" -v u="$user" -v s="$sys" -v w="$wall" -v rc="$rc" \
    'BEGIN { printf "%-26s %9.0f %9.0f %9s %4d\n", n, u + s, w, u "+" s, rc }' >> "$out"
}
stage sanitizers-asan scripts/run-sanitizers.sh asan
stage sanitizers-tsan scripts/run-sanitizers.sh tsan
stage fuzz-60 scripts/run-fuzz.sh 60
stage release-build-and-tests scripts/run-tests.sh
cat "$out"
