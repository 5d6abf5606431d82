#pragma once
// stepmesh_doctor's checks: what an operator runs on a host before a job.
// Per GPU: the NIC the RDMA transport would choose and why, its port (state,
// link layer, MTU), GID (type, address, subnet), P_Key; for the process:
// RLIMIT_MEMLOCK against what the job pins, fork handling, peer memory
// (nvidia-peermem); per GPU the CUDA attributes the backend depends on
// (GPUDirect write ordering, flush options, stream memory operations,
// dma-buf export) and a real registration probe (a dma-buf MR and a
// peer-memory MR of device memory on the chosen NIC). Each finding is OK,
// WARN (a run works, but slower or fragile) or FAIL (a run would fail).
//
// Everything goes through the VerbsApi / CudaApi seams and a sysfs root, so
// tests run the doctor on the fakes with planted problems.

#include <memory>
#include <string>

#include "stepmesh/options.h"

namespace stepmesh::rdma {
class VerbsApi;
}  // namespace stepmesh::rdma
namespace stepmesh::cuda {
class CudaApi;
}  // namespace stepmesh::cuda

namespace stepmesh::doctor {

struct DoctorInputs {
  MeshOptions options;                    // what the job would run with (MeshOptions::FromEnv)
  std::shared_ptr<rdma::VerbsApi> verbs;  // null: this build has no RDMA transport
  std::shared_ptr<cuda::CudaApi> cuda;    // null: this build has no CUDA backend
  std::string sysfs_root = "/sys";        // NIC/GPU placement, kernel modules
  bool need_rdma = true;                  // no usable RDMA port is a FAIL (else a WARN)
  bool need_gpu = true;                   // no usable GPU is a FAIL (else a WARN)
};

struct DoctorReport {
  std::string text;  // the lines to print
  int failures = 0;
  int warnings = 0;
};

DoctorReport RunDoctor(const DoctorInputs& inputs);

}  // namespace stepmesh::doctor
