#!/usr/bin/env bash
# The example (afd_launch) across emulated hosts (scripts/cluster.sh), one
# host per attention/FFN instance, with a network fault injected mid-decode.
#   afd_on_cluster.sh CASE AFD_LAUNCH [LINK FLAGS for cluster.sh]
# CASE:
#   gate       2A2F on 4 hosts: the reference check passes (every token and
#              logit bitwise equal to the monolithic reference).
#   partition  2A2F; FFN 1's host loses its link for 2 s mid-decode, then gets
#              it back. docs/reliability.md: a silence shorter than `timeout`
#              is held, not a loss (TCP retransmits). So the decode must stall
#              while the link is down and then finish with the reference check
#              passing.
#   blackhole  2A2F; attention 1's host is black-holed mid-decode (the switch
#              drops its packets: no RST, no ICMP). docs/reliability.md: lost
#              after `timeout` + at most one heartbeat. So the scheduler must
#              report worker 1 lost within timeout + heartbeat (+ slack), the
#              FFN servers then batch without it, attention 1 must fail (it
#              hears nobody: its own deadline), and attention 0 must keep
#              decoding to the end with its results passing Gate A.
# Exit 77 only when cluster.sh cannot create namespaces here.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cluster="$here/../../scripts/cluster.sh"
case_name="$1"
launch="$2"
shift 2
link_flags=("$@")

if [[ -z "${CLUSTER_PREFIX:-}" ]]; then
  exec bash "$cluster" run --hosts 4 "${link_flags[@]}" -- "$0" "$case_name" "$launch"
fi

fail() { echo "FAIL: $*"; exit 1; }
work="$(mktemp -d /tmp/afd_cluster.XXXXXX)"
trap 'rm -rf "$work"' EXIT
common=(--attention 2 --ffn 2 --requests 3 --prompt-len 32 --micro-batches 3
        --hosts "$CLUSTER_HOSTS" --host-addrs "$CLUSTER_ADDRS" --work-dir "$work/run"
        --progress-s 0)

progress() { cat "$work/run/attention-$1.progress" 2>/dev/null || echo "-1 -1"; }
# Waits (bounded) until attention $1 reached decode step $2.
wait_step() {
  for _ in $(seq 600); do
    read -r step _ < <(progress "$1")
    ((step >= $2)) && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.05
  done
  return 1
}

case "$case_name" in
  gate)
    out="$("$launch" "${common[@]}" --decode-steps 16 --timeout-ms 30000 --deadline-s 240 2>&1)"
    rc=$?
    printf '%s\n' "$out" | tail -6
    ((rc == 0)) || fail "afd_launch exited $rc"
    [[ "$out" == *"reference check: PASS"* ]] || fail "no reference check PASS"
    ;;
  partition)
    "$launch" "${common[@]}" --decode-steps 100 --timeout-ms 10000 --deadline-s 240 \
      >"$work/out" 2>&1 &
    pid=$!
    wait_step 0 3 || { cat "$work/out"; fail "decode never reached step 3"; }
    bash "$cluster" fault --prefix "$CLUSTER_PREFIX" --host 3 down
    t0=$(date +%s.%N)
    sleep 0.5
    before="$(progress 0)"
    sleep 1.5
    during="$(progress 0)"
    bash "$cluster" fault --prefix "$CLUSTER_PREFIX" --host 3 up
    echo "partition: attention 0 at '$before' 0.5 s into the partition, '$during' at 2 s"
    wait "$pid"
    rc=$?
    t1=$(date +%s.%N)
    tail -6 "$work/out"
    [[ "$before" == "$during" ]] || fail "the decode moved while FFN 1's host was cut off"
    # The cut must have hit a running decode (the last step is 100: prefill + 100).
    read -r during_step _ <<<"$during"
    ((during_step < 100)) || fail "the decode had finished before the link came back"
    ((rc == 0)) || fail "afd_launch exited $rc after a 2 s partition (timeout 10 s: must be held)"
    grep -q "reference check: PASS" "$work/out" || fail "no reference check PASS"
    awk -v a="$t0" -v b="$t1" 'BEGIN{printf "partition: run finished %.1f s after the link went down\n", b - a}'
    ;;
  blackhole)
    timeout_ms=3000 heartbeat_ms=1000
    STEPMESH_HEARTBEAT_INTERVAL=${heartbeat_ms}ms "$launch" "${common[@]}" --decode-steps 150 \
      --timeout-ms "$timeout_ms" --deadline-s 240 --lost-attention 1 >"$work/out" 2>&1 &
    pid=$!
    wait_step 1 3 || { cat "$work/out"; fail "decode never reached step 3"; }
    bash "$cluster" fault --prefix "$CLUSTER_PREFIX" --host 1 blackhole
    t0=$(date +%s%N)
    at_cut="$(progress 0)"
    # attention 1 notices by its own deadline; the others through the
    # scheduler's heartbeat. Wait for the FFN servers' verdict.
    lost_ms=""
    for _ in $(seq 400); do
      if grep -qs "worker 1 lost" "$work"/run/ffn-*.err "$work/out"; then
        lost_ms=$((($(date +%s%N) - t0) / 1000000))
        break
      fi
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.025
    done
    after_loss="$(progress 0)"
    wait "$pid"
    rc=$?
    tail -8 "$work/out"
    grep -h "lost" "$work"/run/ffn-*.err "$work"/run/attention-*.err | head -4
    [[ -n "$lost_ms" ]] || fail "nobody reported worker 1 lost"
    limit=$((timeout_ms + heartbeat_ms + 1500))  # + slack for a loaded machine
    echo "blackhole: worker 1 reported lost ${lost_ms} ms after the cut (timeout ${timeout_ms} + heartbeat ${heartbeat_ms} ms)"
    ((lost_ms <= limit)) || fail "detection took ${lost_ms} ms, over ${limit} ms"
    echo "blackhole: attention 0 at '$at_cut' when cut, '$after_loss' at the loss, then to the end"
    [[ "$at_cut" != "$(progress 0)" ]] || fail "attention 0 stopped decoding"
    ((rc == 0)) || fail "afd_launch exited $rc (attention 0 must finish, attention 1 must be lost)"
    grep -q "attention 1 was lost as expected" "$work/out" || fail "attention 1 not reported lost"
    grep -q "reference check: PASS" "$work/out" || fail "no reference check PASS"
    ;;
  *) fail "unknown case $case_name" ;;
esac
echo "PASS: $case_name"
