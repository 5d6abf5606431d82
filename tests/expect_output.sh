#!/usr/bin/env bash
# Runs a program and passes only when its exit status is the one wanted AND its
# output (stdout and stderr together) matches an extended regular expression.
# ctest's PASS_REGULAR_EXPRESSION alone ignores the exit status, so a program
# that printed its success line and then crashed (a sanitizer abort at exit, a
# failing destructor, exit 77) would pass; this wrapper closes that gap.
#   tests/expect_output.sh [--fail] <ERE> <program> [args...]
# Without --fail the program must exit 0. With --fail it must FAIL: exit
# non-zero, not 77 (ctest's "skipped"), not by a signal -- for hardware
# programs that must not pass vacuously (a named-but-unusable device).
# The ERE is matched against the whole output as one string (bash =~): '.'
# also matches a newline, so "A.*B" means B somewhere after A.
set -uo pipefail
fail=0
if [[ ${1:-} == --fail ]]; then
  fail=1
  shift
fi
if (( $# < 2 )); then
  echo "usage: expect_output.sh [--fail] <ERE> <program> [args...]" >&2
  exit 2
fi
pattern="$1"
shift
out="$("$@" 2>&1)"
rc=$?
printf '%s\n' "$out"
if (( fail == 0 && rc != 0 )); then
  echo "expect_output: $1 exited $rc (want 0)" >&2
  exit 1
fi
if (( fail == 1 && (rc == 0 || rc == 77 || rc > 128) )); then
  echo "expect_output: $1 exited $rc (want a failure: non-zero, not 77, no signal)" >&2
  exit 1
fi
if [[ ! $out =~ $pattern ]]; then
  echo "expect_output: the output of $1 lacks /$pattern/" >&2
  exit 1
fi
exit 0
