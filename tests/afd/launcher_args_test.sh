#!/usr/bin/env bash
# afd_launch argument handling: --help prints the flags and exits 0; every
# argument error exits 2 within seconds with a message naming the problem
# and the usage line, starts no process (no "logs in" line, no work
# directory) and never prints a "reference check" line.
#   launcher_args_test.sh <afd_launch>
set -uo pipefail
launch="$1"
plan="$(cd "$(dirname "$0")/../.." && pwd)/src/tools/planner/configs/emulated_ordering.json"
fails=0
work="$(mktemp -d /tmp/afd_args_test.XXXXXX)"
trap 'rm -rf "$work"' EXIT

# expect <exit code> <regex the output must match> <afd_launch args...>
expect() {
  local want_rc="$1" pattern="$2"
  shift 2
  local out rc
  out="$(timeout 20 "$launch" --work-dir "$work/run" "$@" 2>&1)"
  rc=$?
  local problems=()
  [[ $rc -eq $want_rc ]] || problems+=("exit $rc, want $want_rc")
  grep -Eq -- "$pattern" <<<"$out" || problems+=("output lacks /$pattern/")
  if grep -q "^reference check" <<<"$out"; then problems+=("prints a reference check line"); fi
  if grep -q "logs in" <<<"$out"; then problems+=("started processes"); fi
  if [[ $want_rc -eq 2 ]]; then
    grep -q "^usage: afd_launch" <<<"$out" || problems+=("no usage line")
    [[ ! -e "$work/run" ]] || problems+=("created the work directory")
  fi
  rm -rf "$work/run"
  if ((${#problems[@]})); then
    echo "FAIL: afd_launch $*: ${problems[*]}"
    sed 's/^/    /' <<<"$out"
    fails=$((fails + 1))
  else
    echo "ok:   afd_launch $* -> exit $rc"
  fi
}

expect 0 "--attention X +attention instances" --help
expect 0 "--model NAME\|PATH +the model" --help
expect 0 "--emulate-compute PLAN.json" --help
expect 2 "--ffn 17: at most 16 FFN instances" --attention 1 --ffn 17
expect 2 "need at least 1A1F" --attention 0 --ffn 1
expect 2 "unknown flag\(s\): --bogus" --bogus 3
expect 2 "missing value for --requests" --requests
expect 2 "--requests: not an integer: many" --requests many
expect 2 "--requests \(2\) must be at least --micro-batches \(3\)" --requests 2
expect 2 "--transport must be tcp, rdma or libfabric" --transport udp
expect 2 "--backend must be cpu_mock or cuda" --backend tpu
expect 2 "exceeds tiny-step3's max_position_embedding 4096" --prompt-len 4000 --decode-steps 200
expect 2 "--model: unknown model '/nonexistent.cfg'" --config /nonexistent.cfg
expect 2 "--model: unknown model 'nope': neither a bundled name" --model nope
expect 2 "--model tiny-step5 and --config tiny disagree" --model tiny-step5 --config tiny
expect 2 "step3 \(316\.3 billion parameters\) needs about [0-9.]+ GiB of host memory" --config step3
expect 2 "--kill-ffn 5 out of range" --ffn 2 --kill-ffn-after-ms 10 --kill-ffn 5
expect 2 "--expect-failure needs --kill-ffn-after-ms" --expect-failure
expect 2 "--deadline-s must be > 0" --deadline-s 0
expect 2 "--inject-wrong-layer 99:0: want STEP:LAYER within the run" --inject-wrong-layer 99:0 --expect-failure
expect 2 "--inject-wrong-layer needs --expect-failure" --inject-wrong-layer 1:1
# --resize (docs/elastic.md, "The example resizes").
expect 0 "--resize STEP:xAyF" --help
expect 2 "--resize 6-3A2F: want STEP:xAyF" --resize 6-3A2F
expect 2 "--resize 0:3A2F: step 0 must be after 0 \(the prefill\)" --resize 0:3A2F
expect 2 "--resize 17:3A2F: .*before 17" --resize 17:3A2F
expect 2 "--resize 6:1A1F: the run is already 1A1F" --resize 6:1A1F
expect 2 "--resize to 17F: at most 16 FFN instances" --resize 6:1A17F
expect 2 "--resize needs the cpu or the emulated engine" --resize 6:2A1F --engine cpu-device
expect 2 "--resize with --chrome-trace: not supported" --resize 6:2A1F --chrome-trace "$work/t.json"
# --autoscale and its emulated workload (docs/elastic.md, "Autoscale").
expect 0 "--autoscale AS.json" --help
expect 2 "--autoscale needs --emulate-compute and --context-growth" --autoscale "$plan"
expect 2 "--autoscale: .*plan is missing" --emulate-compute "$plan" --context-growth 1024:8192 --autoscale "$plan"
expect 2 "--context-growth 1024-8192: want FROM:TO" --emulate-compute "$plan" --context-growth 1024-8192
expect 2 "--context-growth needs --emulate-compute" --context-growth 1024:8192
expect 2 "--emulated-batch global needs --context-growth" --emulate-compute "$plan" --emulated-batch global
expect 2 "--emulated-batch half: must be per_instance or global" --emulated-batch half
expect 2 "--max-attention 4 / --decision-every 0: both or neither" --max-attention 4
expect 2 "--engine cuda needs --backend cuda" --engine cuda
expect 2 "--engine must be auto, cpu, cuda or cpu-device" --engine tpu
expect 2 "--engine cpu-device needs --backend cpu_mock" --engine cpu-device --backend cuda
expect 2 "--kv-cache fp8 needs --engine cpu \(the cpu-device engine keeps an fp32 KV cache\)" --engine cpu-device --kv-cache fp8
expect 2 "--kv-cache must be fp32, bf16 or fp8" --kv-cache int4
expect 2 "unexpected argument stray" stray
# The Step-5 model runs on the cpu engine with an fp32 KV cache only.
expect 2 "--engine cpu-device \(cpu-device\): the Step-5 model [a-z0-9-]+ runs on the cpu engine only" --model tiny-step5 --engine cpu-device
expect 2 "--engine auto \(cuda\): the Step-5 model [a-z0-9-]+ runs on the cpu engine only" --model tiny-step5 --backend cuda
expect 2 "--kv-cache bf16: the Step-5 model [a-z0-9-]+ keeps an fp32 KV cache" --model tiny-step5 --kv-cache bf16
# --emulate-compute selects the emulated engine: no other engine, no Step-5 model.
expect 2 "--emulate-compute selects the emulated engine; drop --engine cpu" --emulate-compute "$plan" --engine cpu
expect 2 "--emulate-compute with the Step-5 model [a-z0-9-]+: the emulated engine runs no model" --model tiny-step5 --emulate-compute "$plan"
expect 2 "--emulate-compute: .*/nonexistent.json" --emulate-compute /nonexistent.json
if [[ ! -e /sys/class/infiniband ]] || [[ -z "$(ls -A /sys/class/infiniband 2>/dev/null)" ]]; then
  expect 2 "--transport rdma: no RDMA device here" --transport rdma
fi
if [[ ! -e /dev/nvidia0 ]]; then
  expect 2 "--backend cuda is not available here" --backend cuda
fi
# Placement on emulated hosts (--hosts; tests/cluster/ runs it for real).
expect 2 "--hosts names 2 hosts; this run needs 4" --attention 2 --ffn 2 --hosts a,b \
  --host-addrs 10.0.0.1,10.0.0.2
expect 2 "--hosts: cannot open /run/netns/smcnosuchh0" --hosts smcnosuchh0,smcnosuchh1 \
  --host-addrs 10.0.0.1,10.0.0.2
expect 2 "--host-addrs has 1 addresses for 2 hosts" --hosts a,b --host-addrs 10.0.0.1
expect 2 "'10.0.0' is not an IPv4 address" --hosts a,b --host-addrs 10.0.0,10.0.0.2
expect 2 "--host-addrs needs --hosts" --host-addrs 10.0.0.1
expect 2 "--lost-attention 0: want an attention instance" --lost-attention 0
expect 2 "--lost-attention 2: want an attention instance" --attention 2 --lost-attention 2

if ((fails)); then
  echo "$fails case(s) failed"
  exit 1
fi
echo "all launcher argument cases passed"
