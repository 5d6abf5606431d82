#!/usr/bin/env bash
# Regenerates the committed list of ctest names for the configuration of a
# build (tests/test_registry.cmake explains the configurations), after adding
# or removing tests on purpose. Builds everything first: PRE_TEST discovery
# lists a Catch2 executable's cases only when it is built.
#   scripts/update-expected-tests.sh [build dir]      (default: build)
# Both standard lists:
#   cmake -S . -B build -G Ninja && scripts/update-expected-tests.sh build          # cuda (nvcc present)
#   cmake -S . -B build-cpu -G Ninja -DSTEPMESH_ENABLE_CUDA=OFF \
#     && scripts/update-expected-tests.sh build-cpu                                  # cpu
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="${1:-build}"
[[ $build = /* ]] || build="$PWD/$build"
cmake --build "$build" -j"${JOBS:-2}"
config="$(cat "$build/stepmesh_test_config.txt")"
out="$root/tests/expected_tests/$config.txt"
"$root/tests/test_registry.sh" --list "$build" > "$out.tmp"
mv "$out.tmp" "$out"
echo "wrote $out: $(wc -l < "$out") tests (configuration '$config')"
git -C "$root" diff --stat -- "tests/expected_tests/$config.txt" || true
