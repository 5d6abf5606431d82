#pragma once
// stepmesh.Worker(..., store=S) / stepmesh.Server(..., store=S): the mesh
// meets through S, any object with torch.distributed.Store's set / get / add /
// wait (a TCPStore the framework started), instead of a scheduler or etcd.

#include <pybind11/pybind11.h>

#include <memory>
#include <utility>

#include "stepmesh/rendezvous_store.h"

namespace stepmesh::python {

// `kwargs` without "store", and that store wrapped (null when absent or None).
std::pair<pybind11::kwargs, std::shared_ptr<RendezvousStore>> SplitStore(
    const pybind11::kwargs& kwargs);

}  // namespace stepmesh::python
