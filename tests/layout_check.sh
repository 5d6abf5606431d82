#!/usr/bin/env bash
# Fails when an include arrow points up or sideways between rooms
# (docs/architecture.md): base -> core -> transports/backends -> compose ->
# programs. Each rule lists the project folders a room may include from;
# std, Abseil and system headers are not checked.
#   tests/layout_check.sh [repo root]
set -euo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$root"

# room (a path prefix) -> allowed include prefixes. The first matching room wins.
rules=(
  "include/stepmesh/|stepmesh/"
  "src/base/|src/base/ stepmesh/status.h"
  "src/core/|src/base/ src/core/ stepmesh/"
  "src/transport/tcp_fallback/|src/base/ src/core/ src/transport/tcp_fallback/ stepmesh/"
  "src/transport/rdma/|src/base/ src/core/ src/transport/rdma/ stepmesh/"
  "src/backends/cpu_mock/|src/base/ src/backends/cpu_mock/ stepmesh/"
  "src/backends/cuda/|src/base/ src/backends/cuda/ stepmesh/"
  "src/rendezvous/etcd/|src/base/ src/core/ src/rendezvous/etcd/ stepmesh/"
  "src/compose/|src/ stepmesh/"
  "src/tools/planner/|stepmesh/status.h"
  "src/tools/doctor/|src/ stepmesh/"
  "src/tools/|src/compose/ src/core/ src/base/ stepmesh/"
  "tests/support/|src/ stepmesh/ tests/support/ tests/rdma/fake_verbs.h tests/cuda/fake_cuda_api.h"
  "tests/fuzz/|src/base/ src/core/ src/transport/ stepmesh/"
  "tests/model/|examples/afd_model/ stepmesh/ tests/support/"
  "tests/model_gpu/|examples/afd_model/ stepmesh/ tests/support/"
  "tests/afd/|examples/afd_model/ stepmesh/ tests/support/"
  "tests/step5/|examples/afd_model/ stepmesh/ tests/support/"
  "tests/|src/ stepmesh/ tests/support/ tests/rdma/fake_verbs.h tests/cuda/fake_cuda_api.h"
  "benchmarks/model/|examples/afd_model/ stepmesh/ benchmarks/model/"
  "benchmarks/|src/ stepmesh/ benchmarks/ tests/support/"
  "examples/|stepmesh/ examples/ src/backends/cuda/cuda_backend.h src/tools/planner/ src/tools/metrics/"
  "python/src/|python/src/ stepmesh/"  # the binding uses the public API only
)

# A folder under src/transport or src/backends that no rule names is a new
# room: it gets the rule of its kind.
# Sets `allowed` for `file` ("*": not policed).
room_rule() {
  local file=$1 rule
  for rule in "${rules[@]}"; do
    if [[ $file == "${rule%%|*}"* ]]; then allowed=${rule#*|}; return; fi
  done
  if [[ $file =~ ^src/(transport|backends)/([^/]+)/ ]]; then
    local own="src/${BASH_REMATCH[1]}/${BASH_REMATCH[2]}/"
    if [[ ${BASH_REMATCH[1]} == transport ]]; then allowed="src/base/ src/core/ $own stepmesh/"
    else allowed="src/base/ $own stepmesh/"; fi
    return
  fi
  allowed="*"
}

bad=0
checked=0
while IFS= read -r file; do
  room_rule "$file"
  [[ $allowed == "*" ]] && continue
  # A file may always include from its own folder (tests/rdma/ from tests/rdma/...).
  allowed="$allowed ${file%/*}/"
  while IFS= read -r hit; do
    line=${hit%%:*}
    target=${hit#*:}
    target=${target#*\"}
    target=${target%%\"*}
    # Only project paths are policed; a bare "name.h" is a sibling in the same folder.
    [[ $target == */* ]] || continue
    [[ $target =~ ^(src|tests|benchmarks|examples|stepmesh)/ ]] || continue
    ok=0
    for prefix in $allowed; do
      if [[ $target == "$prefix"* ]]; then ok=1; break; fi
    done
    checked=$((checked + 1))
    if [[ $ok == 0 ]]; then
      echo "layout: $file:$line includes \"$target\" (allowed from this room: $allowed)"
      bad=$((bad + 1))
    fi
  done < <(grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$file" || true)
done < <(git ls-files --cached --others --exclude-standard -- include src tests benchmarks examples python |
         grep -E '\.(h|cc|cu|cuh)$')

echo "layout: $checked project includes checked, $bad pointing the wrong way"

# Code the TSan lane runs (src/, tests/) locks with src/base/sync.h: Debian's
# Abseil is not built with TSan, which cannot see absl::Mutex and reports the
# fields it guards as racy (the CI failure of the libfabric rejoiner-hello
# test). Allowed: env.cc and env_table.cc, whose function-local static
# absl::Mutex (constant-initialised) guards only the process environment.
locks=0
while IFS= read -r hit; do
  echo "layout: $hit uses Abseil synchronisation; lock with src/base/sync.h (TSan sees std::mutex)"
  locks=$((locks + 1))
done < <(git grep -nE 'absl/synchronization/|absl::(Mutex|MutexLock|CondVar|Notification|Condition)\b' \
           -- 'src/*.h' 'src/*.cc' 'src/*.cu' 'tests/*.h' 'tests/*.cc' 'tests/*.cu' ':!src/core/env.cc' ':!src/core/env_table.cc' ':!src/base/sync.h' || true)
echo "layout: $locks uses of Abseil synchronisation in src/ and tests/"
[[ $bad == 0 && $locks == 0 ]]
