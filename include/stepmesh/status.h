#pragma once
// Status helpers. Debian's Abseil 20220623 ships no RETURN_IF_ERROR/ASSIGN_OR_RETURN,
// so stepmesh carries its own, prefixed to avoid clashing with an application's.

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define STEPMESH_CONCAT_INNER_(a, b) a##b
#define STEPMESH_CONCAT_(a, b) STEPMESH_CONCAT_INNER_(a, b)

// Returns the status of `expr` from the enclosing function when it is not OK.
#define STEPMESH_RETURN_IF_ERROR(expr)                   \
  do {                                                   \
    ::absl::Status stepmesh_status_ = (expr);            \
    if (!stepmesh_status_.ok()) return stepmesh_status_; \
  } while (0)

// `lhs = *expr` when `expr` (a StatusOr) is OK, else returns its status.
#define STEPMESH_ASSIGN_OR_RETURN(lhs, expr) \
  STEPMESH_ASSIGN_OR_RETURN_IMPL_(STEPMESH_CONCAT_(stepmesh_or_, __LINE__), lhs, expr)
#define STEPMESH_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  if (!tmp.ok()) return std::move(tmp).status();        \
  lhs = std::move(tmp).value()

// For broken internal invariants only; never for bad input or network faults.
#define STEPMESH_CHECK(cond)                                                                    \
  do {                                                                                          \
    if (!(cond)) {                                                                              \
      std::fprintf(stderr, "stepmesh: CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                             \
    }                                                                                           \
  } while (0)
