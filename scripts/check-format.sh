#!/usr/bin/env bash
# CI's formatting check: `clang-format --dry-run -Werror` (the repository's
# .clang-format) over the files scripts/format-files.sh lists. Fails naming
# every file that is not formatted; fix with
#   scripts/format-files.sh | xargs clang-format -i
# .ci/run runs it first (it takes seconds).
#   scripts/check-format.sh [clang-format binary]
set -euo pipefail
cd "$(dirname "$0")/.."
cf=${1:-$(command -v clang-format-14 || command -v clang-format || true)}
if [[ -z $cf ]]; then
  echo "check-format: clang-format not found (Debian: apt-get install clang-format)" >&2
  exit 1
fi
mapfile -t files < <(scripts/format-files.sh)
bad=()
for f in "${files[@]}"; do
  if ! "$cf" --dry-run -Werror --style=file "$f" > /dev/null 2>&1; then
    bad+=("$f")
  fi
done
if (( ${#bad[@]} > 0 )); then
  echo "check-format: ${#bad[@]} of ${#files[@]} files are not clang-formatted:" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "fix: scripts/format-files.sh | xargs $cf -i" >&2
  exit 1
fi
echo "check-format: ${#files[@]} files formatted"
