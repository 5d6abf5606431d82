#pragma once
// MeshOptions::FromEnv() under a few variables set for the call (and restored
// after), checked to succeed: what the option tests read the environment with.

#include <catch2/catch.hpp>
#include <initializer_list>
#include <optional>
#include <utility>

#include "absl/status/statusor.h"
#include "stepmesh/options.h"
#include "tests/support/scoped_env.h"

namespace stepmesh::testing {

inline std::optional<MeshOptions> FromEnvWith(
    std::initializer_list<std::pair<const char*, const char*>> vars) {
  ScopedEnv env(vars);
  absl::StatusOr<MeshOptions> o = MeshOptions::FromEnv();
  INFO(o.status().ToString());
  REQUIRE(o.ok());
  return *std::move(o);
}

}  // namespace stepmesh::testing
