# shellcheck shell=bash
# Sourced by the stepmesh_perf cluster scripts (perf_on_cluster.sh,
# rails_on_cluster.sh and the tests that run them): what they do alike.

# A fresh folder `work` and a list `pids` of background processes; at exit
# each one is killed, waited for, and the folder removed.
#   perf_cluster_work NAME
perf_cluster_work() {
  work="$(mktemp -d "/tmp/$1.XXXXXX")"
  pids=()
  trap perf_cluster_cleanup EXIT
}
perf_cluster_cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$work"
}

# After a `cluster.sh run` that printed OUT and exited RC: prints OUT, exits
# 77 when the cluster could not be made and 1 when the run failed (WHEN says
# under what), else sets `row` to the worker's first stepmesh latency row.
#   perf_cluster_row RC WHEN OUT
perf_cluster_row() {
  printf '%s\n' "$3"
  (($1 == 77)) && exit 77
  (($1 == 0)) || { echo "FAIL: exited $1 $2"; exit 1; }
  row="$(grep -E '^ stepmesh +[0-9]+ ' <<<"$3" | head -1)"
  [[ -n "$row" ]] || { echo "FAIL: no stepmesh latency row"; exit 1; }
}
