#!/bin/bash
# libstepmesh.so, built with the RDMA transport, loads without rdma-core: no
# NEEDED entry names an rdma-core library, and no undefined symbol is a verbs
# call (a static inline wrapper of verbs.h that calls an exported entry point,
# such as ibv_reg_mr or ibv_query_port, would leave one behind).
set -euo pipefail
lib=$1
needed=$(readelf -d "$lib" | grep NEEDED)
echo "$needed"
if grep -E 'libibverbs|libmlx5|librdmacm' <<<"$needed"; then
  echo "FAILED: $lib links an rdma-core library (it must dlopen it)"
  exit 1
fi
undefined=$(nm -D --undefined-only "$lib" | grep -E ' (_*ibv_|mlx5dv_)' || true)
if [ -n "$undefined" ]; then
  echo "FAILED: $lib leaves verbs symbols undefined:"
  echo "$undefined"
  exit 1
fi
echo "PASSED: no rdma-core library NEEDED, no verbs symbol undefined"
