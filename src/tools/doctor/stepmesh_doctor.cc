// stepmesh_doctor: run on a host before a job. Prints, per GPU, the NIC the
// RDMA transport would choose and why, port state, GID / type / subnet, MTU,
// P_Key, RLIMIT_MEMLOCK, fork handling, dma-buf and peer-memory registration
// of GPU memory, and the CUDA attributes the backend relies on; exits 1 when
// a run with this environment (MeshOptions::FromEnv: STEPMESH_TRANSPORT,
// STEPMESH_RDMA_*, CUDA_DEVICE_MAX_CONNECTIONS ...) would fail.
//   stepmesh_doctor [--no-gpu] [--no-rdma]
//     --no-gpu   a host-memory job: no GPU is a warning, not a failure
//     --no-rdma  a TCP job (also when STEPMESH_TRANSPORT=tcp)
// Exit: 0 ready, 1 a run would fail, 2 bad arguments or environment.

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "src/tools/doctor/doctor.h"
#include "stepmesh/options.h"

#ifdef STEPMESH_HAVE_RDMA
#include "src/transport/rdma/verbs_api.h"
#endif
#ifdef STEPMESH_HAVE_CUDA
#include "src/backends/cuda/cuda_api.h"
#endif

int main(int argc, char** argv) {
  stepmesh::doctor::DoctorInputs in;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--no-gpu") {
      in.need_gpu = false;
    } else if (arg == "--no-rdma") {
      in.need_rdma = false;
    } else {
      std::fprintf(stderr, "usage: stepmesh_doctor [--no-gpu] [--no-rdma]\n");
      return arg == "--help" || arg == "-h" ? 0 : 2;
    }
  }
  absl::StatusOr<stepmesh::MeshOptions> options = stepmesh::MeshOptions::FromEnv();
  if (!options.ok()) {
    std::fprintf(stderr, "stepmesh_doctor: %s\n", options.status().ToString().c_str());
    return 2;
  }
  in.options = *options;
  if (in.options.transport == "tcp") in.need_rdma = false;
#ifdef STEPMESH_HAVE_RDMA
  absl::StatusOr<std::shared_ptr<stepmesh::rdma::VerbsApi>> verbs =
      stepmesh::rdma::MakeRealVerbsApi();
  if (verbs.ok()) {
    in.verbs = *std::move(verbs);
  } else {  // libibverbs is opened at run time: without rdma-core there is no RDMA
    std::printf("%s\n", std::string(verbs.status().message()).c_str());
  }
#endif
#ifdef STEPMESH_HAVE_CUDA
  in.cuda = stepmesh::cuda::CreateRuntimeCudaApi();
#endif
  const stepmesh::doctor::DoctorReport report = stepmesh::doctor::RunDoctor(in);
  std::fputs(report.text.c_str(), stdout);
  return report.failures == 0 ? 0 : 1;
}
