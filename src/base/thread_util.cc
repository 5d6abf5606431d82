#include "src/base/thread_util.h"

#include <hwloc.h>
#include <pthread.h>

#include "absl/strings/str_cat.h"
#include "src/base/logging.h"

namespace stepmesh::base {
namespace {

// RAII over an hwloc topology; loaded per use (threads start rarely).
class Topology {
 public:
  Topology() {
    if (hwloc_topology_init(&topology_) == 0 && hwloc_topology_load(topology_) == 0) {
      ok_ = true;
    }
  }
  ~Topology() { hwloc_topology_destroy(topology_); }
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;
  bool ok() const { return ok_; }
  hwloc_topology_t get() const { return topology_; }

 private:
  hwloc_topology_t topology_ = nullptr;
  bool ok_ = false;
};

}  // namespace

absl::Status BindCurrentThread(const std::vector<int>& cores) {
  if (cores.empty()) return absl::OkStatus();
  Topology topology;
  if (!topology.ok()) return absl::InternalError("hwloc topology failed to load");
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  const int num_pus = hwloc_get_nbobjs_by_type(topology.get(), HWLOC_OBJ_PU);
  for (int core : cores) {
    if (core >= num_pus) {
      hwloc_bitmap_free(set);
      return absl::InvalidArgumentError(
          absl::StrCat("core ", core, " does not exist (", num_pus, " PUs)"));
    }
    hwloc_obj_t pu = hwloc_get_obj_by_type(topology.get(), HWLOC_OBJ_PU, core);
    hwloc_bitmap_or(set, set, pu->cpuset);
  }
  const int rc = hwloc_set_cpubind(topology.get(), set, HWLOC_CPUBIND_THREAD);
  hwloc_bitmap_free(set);
  if (rc != 0) return absl::InternalError("hwloc_set_cpubind failed");
  return absl::OkStatus();
}

std::vector<int> PickProgressCores(int numa_node, int count) {
  Topology topology;
  if (!topology.ok()) return {};
  hwloc_obj_t scope = hwloc_get_root_obj(topology.get());
  if (numa_node >= 0) {
    hwloc_obj_t node = hwloc_get_numanode_obj_by_os_index(topology.get(), numa_node);
    if (node != nullptr) scope = node;
  }
  const int pus =
      hwloc_get_nbobjs_inside_cpuset_by_type(topology.get(), scope->cpuset, HWLOC_OBJ_PU);
  if (pus < 4 || count >= pus) return {};
  std::vector<int> cores;
  for (int i = pus - count; i < pus; ++i) {
    hwloc_obj_t pu =
        hwloc_get_obj_inside_cpuset_by_type(topology.get(), scope->cpuset, HWLOC_OBJ_PU, i);
    if (pu != nullptr) cores.push_back(static_cast<int>(pu->logical_index));
  }
  return cores;
}

std::thread StartNamedThread(std::string name, std::vector<int> cores, std::function<void()> body) {
  return std::thread([name = std::move(name), cores = std::move(cores), body = std::move(body)] {
    pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
    if (absl::Status s = BindCurrentThread(cores); !s.ok()) {
      STEPMESH_LOG(kWarning, "thread ", name, " left unpinned: ", s.ToString());
    }
    body();
  });
}

}  // namespace stepmesh::base
