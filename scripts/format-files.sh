#!/usr/bin/env bash
# The C++ files clang-format must keep formatted (scripts/check-format.sh):
# every tracked .h/.cc/.cu/.cuh of the project, one per line. Third-party or
# generated files would be filtered here.
set -euo pipefail
cd "$(dirname "$0")/.."
git ls-files -- '*.h' '*.cc' '*.cu' '*.cuh' | grep -v '^third_party/' || true
