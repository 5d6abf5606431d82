#!/usr/bin/env bash
# afd_launch --chrome-trace, 1A1F: the file is one Chrome trace merged from
# the attention process's and the FFN process's stepmesh exports and the
# launcher's compute spans (docs/tracing.md), parsed back with Python's json:
# both participants named with their clock data, every request on both ends,
# push -> arrival -> reply in order within the clocks' stated uncertainty.
#   chrome_trace_test.sh AFD_LAUNCH
set -euo pipefail
launch="$1"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$launch" --attention 1 --ffn 1 --requests 2 --micro-batches 2 --prompt-len 8 --decode-steps 2 \
  --transport tcp --no-reference --deadline-s 120 --work-dir "$work/run" \
  --chrome-trace "$work/trace.json" > "$work/out.txt" 2>&1 || { cat "$work/out.txt"; exit 1; }
grep -q "chrome trace: $work/trace.json" "$work/out.txt"
/usr/bin/python3 - "$work/trace.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
parts = {p["participant"]: p for p in d["otherData"]["participants"]}
assert sorted(parts) == ["server 0", "worker 0"], parts
for p in parts.values():
    assert p["exported"] > 0 and p["dropped"] == 0, p
ev = d["traceEvents"]
names = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
assert sorted(names.values()) == ["server 0", "worker 0"], names
pid = {v: k for k, v in names.items()}
xs = [e for e in ev if e["ph"] == "X"]
for e in xs:
    assert e["pid"] in names and isinstance(e["tid"], int), e
    assert e["ts"] > 0 and e["dur"] >= 0, e
def spans(p, prefix, peer):
    return {e["args"]["request"]: e for e in xs
            if e["pid"] == p and e["name"].startswith(prefix) and e["args"].get(peer) == 0}
trips = spans(pid["worker 0"], "round trip", "server")
arrive = spans(pid["server 0"], "dispatch", "worker")
reply = spans(pid["server 0"], "respond", "worker")
assert trips and set(trips) == set(arrive) == set(reply), (len(trips), len(arrive), len(reply))
slack = (parts["worker 0"]["clock_uncertainty_ns"] + parts["server 0"]["clock_uncertainty_ns"]) / 1e3 + 1e-3
for rid, t in trips.items():
    assert t["ts"] <= arrive[rid]["ts"] + slack, (t, arrive[rid])
    assert reply[rid]["ts"] + reply[rid]["dur"] <= t["ts"] + t["dur"] + slack, (t, reply[rid])
# The application's spans (what stepmesh_plan --calibrate-trace fits) are there too.
assert any(e["name"].startswith("attention ") and e["pid"] == pid["worker 0"] for e in xs)
assert any(e["name"].startswith("FFN ") and e["pid"] == pid["server 0"] for e in xs)
print(f"chrome trace: {len(xs)} events, {len(trips)} requests on both ends, in order")
PY
