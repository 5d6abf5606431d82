#pragma once
// What a test may scale down under ThreadSanitizer. TSan looks for unordered
// accesses between threads; a steady state repeated 20 times shows it nothing
// the first few repetitions did not (the same slots, keys and hand-offs), while
// every instrumented byte compared costs it 5-15x. Repetition that checks
// something else (wrap-around, a soak) must not use this.

namespace stepmesh::testing {

#if defined(__SANITIZE_THREAD__)
inline constexpr bool kUnderThreadSanitizer = true;
#else
inline constexpr bool kUnderThreadSanitizer = false;
#endif

// `normal` repetitions of a steady-state loop, `under_tsan` under TSan.
constexpr int SteadyStateRepetitions(int normal, int under_tsan) {
  return kUnderThreadSanitizer ? under_tsan : normal;
}

}  // namespace stepmesh::testing
