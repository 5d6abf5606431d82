#!/usr/bin/env bash
# ctest planner_autoscale_out: stepmesh_plan --autoscale-out writes the
# autoscale file (src/tools/planner/autoscale.h) that --watch and afd_launch
# --autoscale read; the file is a plan too (the report, the workload
# overrides); bad options and a broken file are refused by name.
#   autoscale_out.sh STEPMESH_PLAN CONFIG_DIR WORK_DIR
set -euo pipefail
plan_bin=$1 configs=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
fail() { echo "FAIL: $*" >&2; exit 1; }

"$plan_bin" "$configs/step3_h800.json" --autoscale-attention 1:24 --autoscale-ffn 2:2 \
  --autoscale-batch-policy global --autoscale-tpot-ms 52 --autoscale-gain 7.5 \
  --autoscale-confirmations 4 --autoscale-out "$work/as.json" > "$work/out.txt"
grep -q "^autoscale plan written to $work/as.json" "$work/out.txt" || fail "no 'written' line"
python3 - "$work/as.json" <<'PY' || exit 1
import json, sys
d = json.load(open(sys.argv[1]))
a = d["autoscale"]
want = {"attention": [1, 24], "ffn": [2, 2], "max_instances": 0, "batch_policy": "global",
        "tpot_ms": 52, "min_gain_percent": 7.5, "confirmations": 4}
if a != want: sys.exit(f"FAIL: autoscale block {a} != {want}")
c = d["plan"]["coefficients"]
if c["ffn"] != {"alpha_us_per_row": 0.1, "beta_us": 290}: sys.exit(f"FAIL: coefficients {c}")
if d["plan"]["workload"]["ffn_instances"] != 2: sys.exit("FAIL: workload")
PY

# The file is a plan: the same report as its source, and the overrides go to its "plan".
"$plan_bin" "$configs/step3_h800.json" > "$work/src_report.txt"
"$plan_bin" "$work/as.json" > "$work/as_report.txt"
diff <(grep -v '^plan: ' "$work/src_report.txt") <(grep -v '^plan: ' "$work/as_report.txt") ||
  fail "the autoscale file's report differs from its plan's"
"$plan_bin" "$work/as.json" --mu-p 7680 --batch 512 | grep -q 'r\* = 2.654, attention-bound' ||
  fail "--mu-p/--batch did not reach the autoscale file's plan"
# Flags override the file's settings, and a new file carries them.
"$plan_bin" "$work/as.json" --autoscale-confirmations 2 --autoscale-out "$work/as2.json" > /dev/null
grep -q '"confirmations": 2' "$work/as2.json" || fail "--autoscale-confirmations not applied"
grep -q '"min_gain_percent": 7.5' "$work/as2.json" || fail "the file's gain was lost"

expect_error() {  # expect_error RC TEXT ARGS...
  local want=$1 text=$2 rc=0
  shift 2
  "$plan_bin" "$@" > /dev/null 2> "$work/err.txt" || rc=$?
  [[ $rc -eq $want ]] || fail "exit $rc (not $want) for: $*"
  grep -qF -- "$text" "$work/err.txt" || { cat "$work/err.txt" >&2; fail "no '$text' for: $*"; }
}
expect_error 2 "--autoscale-attention 5:2: need LO:HI" "$work/as.json" --autoscale-attention 5:2 \
  --autoscale-out "$work/x.json"
expect_error 2 "--autoscale-* options need --autoscale-out or --watch" "$work/as.json" \
  --autoscale-gain 3
expect_error 2 "--watch-* and --current options need --watch" "$work/as.json" --watch-count 3
expect_error 1 "autoscale.max_instances = 2: must be 0 (no budget) or at least the smallest shape" \
  "$work/as.json" --autoscale-max-instances 2 --autoscale-out "$work/x.json"
expect_error 1 "--autoscale-batch-policy fixed: must be per_instance or global" \
  "$configs/step3_h800.json" --autoscale-batch-policy fixed --autoscale-out "$work/x.json"
[[ ! -e $work/x.json ]] || fail "a refused plan was written"
sed 's/"confirmations": 4/"confirmation": 4/' "$work/as.json" > "$work/bad.json"
expect_error 1 "$work/bad.json: unknown key(s): autoscale.confirmation" "$work/bad.json"
sed 's/"batch": 1024/"batch": 0/' "$work/as.json" > "$work/bad2.json"
expect_error 1 "$work/bad2.json: plan: workload.batch = 0 is outside [1, 16777216]" \
  "$work/bad2.json" --autoscale-out "$work/x.json"
echo "planner_autoscale_out: PASS"
