#!/usr/bin/env bash
# scripts/cluster.sh itself: hosts and rails reachable only inside their
# namespaces, the link properties applied, faults, and that nothing is left
# behind: not after a failing command, not after the script is SIGKILLed
# (the next start removes it).
#   cluster_script_test.sh [LINK_DELAY]
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cluster="$here/../../scripts/cluster.sh"
[[ -n "${1:-}" ]] && export CLUSTER_DELAY_BIN="$1"
fails=0
ok() { echo "ok:   $*"; }
bad() { echo "FAIL: $*"; fails=$((fails + 1)); }
ours() { ip netns list 2>/dev/null | awk '{print $1}' | grep -cE "^$1(h[0-9]+|sw)$"; }

# 1. Three hosts, two rails: each host reaches the others on both rails, the
# addresses exist only inside the namespaces, CLUSTER_* describe them.
out="$(bash "$cluster" each --hosts 3 --rails 2 --prefix smctest1 -- sh -c '
  for h in 1 2 3; do
    for r in 0 1; do
      ping -n -q -c 1 -W 2 10.232.$r.$h >/dev/null || { echo "host $CLUSTER_HOST: no 10.232.$r.$h"; exit 1; }
    done
  done
  echo "host $CLUSTER_HOST at $CLUSTER_ADDR reaches all"' 2>&1)"
rc=$?
if ((rc == 77)); then echo "$out"; exit 77; fi
if ((rc == 0)) && [[ $(grep -c "reaches all" <<<"$out") == 3 ]]; then ok "3 hosts x 2 rails reach each other"
else bad "each: rc $rc: $out"; fi
if ip -o addr show 2>/dev/null | grep -q '10\.232\.'; then bad "a 10.232 address in the root namespace"
else ok "no cluster address in the root namespace"; fi
[[ "$(ours smctest1)" == 0 ]] && ok "each: torn down" || bad "each left namespaces behind"

# 2. The command's exit status is the script's, and a failing command still
# tears everything down.
bash "$cluster" run --hosts 2 --prefix smctest2 -- sh -c 'exit 3' 2>/dev/null
rc=$?
((rc == 3)) && ok "run returns the command's status (3)" || bad "run returned $rc, want 3"
[[ "$(ours smctest2)" == 0 ]] && ok "failed run: torn down" || bad "failed run left namespaces"

# 3. Link properties: rate (tbf on both ends), loss (iptables statistic),
# delay (netem or the netfilter queue), and the RTT the script measured.
out="$(bash "$cluster" run --hosts 2 --rtt-us 400 --gbps 2 --loss 1 --prefix smctest3 -- sh -c '
  ip netns exec ${CLUSTER_PREFIX}h0 tc qdisc show dev r0
  ip netns exec ${CLUSTER_PREFIX}sw tc qdisc show dev h1r0
  ip netns exec ${CLUSTER_PREFIX}h1 iptables -S INPUT
  ip netns exec ${CLUSTER_PREFIX}h0 ping -n -q -c 10 -i 0.02 10.232.0.2
  echo "delay pids: $(cat /run/stepmesh-cluster/$CLUSTER_PREFIX/delay.*.pid 2>/dev/null)"' 2>&1)"
rc=$?
((rc == 0)) || bad "shaped run: rc $rc: $out"
[[ $(grep -c "tbf.*rate 2Gbit" <<<"$out") -ge 2 ]] && ok "tbf 2 Gb/s on both ends" || bad "no tbf: $out"
grep -qE -- "--probability 0\.0(1|099)" <<<"$out" && ok "1 % loss rule" || bad "no loss rule: $out"
avg="$(grep -oE 'rtt min/avg/max/mdev = [0-9.]+/[0-9.]+' <<<"$out" | head -1 | cut -d/ -f5)"
if [[ -n "$avg" ]] && awk -v a="$avg" 'BEGIN{exit !(a >= 0.4)}'; then ok "RTT ${avg} ms >= the 0.4 ms asked"
else bad "RTT '$avg' ms below the 0.4 ms asked: $out"; fi
grep -q "cluster: measured rail 0" <<<"$out" && ok "the script reports the RTT it got" || bad "no measured RTT"
[[ "$(ours smctest3)" == 0 ]] && ok "shaped run: torn down" || bad "shaped run left namespaces"
# This run's delay processes (netem needs none) are gone.
alive=0
for p in $(grep '^delay pids:' <<<"$out" | cut -d: -f2); do kill -0 "$p" 2>/dev/null && alive=1; done
((alive)) && bad "a link_delay process survived" || ok "no link_delay left"

# 4. Faults: a downed port and a black hole cut the host off, up/clear heal.
out="$(bash "$cluster" run --hosts 2 --prefix smctest4 -- sh -c '
  c="bash '"$cluster"' fault --prefix $CLUSTER_PREFIX --host 1"
  p() { ip netns exec ${CLUSTER_PREFIX}h0 ping -n -q -c 1 -W 1 10.232.0.2 >/dev/null && echo "$1 reach" || echo "$1 cut"; }
  p before; $c down; p down; $c up; sleep 0.2; p up; $c blackhole; p blackhole; $c clear; p clear' 2>&1)"
for want in "before reach" "down cut" "up reach" "blackhole cut" "clear reach"; do
  grep -q "^$want$" <<<"$out" && ok "fault: $want" || bad "fault: want '$want': $out"
done

# 5. A run killed with SIGKILL leaves its cluster; the next start removes it.
bash "$cluster" run --hosts 2 --rtt-us 100 --prefix smctest5 -- sleep 60 >/dev/null 2>&1 &
victim=$!
for _ in $(seq 100); do [[ -e /run/stepmesh-cluster/smctest5/up ]] && break; sleep 0.1; done
[[ "$(ours smctest5)" == 3 ]] && ok "killed-run cluster is up" || bad "killed-run cluster never came up"
leaked_delays="$(cat /run/stepmesh-cluster/smctest5/delay.*.pid 2>/dev/null)"
sleeper="$(pgrep -P "$victim" -x sleep)"
kill -9 "$victim"
wait "$victim" 2>/dev/null
[[ -n "$sleeper" ]] && kill "$sleeper" 2>/dev/null
[[ "$(ours smctest5)" == 3 ]] && ok "SIGKILL left it behind (as expected)" || bad "nothing left to clean?"
out="$(bash "$cluster" run --hosts 1 --prefix smctest6 -- true 2>&1)"
grep -q "removing leftover cluster smctest5" <<<"$out" && ok "next start removed the leftover" ||
  bad "leftover not removed: $out"
[[ "$(ours smctest5)" == 0 ]] && ok "leftover namespaces gone" || bad "leftover namespaces remain"
alive=0
for p in $leaked_delays; do kill -0 "$p" 2>/dev/null && alive=1; done
((alive)) && bad "a leftover link_delay survived" || ok "leftover link_delay gone"

# 6. Bad flags exit 2 before creating anything.
bash "$cluster" run --rails 3 -- true >/dev/null 2>&1
(($? == 2)) && ok "--rails 3 refused" || bad "--rails 3 accepted"

if ((fails)); then echo "$fails check(s) failed"; exit 1; fi
echo "all cluster.sh checks passed"
