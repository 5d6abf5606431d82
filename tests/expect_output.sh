#!/usr/bin/env bash
# Runs a program and passes only when it exits 0 AND its output (stdout and
# stderr together) matches an extended regular expression. ctest's
# PASS_REGULAR_EXPRESSION alone ignores the exit status, so a program that
# printed its success line and then crashed (a sanitizer abort at exit, a
# failing destructor, exit 77) would pass; this wrapper closes that gap.
#   tests/expect_output.sh <ERE> <program> [args...]
# The ERE is matched against the whole output as one string (bash =~): '.'
# also matches a newline, so "A.*B" means B somewhere after A.
set -uo pipefail
if (( $# < 2 )); then
  echo "usage: expect_output.sh <ERE> <program> [args...]" >&2
  exit 2
fi
pattern="$1"
shift
out="$("$@" 2>&1)"
rc=$?
printf '%s\n' "$out"
if (( rc != 0 )); then
  echo "expect_output: $1 exited $rc (want 0)" >&2
  exit 1
fi
if [[ ! $out =~ $pattern ]]; then
  echo "expect_output: the output of $1 lacks /$pattern/" >&2
  exit 1
fi
exit 0
