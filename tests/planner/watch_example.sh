#!/usr/bin/env bash
# ctest planner_watch_example: stepmesh_plan --watch against a real run of the
# AFD example (docs/planning.md, "--watch and autoscale"). afd_launch runs 1A1F
# with --metrics-port; its attention instance serves the afd_workload_* series
# next to its stepmesh counters, and the context of every request grows by one
# token per decode step (8 -> 808). The watch scrapes both processes every
# 100 ms with watch_example.json, whose coefficients make the best ratio grow
# with the context. Checks: the observed context grows, the best x never
# shrinks as it does, the watch prints recommendation lines that raise x
# (1A1F -> 2A1F -> ...), and the run still passes its reference check. Then
# the error paths: a closed port, a non-loopback host, an unbounded watch.
#   watch_example.sh STEPMESH_PLAN AFD_LAUNCH WATCH_PLAN WORK_DIR
set -euo pipefail
plan_bin=$1 launch=$2 plan=$3 work=$4
rm -rf "$work"
mkdir -p "$work"

# Two consecutive free loopback ports (attention on P, FFN on P + 1).
port=$(python3 - <<'PY'
import socket
for _ in range(50):
    a = socket.socket(); a.bind(("127.0.0.1", 0)); p = a.getsockname()[1]
    b = socket.socket()
    try:
        b.bind(("127.0.0.1", p + 1)); print(p); break
    except OSError:
        pass
    finally:
        a.close(); b.close()
PY
)
[[ -n $port ]] || { echo "FAIL: no two free ports" >&2; exit 1; }
urls="http://127.0.0.1:$port/metrics,http://127.0.0.1:$((port + 1))/metrics"

launch_pid=
cleanup() {
  if [[ -n $launch_pid ]] && kill -0 "$launch_pid" 2>/dev/null; then
    kill "$launch_pid" 2>/dev/null || true  # the launcher stops its children
    wait "$launch_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT

"$launch" --attention 1 --ffn 1 --requests 6 --prompt-len 8 --decode-steps 800 --progress-s 0 \
  --metrics-port "$port" --deadline-s 240 > "$work/launch.log" 2>&1 &
launch_pid=$!

# Bounded: 90 s at most; it ends at the first failed scrape after the run is gone.
rc=0
"$plan_bin" "$plan" --watch "$urls" --watch-interval-ms 100 --watch-seconds 90 \
  --watch-until-gone > "$work/watch.log" 2> "$work/watch.err" || rc=$?
launch_rc=0
wait "$launch_pid" || launch_rc=$?
launch_pid=
cat "$work/watch.log"
if [[ $rc -ne 0 ]]; then
  echo "FAIL: stepmesh_plan --watch exited $rc" >&2
  cat "$work/watch.err" >&2
  exit 1
fi
if [[ $launch_rc -ne 0 ]] || ! grep -q '^reference check: PASS' "$work/launch.log"; then
  echo "FAIL: the example run (exit $launch_rc) did not pass its reference check" >&2
  tail -20 "$work/launch.log" >&2
  exit 1
fi

python3 - "$work/watch.log" <<'PY'
import re, sys
obs, recs = [], []
for line in open(sys.argv[1]):
    m = re.match(r"watch \d+ t=\S+: mesh (\d+)A(\d+)F context ([\d.]+) batch ([\d.]+) .* best (\d+)A(\d+)F ", line)
    if m:
        obs.append((int(m[1]), int(m[2]), float(m[3]), float(m[4]), int(m[5]), int(m[6])))
    m = re.match(r"watch \d+: recommend (\d+)A(\d+)F \(was (\d+)A(\d+)F\): ", line)
    if m:
        recs.append(tuple(int(g) for g in m.groups()))
def fail(why):
    print("FAIL:", why, file=sys.stderr); sys.exit(1)
if len(obs) < 5: fail(f"only {len(obs)} observations")
if any(o[:2] != (1, 1) or o[3] != 2.0 for o in obs): fail("the mesh is 1A1F with 2 slots per micro-batch")
ctx = [o[2] for o in obs]
if any(b < a for a, b in zip(ctx, ctx[1:])): fail(f"context went down: {ctx}")
if ctx[0] >= 140: fail(f"the first observation came late (context {ctx[0]}): no 1A1F phase seen")
if ctx[-1] < 400: fail(f"the last observation saw context {ctx[-1]} only")
best = [o[4] for o in obs]
if any(b < a for a, b in zip(best, best[1:])): fail(f"best x shrank as the context grew: {best}")
if best[0] != 1: fail(f"at context {ctx[0]} the best is {best[0]}A1F, not 1A1F")
if len(recs) < 2: fail(f"{len(recs)} recommendation line(s), expected the ratio to change at least twice")
if recs[0][2:] != (1, 1): fail(f"the first recommendation does not start from 1A1F: {recs[0]}")
for (a, _, was, _) in recs:
    if a <= was: fail(f"a recommendation did not raise x: {a} from {was}")
for prev, cur in zip(recs, recs[1:]):
    if cur[2] != prev[0]: fail(f"recommendations do not chain: {prev} then {cur}")
print(f"ok: {len(obs)} observations, context {ctx[0]:.0f} -> {ctx[-1]:.0f}, "
      f"recommendations {' -> '.join(f'{r[0]}A{r[1]}F' for r in recs)}")
PY

# A closed port: the error names the URL; no observation is an error.
rc=0
"$plan_bin" "$plan" --watch "http://127.0.0.1:$port/metrics" --watch-count 2 \
  --watch-interval-ms 50 > "$work/closed.log" 2> "$work/closed.err" || rc=$?
[[ $rc -eq 1 ]] || { echo "FAIL: a closed port gave exit $rc" >&2; exit 1; }
grep -q "http://127.0.0.1:$port/metrics: connect: Connection refused" "$work/closed.err" ||
  { echo "FAIL: the error does not name the URL" >&2; cat "$work/closed.err" >&2; exit 1; }
rc=0
"$plan_bin" "$plan" --watch "http://10.1.2.3:$port/metrics" --watch-count 1 \
  > /dev/null 2> "$work/host.err" || rc=$?
[[ $rc -eq 1 ]] && grep -q "10.1.2.3:$port/metrics: the host must be a loopback address" \
  "$work/host.err" || { echo "FAIL: a non-loopback host was not refused" >&2; exit 1; }
rc=0
"$plan_bin" "$plan" --watch "http://127.0.0.1:$port/metrics" > /dev/null 2> "$work/unbounded.err" ||
  rc=$?
[[ $rc -eq 2 ]] && grep -q -- "--watch needs --watch-count N or --watch-seconds S" \
  "$work/unbounded.err" || { echo "FAIL: an unbounded watch was not refused" >&2; exit 1; }
echo "planner_watch_example: PASS"
