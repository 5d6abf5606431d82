#!/usr/bin/env bash
# A mesh configured the StepMesh way, by DMLC_* variables only: one scheduler,
# SERVERS servers and WORKERS workers, each a process of PROGRAM started with
# DMLC_ROLE / DMLC_NUM_WORKER / DMLC_NUM_SERVER / DMLC_PS_ROOT_URI /
# DMLC_PS_ROOT_PORT and no mesh flag (ARGS are the program's own plan flags).
# Passes when every process exits 0 and, for each role, some process of it
# printed a line matching the extended regular expression given for the role
# ("{port}" stands for the scheduler's port): a program that ignored DMLC_* and ran a mesh of its own
# would exit 0 too, but not print that. An empty pattern checks nothing.
#   dmlc_only_mesh.sh WORKERS SERVERS SCHEDULER_RE SERVER_RE WORKER_RE PROGRAM [ARGS...]
set -uo pipefail

workers="$1"
servers="$2"
declare -A expect=([scheduler]="$3" [server]="$4" [worker]="$5")
program="$6"
shift 6
log_dir="$(mktemp -d)"
pids=()
cleanup() {
  # Only the processes this script started, by PID.
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
  rm -rf "$log_dir"
}
trap cleanup EXIT

# Whatever the caller's shell exported, only DMLC_* describe this mesh.
while IFS='=' read -r name _; do
  case "$name" in STEPMESH_*|DMLC_*) unset "$name" ;; esac
done < <(env)


# Ports below the kernel's ephemeral range, which outgoing connections and
# port-0 listeners of every other test draw from.
read -r ephemeral_low _ < /proc/sys/net/ipv4/ip_local_port_range || ephemeral_low=32768
span=$(( ephemeral_low - 10000 ))
for attempt in 1 2 3; do
  # A port of our own: 10000 up to the ephemeral range, from the PID and the attempt.
  port=$(( 10000 + ($$ * 7919 + attempt * 104729) % span ))
  export DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT="$port"
  export DMLC_NUM_WORKER="$workers" DMLC_NUM_SERVER="$servers"
  pids=()
  names=()
  DMLC_ROLE=scheduler timeout 60 "$program" "$@" > "$log_dir/scheduler.log" 2>&1 &
  pids+=($!); names+=(scheduler)
  for ((s = 0; s < servers; ++s)); do
    DMLC_ROLE=server timeout 60 "$program" "$@" > "$log_dir/server$s.log" 2>&1 &
    pids+=($!); names+=("server$s")
  done
  for ((w = 0; w < workers; ++w)); do
    DMLC_ROLE=worker timeout 60 "$program" "$@" > "$log_dir/worker$w.log" 2>&1 &
    pids+=($!); names+=("worker$w")
  done
  failed=0
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    rc=$?
    if (( rc != 0 )); then
      echo "${names[$i]} exited $rc" >&2
      failed=1
    fi
  done
  pids=()
  for role in scheduler server worker; do
    pattern="${expect[$role]//\{port\}/$port}"
    if (( failed == 0 )) && [[ -n "$pattern" ]] &&
       ! grep -Eqh -- "$pattern" "$log_dir/$role"*.log; then
      echo "no $role printed a line matching '$pattern'" >&2
      failed=2
    fi
  done
  if (( failed == 0 )); then
    for f in "$log_dir"/*.log; do echo "== $(basename "$f" .log)"; cat "$f"; done
    echo "dmlc-only mesh of $(basename "$program"): ${workers} worker(s), ${servers} server(s): OK"
    exit 0
  fi
  if grep -q "Address already in use" "$log_dir/scheduler.log"; then
    echo "port $port in use; trying another" >&2
    continue
  fi
  break
done
for f in "$log_dir"/*.log; do echo "== $(basename "$f" .log)" >&2; cat "$f" >&2; done
exit 1
