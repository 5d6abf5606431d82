#!/usr/bin/env bash
# StepMesh's benchmark shape through `import fserver_lib`, launched as
# StepMesh's run scripts launch it (a scheduler, the servers and the workers
# as separate processes on 127.0.0.1, DMLC_ENABLE_RDMA=zmq, DMLC_INTERFACE=auto):
# python/tests/programs/stepmesh_shaped/bmk_comm_latency.py prints a
# 500-iteration window (overall mean/p50/p99/max, then per handle the stages).
#   benchmarks/fserver_bmk.sh [WORKERS [SERVERS]]
# BMK_TOKENS, BMK_DIM (default 1024 x 7168 bfloat16) and BMK_ITERS (500) size
# it; PORT (default 18123) is the scheduler's. Every process started here is
# killed by PID on exit.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
program="$root/python/tests/programs/stepmesh_shaped/bmk_comm_latency.py"
python="${PYTHON:-/usr/bin/python3}"
export PYTHONPATH="${PYTHONPATH:-$root/build/python}"
export DMLC_NUM_WORKER="${1:-1}" DMLC_NUM_SERVER="${2:-1}"
export DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT="${PORT:-18123}"
export DMLC_ENABLE_RDMA=zmq DMLC_INTERFACE=auto DMLC_NODE_HOST=127.0.0.1
export STEPMESH_AUTH="${STEPMESH_AUTH:-off}" STEPMESH_TIMEOUT="${STEPMESH_TIMEOUT:-60s}"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
DMLC_ROLE=scheduler "$python" "$program" &
pids+=($!)
for ((r = 0; r < DMLC_NUM_SERVER; r++)); do
  DMLC_ROLE=server DMLC_NODE_RANK=$r "$python" "$program" &
  pids+=($!)
done
for ((r = 0; r < DMLC_NUM_WORKER; r++)); do
  DMLC_ROLE=worker DMLC_NODE_RANK=$r "$python" "$program" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
pids=()
exit $rc
