#!/usr/bin/env bash
# Installs every Debian package stepmesh needs that is not already there.
# Idempotent; needs root (or sudo) only when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config ccache
  libabsl-dev libhwloc-dev libibverbs-dev
  libfabric-dev libfabric-bin   # the libfabric transport (headers; fi_info); its tcp/shm rows in CI
  catch2 libbenchmark-dev libzmq3-dev
  gnuplot-nox
  python3 python3-numpy   # the example's independent float64 reference (tests/model)
  clang-14 libclang-rt-14-dev   # libFuzzer (scripts/run-fuzz.sh)
  clang-format-14 strace        # scripts/check-format.sh; tests/fuzz/capture_seeds.py
  # scripts/cluster.sh (tests/cluster): namespaces, tc and ping; iptables for
  # loss and the netfilter-queue delay (also provides ebtables for black holes)
  iproute2 iputils-ping iptables libnetfilter-queue-dev
  # the Python package (python/) and its tests; torch is a test dependency;
  # python3-numpy also runs the independent numpy reference of tests/step5
  python3-dev pybind11-dev python3-numpy python3-pytest python3-setuptools python3-torch
  # the etcd rendezvous (src/rendezvous/etcd: JSON gateway over libcurl) and its
  # tests (tests/etcd start a real 3-member cluster); python3-yaml parses deploy/
  libcurl4-openssl-dev libjsoncpp-dev etcd-server etcd-client python3-yaml
)

missing=()
for p in "${packages[@]}"; do
  if [[ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != *"install ok installed"* ]]; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "stepmesh: installing ${missing[*]}" >&2
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
