#!/usr/bin/env bash
# mesh_scale at one size, held to the scale targets of issue 32: rendezvous
# of the whole mesh <= 2 s, no participant above 64 MiB RSS, descriptors
# O(peers): a worker holds at most one data connection per server plus a
# fixed few (control connection, epoll, eventfds, stdio), a server one per
# worker plus the same few.
#   scale_test.sh MESH_SCALE WORKERS SERVERS
set -uo pipefail
bin="$1" x="$2" y="$3"
out="$("$bin" --workers "$x" --servers "$y" --rounds 50 --bytes 64 --deadline-s 100 2>&1)"
rc=$?
printf '%s\n' "$out"
((rc == 0)) || { echo "FAIL: mesh_scale exited $rc"; exit 1; }
row="$(grep -E '^\| [0-9]+ \|' <<<"$out")"
IFS='|' read -r _ n shape rdv create barrier p50 p99 rss wfds sfds _ <<<"$row"
fixed=16
fails=0
check() { if awk "BEGIN{exit !($1)}"; then echo "ok:   $2"; else echo "FAIL: $2"; fails=$((fails + 1)); fi; }
check "$rdv <= 2000" "rendezvous of ${n// /} participants ${rdv// /} ms <= 2000 ms"
check "$rss <= 64" "peak RSS ${rss// /} MiB <= 64 MiB"
check "$wfds <= $y + $fixed" "worker fds ${wfds// /} <= $y servers + $fixed"
check "$sfds <= $x + $fixed" "server fds ${sfds// /} <= $x workers + $fixed"
((fails == 0)) || exit 1
