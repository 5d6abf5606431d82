#!/usr/bin/env bash
# cluster.sh: an emulated cluster on one machine. N hosts, each a network
# namespace with one or two veth "rails" to a switch (a namespace holding one
# bridge per rail); addresses from 10.232.R.0/24 exist only inside the
# namespaces. Links get a delay, jitter, loss and rate; faults can be injected
# while a command runs. Everything is torn down on exit (trap), and what a
# killed run left behind is removed at the next start.
#
#   cluster.sh run  [LINK FLAGS] -- CMD ARGS...   CMD runs here (the root
#        namespace), with CLUSTER_PREFIX, CLUSTER_HOSTS (namespace names,
#        comma-separated, host 0 first), CLUSTER_ADDRS (rail 0 addresses) and
#        CLUSTER_ADDRS1 (rail 1) in its environment; it places processes on
#        hosts itself (afd_launch --hosts, `ip netns exec`).
#   cluster.sh each [LINK FLAGS] -- CMD ARGS...   CMD runs once in every host
#        namespace, concurrently, with CLUSTER_HOST (the index) and
#        CLUSTER_ADDR (its rail 0 address) added; fails if any instance fails.
#   cluster.sh fault --prefix P --host I [--rail R] down|up|blackhole|clear
#        down/up: the host's rail R link (the switch port; the host sees
#        NO-CARRIER); blackhole: the switch silently drops everything to and
#        from that host (no RST, no ICMP), clear undoes it. Without --rail:
#        every rail.
#   cluster.sh clean   removes every leftover cluster of a run that is gone.
#
# LINK FLAGS: --hosts N (2)  --rails 1|2 (1)  --rtt-us U (0)  --jitter-us J (0)
#   --gbps G (unlimited)  --loss PCT (0, per direction)  --prefix P (smcPID)
#   --delay-bin PATH (link_delay; default: $CLUSTER_DELAY_BIN, then
#   build/tests/cluster/link_delay)
#
# How each property is made (the development machine's kernel has no netem
# and no fq qdisc, so neither a queueing delay nor EDT pacing is there):
#   rate    tbf on both ends of every rail (host egress = upload, switch port
#           egress = download): kernel.
#   loss    iptables `statistic --mode random` DROP on the receiving host's
#           INPUT: the packet left the sender and never arrived, as on a wire
#           (a drop in OUTPUT would instead return an error to the sender's
#           TCP): kernel.
#   delay   netem on the host's egress where the kernel has it; otherwise
#           every packet a host sends waits RTT/2 (+- jitter) in a netfilter
#           queue (iptables NFQUEUE) released by link_delay
#           (tests/cluster/link_delay.cc): packets never leave the kernel and
#           TCP is not proxied, but the wake-up is a user-space timer, so the
#           real RTT is higher than asked on a loaded machine; `run` and
#           `each` measure it (ping) and print it.
#   faults  `ip link set down` on the switch port; ebtables DROP in the
#           switch's bridge for a black hole: kernel.
# Exit 77 only when network namespaces cannot be created here (not root, no
# CAP_NET_ADMIN), saying so.
set -euo pipefail

STATE_ROOT=/run/stepmesh-cluster
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

die() { echo "cluster: $*" >&2; exit 2; }

hosts=2 rails=1 rtt_us=0 jitter_us=0 gbps="" loss="" prefix="" delay_bin="${CLUSTER_DELAY_BIN:-}"
fault_host="" fault_rail=""

parse_link_flags() {
  while (($#)); do
    case "$1" in
      --hosts) hosts="$2"; shift 2 ;;
      --rails) rails="$2"; shift 2 ;;
      --rtt-us) rtt_us="$2"; shift 2 ;;
      --jitter-us) jitter_us="$2"; shift 2 ;;
      --gbps) gbps="$2"; shift 2 ;;
      --loss) loss="$2"; shift 2 ;;
      --prefix) prefix="$2"; shift 2 ;;
      --delay-bin) delay_bin="$2"; shift 2 ;;
      --host) fault_host="$2"; shift 2 ;;
      --rail) fault_rail="$2"; shift 2 ;;
      --) shift; REST=("$@"); return ;;
      *) REST=("$@"); return ;;
    esac
  done
  REST=()
}

validate() {
  [[ "$hosts" =~ ^[0-9]+$ ]] && ((hosts >= 1 && hosts <= 250)) || die "--hosts $hosts: want 1..250"
  [[ "$rails" == 1 || "$rails" == 2 ]] || die "--rails $rails: want 1 or 2"
  [[ "$rtt_us" =~ ^[0-9]+$ ]] || die "--rtt-us $rtt_us: want a whole number of microseconds"
  [[ "$jitter_us" =~ ^[0-9]+$ ]] || die "--jitter-us $jitter_us: want a whole number"
  ((jitter_us * 2 <= rtt_us)) || die "--jitter-us $jitter_us must not exceed half of --rtt-us"
  [[ -z "$gbps" || "$gbps" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--gbps $gbps: want a number"
  [[ -z "$loss" || "$loss" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--loss $loss: want a percentage"
  [[ -z "$prefix" || "$prefix" =~ ^smc[a-z0-9]{1,12}$ ]] ||
    die "--prefix $prefix: want smc followed by up to 12 of [a-z0-9]"
}

ns_host() { echo "${prefix}h$1"; }
ns_switch() { echo "${prefix}sw"; }
addr() { echo "10.232.$2.$(($1 + 1))"; }  # host, rail

# Removes one cluster: its delay processes (by the PIDs it recorded), then its
# namespaces (which takes their links, bridges and rules with them).
teardown_prefix() {
  local p="$1" dir="$STATE_ROOT/$1" pid ns
  if [[ -d "$dir" ]]; then
    for f in "$dir"/delay.*.pid; do
      [[ -e "$f" ]] || continue
      pid="$(cat "$f")"
      kill "$pid" 2>/dev/null || true
    done
    for f in "$dir"/delay.*.pid; do
      [[ -e "$f" ]] || continue
      pid="$(cat "$f")"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.02; done
      kill -9 "$pid" 2>/dev/null || true
    done
  fi
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${p}(h[0-9]+|sw)$" || true); do
    ip netns delete "$ns" 2>/dev/null || true
  done
  rm -rf "$dir"
}

# Clusters whose owner process is gone (a run killed with SIGKILL) go now.
clean_leftovers() {
  local d owner
  [[ -d "$STATE_ROOT" ]] || return 0
  for d in "$STATE_ROOT"/smc*; do
    [[ -d "$d" ]] || continue
    owner="$(cat "$d/owner" 2>/dev/null || echo 0)"
    if ((owner > 0)) && kill -0 "$owner" 2>/dev/null; then continue; fi
    echo "cluster: removing leftover cluster $(basename "$d") (owner $owner is gone)" >&2
    teardown_prefix "$(basename "$d")"
  done
}

# netem where the kernel has it (a CI runner's usually does); otherwise the
# netfilter queue (see the header).
delay_method=none
probe_delay_method() {
  ((rtt_us > 0)) || return 0
  local sw
  sw="$(ns_switch)"
  ip -n "$sw" link add probe0 type veth peer name probe1
  if ip netns exec "$sw" tc qdisc add dev probe0 root netem delay 1us 2>/dev/null; then
    delay_method=netem
  else
    delay_method=nfqueue
  fi
  ip -n "$sw" link delete probe0
}

shape_egress() {  # namespace, device, host side (1) or switch side (0)
  local ns="$1" dev="$2" parent="root"
  if [[ "$3" == 1 && "$delay_method" == netem ]]; then
    ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem limit 100000 \
      delay "$((rtt_us / 2))us" "${jitter_us}us"
    parent="parent 1:1"  # netem's one child
  fi
  [[ -n "$gbps" ]] || return 0
  # A burst of 256 KiB holds a whole GSO packet (64 KiB) with room; about
  # 200 us of line time at 10 Gb/s.
  ip netns exec "$ns" tc qdisc add dev "$dev" $parent handle 2: tbf rate "${gbps}gbit" \
    burst 256k latency 20ms
}

setup() {
  # The state directory first: a namespace made before it could not be found
  # again by the clean-up of a killed run.
  if ! mkdir -p "$STATE_ROOT/$prefix" 2>/dev/null; then
    echo "cluster: cannot create $STATE_ROOT (not root?), so no network namespaces here: skipping" >&2
    exit 77
  fi
  echo "$$" >"$STATE_ROOT/$prefix/owner"
  local sw h r ns
  sw="$(ns_switch)"
  if ! err="$(ip netns add "$sw" 2>&1)"; then
    rm -rf "${STATE_ROOT:?}/$prefix"
    echo "cluster: cannot create network namespaces here ($err): skipping" >&2
    exit 77
  fi
  ip -n "$sw" link set lo up
  for ((r = 0; r < rails; ++r)); do
    ip -n "$sw" link add "br$r" type bridge
    ip -n "$sw" link set "br$r" up
  done
  if [[ -n "$loss" || "$rtt_us" -gt 0 ]]; then
    command -v iptables >/dev/null || die "iptables is missing (scripts/install-deps.sh)"
  fi
  probe_delay_method
  if [[ "$delay_method" == nfqueue ]]; then
    if [[ -z "$delay_bin" ]]; then delay_bin="$here/../build/tests/cluster/link_delay"; fi
    [[ -x "$delay_bin" ]] || die "--rtt-us needs link_delay: $delay_bin is not built (--delay-bin)"
  fi
  for ((h = 0; h < hosts; ++h)); do
    ns="$(ns_host "$h")"
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    for ((r = 0; r < rails; ++r)); do
      ip link add "r$r" netns "$ns" type veth peer name "h${h}r$r" netns "$sw"
      ip -n "$ns" addr add "$(addr "$h" "$r")/24" dev "r$r"
      ip -n "$ns" link set "r$r" up
      ip -n "$sw" link set "h${h}r$r" master "br$r" up
      shape_egress "$ns" "r$r" 1
      shape_egress "$sw" "h${h}r$r" 0
      if [[ -n "$loss" ]]; then
        ip netns exec "$ns" iptables -A INPUT -i "r$r" -m statistic --mode random \
          --probability "$(awk -v p="$loss" 'BEGIN{printf "%.6f", p / 100}')" -j DROP
      fi
      if [[ "$delay_method" == nfqueue ]]; then
        ip netns exec "$ns" "$delay_bin" --queue "$r" --delay-us $((rtt_us / 2)) \
          --jitter-us "$jitter_us" >"$STATE_ROOT/$prefix/delay.$h.$r.log" 2>&1 &
        echo $! >"$STATE_ROOT/$prefix/delay.$h.$r.pid"
      fi
    done
  done
  if [[ "$delay_method" == nfqueue ]]; then
    # Packets are queued only once every delay process has bound its queue
    # (a queue nobody reads drops its packets).
    for ((h = 0; h < hosts; ++h)); do
      for ((r = 0; r < rails; ++r)); do
        local log="$STATE_ROOT/$prefix/delay.$h.$r.log" ok=0
        for _ in $(seq 250); do
          grep -q '^link_delay: queue' "$log" 2>/dev/null && { ok=1; break; }
          kill -0 "$(cat "$STATE_ROOT/$prefix/delay.$h.$r.pid")" 2>/dev/null || break
          sleep 0.02
        done
        ((ok)) || die "link_delay for host $h rail $r did not start: $(cat "$log")"
        ip netns exec "$(ns_host "$h")" iptables -A OUTPUT -o "r$r" -j NFQUEUE --queue-num "$r"
      done
    done
  fi
  local names=() a0=() a1=()
  for ((h = 0; h < hosts; ++h)); do
    names+=("$(ns_host "$h")")
    a0+=("$(addr "$h" 0)")
    a1+=("$(addr "$h" 1)")
  done
  CLUSTER_HOSTS="$(IFS=,; echo "${names[*]}")"
  CLUSTER_ADDRS="$(IFS=,; echo "${a0[*]}")"
  CLUSTER_ADDRS1=""
  if ((rails == 2)); then CLUSTER_ADDRS1="$(IFS=,; echo "${a1[*]}")"; fi
  export CLUSTER_PREFIX="$prefix" CLUSTER_HOSTS CLUSTER_ADDRS CLUSTER_ADDRS1
  touch "$STATE_ROOT/$prefix/up"
  echo "cluster: $hosts hosts ($prefix), $rails rail(s), rtt ${rtt_us} us (jitter ${jitter_us}, delay by $delay_method), rate ${gbps:-unlimited} Gb/s, loss ${loss:-0} %" >&2
  if ((hosts >= 2)); then
    local r out
    for ((r = 0; r < rails; ++r)); do
      out="$(ip netns exec "$(ns_host 0)" ping -n -q -c 20 -i 0.01 -W 1 "$(addr 1 "$r")" 2>&1 |
        grep -E 'rtt|round-trip' || true)"
      [[ -n "$out" ]] || die "host 0 cannot reach host 1 on rail $r"
      echo "cluster: measured rail $r host0->host1 ${out#*= } (ping)" >&2
    done
  fi
}

fault() {
  local action="${REST[0]:-}" sw h="$fault_host" r
  [[ -n "$prefix" ]] || die "fault needs --prefix"
  [[ "$h" =~ ^[0-9]+$ ]] || die "fault needs --host I"
  sw="$(ns_switch)"
  ip netns list | grep -qE "^$sw( |$)" || die "no cluster $prefix"
  local rail_list
  if [[ -n "$fault_rail" ]]; then rail_list="$fault_rail"; else
    rail_list="$(ip -n "$sw" -o link show | grep -oE "h${h}r[0-9]+" | sed 's/.*r//' | sort -u)"
  fi
  for r in $rail_list; do
    local port="h${h}r$r"
    case "$action" in
      down) ip -n "$sw" link set "$port" down ;;
      up) ip -n "$sw" link set "$port" up ;;
      blackhole)
        ip netns exec "$sw" ebtables -A FORWARD -i "$port" -j DROP
        ip netns exec "$sw" ebtables -A FORWARD -o "$port" -j DROP ;;
      clear)
        ip netns exec "$sw" ebtables -D FORWARD -i "$port" -j DROP 2>/dev/null || true
        ip netns exec "$sw" ebtables -D FORWARD -o "$port" -j DROP 2>/dev/null || true ;;
      *) die "fault: want down|up|blackhole|clear, not '$action'" ;;
    esac
    echo "cluster: host $h rail $r $action" >&2
  done
}

cmd="${1:-}"
shift || true
case "$cmd" in
  run | each)
    parse_link_flags "$@"
    validate
    ((${#REST[@]})) || die "$cmd: no command given (cluster.sh $cmd [flags] -- CMD ...)"
    [[ -n "$prefix" ]] || prefix="smc$$"
    clean_leftovers
    teardown_prefix "$prefix"
    trap 'teardown_prefix "$prefix"' EXIT
    trap 'exit 130' INT TERM
    setup
    rc=0
    if [[ "$cmd" == run ]]; then
      "${REST[@]}" || rc=$?
    else
      pids=()
      for ((h = 0; h < hosts; ++h)); do
        CLUSTER_HOST="$h" CLUSTER_ADDR="$(addr "$h" 0)" \
          ip netns exec "$(ns_host "$h")" "${REST[@]}" &
        pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    fi
    exit "$rc"
    ;;
  fault) parse_link_flags "$@"; fault ;;
  clean) clean_leftovers ;;
  *) sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
