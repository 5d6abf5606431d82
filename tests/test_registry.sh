#!/usr/bin/env bash
# Compares the ctest names of a build with the committed list of its
# configuration (tests/test_registry.cmake). Prints every missing and every
# unexpected name and how to regenerate the list.
#   tests/test_registry.sh <build dir> <expected list> <config>
#   tests/test_registry.sh --list <build dir>   (print the names, sorted)
set -uo pipefail

# The names, sorted, without this check itself. ctest -N runs in a scratch
# directory that includes the build as a subdirectory: a plain
# `ctest --test-dir <build> -N` would rewrite the build's
# Testing/Temporary/LastTest.log while the ctest running this check writes it.
list_names() {
  local build scratch
  build="$(cd "$1" && pwd)"
  scratch="$(mktemp -d "${TMPDIR:-/tmp}/stepmesh_registry.XXXXXX")"
  printf 'subdirs("%s")\n' "$build" > "$scratch/CTestTestfile.cmake"
  local out rc
  out="$(ctest --test-dir "$scratch" -N 2>&1)"
  rc=$?
  rm -rf "$scratch"
  if (( rc != 0 )); then
    printf '%s\n' "$out" >&2
    echo "test_registry: ctest -N failed (exit $rc)" >&2
    return 1
  fi
  # A PRE_TEST discovery that failed (an executable that does not run) leaves
  # its tests out; say so instead of listing them as missing only.
  local noise
  noise="$(grep -v '^ *Test *#' <<<"$out" | grep -iE 'error|fail' | head -5)"
  [[ -z $noise ]] || printf '%s\n' "$noise" >&2
  sed -n 's/^ *Test *#[0-9]*: //p' <<<"$out" | grep -vx 'test_registry' | LC_ALL=C sort
}

if [[ ${1:-} == --list ]]; then
  list_names "$2"
  exit $?
fi
if (( $# != 3 )); then
  echo "usage: test_registry.sh <build dir> <expected list> <config> | --list <build dir>" >&2
  exit 2
fi
build="$1" expected="$2" config="$3"
root="$(cd "$(dirname "$0")/.." && pwd)"
regenerate="scripts/update-expected-tests.sh $(realpath --relative-to="$root" "$build" 2>/dev/null || echo "$build")"
if [[ ! -f $expected ]]; then
  echo "test_registry: no expected list for configuration '$config' ($expected)."
  echo "Generate it with: $regenerate   and commit tests/expected_tests/$config.txt"
  exit 1
fi
actual="$(list_names "$build")" || exit 1
want="$(LC_ALL=C sort "$expected")"
missing="$(LC_ALL=C comm -23 <(printf '%s\n' "$want") <(printf '%s\n' "$actual") | sed '/^$/d')"
unexpected="$(LC_ALL=C comm -13 <(printf '%s\n' "$want") <(printf '%s\n' "$actual") | sed '/^$/d')"
n_actual=$(printf '%s\n' "$actual" | sed '/^$/d' | wc -l)
n_want=$(printf '%s\n' "$want" | sed '/^$/d' | wc -l)
if [[ -z $missing && -z $unexpected ]]; then
  echo "test_registry: $n_actual tests, as listed for configuration '$config'"
  exit 0
fi
echo "test_registry: configuration '$config': $n_actual tests registered, $n_want listed in $expected"
if [[ -n $missing ]]; then
  echo "MISSING (listed, not registered: a test vanished):"
  printf '%s\n' "$missing" | sed 's/^/  /'
fi
if [[ -n $unexpected ]]; then
  echo "UNEXPECTED (registered, not listed):"
  printf '%s\n' "$unexpected" | sed 's/^/  /'
fi
echo "If the change is intended, regenerate the list from a full build and commit it:"
echo "  $regenerate && git add tests/expected_tests/$config.txt"
echo "(both configurations: docs/testing.md, \"The test registry\")"
exit 1
