#!/usr/bin/env bash
# stepmesh_perf 1A1F across two emulated hosts (scripts/cluster.sh): the
# scheduler and server 0 on host 0, worker 0 (where the latency is measured)
# on host 1. Run inside `cluster.sh run` (it reads CLUSTER_HOSTS and
# CLUSTER_ADDRS):
#   cluster.sh run --hosts 2 [link flags] -- perf_on_cluster.sh STEPMESH_PERF [perf flags]
# Every process gets the same plan flags; the worker's table is printed.
# Payload checksums are on (STEPMESH_PAYLOAD_CHECKSUM=1): a byte changed on
# the way fails the run with DATA_LOSS instead of passing unnoticed.
set -uo pipefail
perf="$1"
shift
# shellcheck source=perf_cluster_lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/perf_cluster_lib.sh"
[[ -n "${CLUSTER_HOSTS:-}" ]] || { echo "perf_on_cluster.sh: run it inside cluster.sh run" >&2; exit 2; }
IFS=, read -ra ns <<<"$CLUSTER_HOSTS"
IFS=, read -ra ip <<<"$CLUSTER_ADDRS"
((${#ns[@]} >= 2)) || { echo "perf_on_cluster.sh: needs 2 hosts" >&2; exit 2; }
export STEPMESH_PAYLOAD_CHECKSUM=1 STEPMESH_AUTH=off
sched="${ip[0]}:29000"
perf_cluster_work perf_cluster
common=(--pattern 1A1F --scheduler "$sched" --deadline-s 240 "$@")
ip netns exec "${ns[0]}" timeout 300 "$perf" --role scheduler "${common[@]}" >"$work/sched" 2>&1 &
pids+=($!)
sleep 0.3
ip netns exec "${ns[0]}" timeout 300 "$perf" --role server --rank 0 --host "${ip[0]}" \
  "${common[@]}" >"$work/server" 2>&1 &
pids+=($!)
ip netns exec "${ns[1]}" timeout 300 "$perf" --role worker --rank 0 --host "${ip[1]}" \
  --server-hosts "${ip[0]}" "${common[@]}" 2>&1 | grep -v '^\[stepmesh W'
rc=${PIPESTATUS[0]}
if ((rc != 0)); then
  echo "perf_on_cluster.sh: the worker exited $rc; server and scheduler logs:"
  tail -5 "$work/server" "$work/sched"
fi
exit "$rc"
