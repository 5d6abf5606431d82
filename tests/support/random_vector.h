#pragma once
// Normally distributed test inputs from a fixed seed, shared by the model,
// Step-5 and GPU kernel tests. The engine is a parameter so that a suite keeps
// the exact values it was written against (std::mt19937 or std::mt19937_64).

#include <cstddef>
#include <random>
#include <vector>

namespace stepmesh::testing {

template <typename Engine = std::mt19937>
std::vector<float> RandomNormal(size_t count, typename Engine::result_type seed,
                                float stddev = 1.0f) {
  Engine rng(seed);
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> values(count);
  for (float& v : values) v = normal(rng);
  return values;
}

}  // namespace stepmesh::testing
