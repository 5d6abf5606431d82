#include "python/src/mesh_binding.h"

#include "python/src/attention_lanes.h"
#include "python/src/batch_binding.h"
#include "python/src/plan_binding.h"
#include "python/src/scheduler_binding.h"
#include "python/src/server_binding.h"
#include "python/src/tensor_slice_binding.h"
#include "python/src/worker_binding.h"

namespace stepmesh::python {

// In this order: a class is bound before the signatures that name it.
void BindMesh(pybind11::module_& m) {
  BindRequest(m);
  BindTensorSlice(m);
  BindBatch(m);
  BindPlan(m);
  BindWorker(m);
  BindAttentionLanes(m);
  BindServer(m);
  BindScheduler(m);
}

}  // namespace stepmesh::python
