#!/usr/bin/env bash
# Runs a program that must FAIL: passes only when it exits non-zero, not 77
# (ctest's "skipped"), not by a signal, and its output (stdout and stderr
# together) matches an extended regular expression. For hardware programs
# that must not pass vacuously: a named-but-unusable device is a failure.
#   tests/expect_failure.sh <ERE> <program> [args...]
set -uo pipefail
if (( $# < 2 )); then
  echo "usage: expect_failure.sh <ERE> <program> [args...]" >&2
  exit 2
fi
pattern="$1"
shift
out="$("$@" 2>&1)"
rc=$?
printf '%s\n' "$out"
if (( rc == 0 || rc == 77 || rc > 128 )); then
  echo "expect_failure: $1 exited $rc (want a failure: non-zero, not 77, no signal)" >&2
  exit 1
fi
if [[ ! $out =~ $pattern ]]; then
  echo "expect_failure: the output of $1 lacks /$pattern/" >&2
  exit 1
fi
exit 0
