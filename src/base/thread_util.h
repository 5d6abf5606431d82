#pragma once
// Named progress threads, optionally pinned to cores through hwloc, and the
// pause instruction spinning loops use between polls.

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace stepmesh::base {

// Starts `body` on a thread named `name` (15 chars max, as the kernel allows),
// bound to `cores` when not empty. A failed binding is logged, not fatal.
std::thread StartNamedThread(std::string name, std::vector<int> cores, std::function<void()> body);

// Binds the calling thread to `cores` through hwloc.
absl::Status BindCurrentThread(const std::vector<int>& cores);

// Cores for the send and receive threads when auto-pinning: the last two
// cores of the NUMA node `numa_node` (-1: the machine), leaving low cores to
// the application. Empty when the machine has fewer than 4 cores: pinning two
// spinning threads on a tiny machine starves everything else.
std::vector<int> PickProgressCores(int numa_node, int count);

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

}  // namespace stepmesh::base
