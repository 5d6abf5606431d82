#!/usr/bin/env bash
# ctest afd_resize_emulated: --resize with --emulate-compute (the planner's
# timing model in the processes) runs the --resize machinery as it is
# (barriers, the stage per step, joiners started at S - 2): an attention and
# an FFN instance join, the report prints the exact resize lines and, per
# shape, the measured throughput per instance against planner::Predict.
#   resize_emulated_test.sh AFD_LAUNCH CONFIG_DIR WORK_DIR
set -euo pipefail
launch=$1 configs=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
fail() {
  echo "FAIL: $*" >&2
  [[ -f $work/out.txt ]] && tail -30 "$work/out.txt" >&2
  exit 1
}
rc=0
"$launch" --attention 2 --ffn 2 --requests 3 --prompt-len 8 --decode-steps 16 \
  --micro-batches 3 --poll-mode blocking --timeout-ms 20000 --deadline-s 100 \
  --emulate-compute "$configs/step3_emulated.json" --resize 6:3A2F --resize 11:3A3F \
  --work-dir "$work/run" --progress-s 0 > "$work/out.txt" 2>&1 || rc=$?
[[ $rc == 0 ]] || fail "afd_launch exited $rc"
grep -Eq '^resize at step 6: 2A2F -> 3A2F \(epoch [0-9]+, [0-9]+ ms\)$' "$work/out.txt" ||
  fail "no resize line for step 6"
grep -Eq '^resize at step 11: 3A2F -> 3A3F \(epoch [0-9]+, [0-9]+ ms\)$' "$work/out.txt" ||
  fail "no resize line for step 11"
for shape in 2A2F 3A2F 3A3F; do
  grep -Eq "^throughput at $shape, steps [0-9]+-[0-9]+ \(context [0-9]+ -> [0-9]+\): measured [0-9.e+]+ tokens/s per instance, predicted [0-9.e+]+ \(planner\), [+-][0-9.]+ %$" \
    "$work/out.txt" || fail "no comparison line for $shape"
done
grep -q '^afd_ffn\[2\]: steps 11-16 ' "$work/out.txt" || fail "FFN 2 did not serve steps 11-16"
grep -q '^afd_attention\[2\]: 3 requests, 11 steps done' "$work/out.txt" ||
  fail "attention 2 did not run steps 6-16"
grep -q '^reference check: PASS' "$work/out.txt" || fail "no PASS line"
grep -E '^(resize at|throughput at)' "$work/out.txt"
echo "resize emulated check: PASS"
