// Uses the installed library the way an application would.
#include <cstdio>

#include "stepmesh/stepmesh.h"

int main() {
  auto backend = stepmesh::CreateBackend("cpu_mock", 0);
  if (!backend.ok()) return 1;
  auto memory = (*backend)->Allocate(4096, stepmesh::MemoryKind::kDevice);
  stepmesh::MeshOptions options;
  options.num_workers = 2;
  if (!memory.ok() || !options.Validate().ok()) return 1;
  std::printf("stepmesh consumer: %s backend, %zu bytes\n",
              std::string((*backend)->name()).c_str(), (*memory)->bytes());
  return 0;
}
