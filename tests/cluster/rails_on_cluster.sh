#!/usr/bin/env bash
# stepmesh_perf 1A1F across two emulated hosts with two rails each
# (scripts/cluster.sh --rails 2), the TCP transport on both rails
# (STEPMESH_TCP_RAILS), payload checksums on (RAILS_CHECKSUM=0 in the
# environment: off, as benchmarks/tcp_rails_bench.sh runs it against its
# checksum-free floor). Run inside `cluster.sh run`:
#   cluster.sh run --hosts 2 --rails 2 [link flags] -- rails_on_cluster.sh MODE STEPMESH_PERF [perf flags]
# MODE
#   fault   the worker host's rail-1 link (the rail the data is advertised on
#           first) goes down 2 s into the run and stays down: the run must
#           finish, and the worker's log must show the failover.
#   rails   both rails, no fault (the worker's table is printed).
#   single  one rail only (STEPMESH_TCP_RAILS unset; data on rail 1).
#   single-fault  the fault of `fault` without rails: the single connection
#           of the code before rails (the run fails: the server is lost).
# The data rides rail 1 first (--host and rail 0 of STEPMESH_TCP_RAILS are the
# 10.232.1.x addresses); the scheduler's control connections ride rail 0, so
# a rail-1 fault touches the data path only. Without rails (the code before
# them) the same fault loses the server: the run fails.
set -uo pipefail
mode="$1"
perf="$2"
shift 2
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=perf_cluster_lib.sh
source "$here/perf_cluster_lib.sh"
[[ -n "${CLUSTER_HOSTS:-}" && -n "${CLUSTER_ADDRS1:-}" ]] ||
  { echo "rails_on_cluster.sh: run it inside cluster.sh run --rails 2" >&2; exit 2; }
IFS=, read -ra ns <<<"$CLUSTER_HOSTS"
IFS=, read -ra ip0 <<<"$CLUSTER_ADDRS"
IFS=, read -ra ip1 <<<"$CLUSTER_ADDRS1"
export STEPMESH_PAYLOAD_CHECKSUM="${RAILS_CHECKSUM:-1}" STEPMESH_AUTH=off
unset STEPMESH_TCP_RAILS
sched="${ip0[0]}:29000"
perf_cluster_work rails_cluster
rails_of() {  # host index
  [[ "$mode" == single* ]] && return
  echo "STEPMESH_TCP_RAILS=${ip1[$1]},${ip0[$1]}"
}
common=(--pattern 1A1F --transport tcp --scheduler "$sched" --deadline-s 240 "$@")
ip netns exec "${ns[0]}" timeout 300 "$perf" --role scheduler "${common[@]}" >"$work/sched" 2>&1 &
pids+=($!)
sleep 0.3
ip netns exec "${ns[0]}" env $(rails_of 0) timeout 300 "$perf" --role server --rank 0 \
  --host "${ip1[0]}" "${common[@]}" >"$work/server" 2>&1 &
pids+=($!)
if [[ "$mode" == *fault ]]; then
  (sleep 2 && bash "$here/../../scripts/cluster.sh" fault --prefix "$CLUSTER_PREFIX" --host 1 \
    --rail 1 down && echo "rails_on_cluster.sh: host 1 rail 1 down at $(date +%T.%N)") &
  pids+=($!)
fi
ip netns exec "${ns[1]}" env $(rails_of 1) timeout 300 "$perf" --role worker --rank 0 \
  --host "${ip1[1]}" --server-hosts "${ip1[0]}" "${common[@]}" >"$work/worker" 2>&1
rc=$?
grep -v '^\[stepmesh [IW]' "$work/worker"
grep -h 'tcp: rail' "$work/worker" "$work/server" || true
if ((rc != 0)); then
  echo "rails_on_cluster.sh: the worker exited $rc; its last lines, server and scheduler logs:"
  tail -n 5 "$work/worker" "$work/server" "$work/sched"
  exit "$rc"
fi
if [[ "$mode" == fault ]] && ! grep -q "tcp: rail 0 to server 0 .* is down" "$work/worker"; then
  echo "rails_on_cluster.sh: the worker finished without its rail to the server going down" \
    "(the fault came too late?)"
  exit 1
fi
exit 0
