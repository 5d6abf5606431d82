// The afd tests' model: the bundled tiny Step-3 config (the test fails when
// it does not load).

#ifndef STEPMESH_TESTS_AFD_AFD_TEST_CONFIG_H_
#define STEPMESH_TESTS_AFD_AFD_TEST_CONFIG_H_

#include <catch2/catch.hpp>
#include <optional>
#include <string>

#include "examples/afd_model/config.h"

namespace afd::example {

inline ModelConfig Tiny() {
  std::string error;
  std::optional<ModelConfig> config = LoadModelConfig("tiny", BundledConfigDir(), &error);
  INFO(error);
  REQUIRE(config.has_value());
  return *config;
}

}  // namespace afd::example

#endif  // STEPMESH_TESTS_AFD_AFD_TEST_CONFIG_H_
