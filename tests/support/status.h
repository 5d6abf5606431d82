#pragma once
// Catch2 assertions on absl::Status and absl::StatusOr that print the status
// when they fail:
//   REQUIRE_OK(worker->Wait(h, timeout));
//   CHECK_OK(AFTensorServer::Create(options));
//   CHECK_STATUS(s, kUnavailable);

#include <catch2/catch.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace stepmesh::testing {

inline absl::Status StatusOf(const absl::Status& s) { return s; }
template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

}  // namespace stepmesh::testing

#define STEPMESH_ASSERT_STATUS_(assertion, expr, condition)            \
  do {                                                                 \
    const ::absl::Status status = ::stepmesh::testing::StatusOf(expr); \
    INFO(#expr << ": " << status.ToString());                          \
    assertion(condition);                                              \
  } while (0)

#define REQUIRE_OK(expr) STEPMESH_ASSERT_STATUS_(REQUIRE, expr, status.ok())
#define CHECK_OK(expr) STEPMESH_ASSERT_STATUS_(CHECK, expr, status.ok())
// The status (of a Status or StatusOr) has the code absl::StatusCode::`code`.
// (The parameter is not called `code`: it would replace status.code() too.)
#define CHECK_STATUS(expr, want) \
  STEPMESH_ASSERT_STATUS_(CHECK, expr, status.code() == ::absl::StatusCode::want)
#define REQUIRE_STATUS(expr, want) \
  STEPMESH_ASSERT_STATUS_(REQUIRE, expr, status.code() == ::absl::StatusCode::want)
