#pragma once
// Configuration of one mesh participant. Build it explicitly, or start from
// MeshOptions::FromEnv() which overlays STEPMESH_* (and StepMesh's DMLC_*)
// variables on a base; docs/configuration.md lists every name. Every field
// has one row in stepmesh/option_table.inc (its Python name, variable, check,
// default and meaning): a new field needs one there too.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "stepmesh/export.h"

namespace stepmesh {

enum class Role : uint8_t { kScheduler = 0, kWorker = 1, kServer = 2 };
STEPMESH_EXPORT absl::string_view RoleName(Role role);
// "worker", "server" or "scheduler"; INVALID_ARGUMENT naming `name` otherwise.
STEPMESH_EXPORT absl::StatusOr<Role> ParseRole(absl::string_view name);

// How the progress threads and Wait() look for work.
enum class PollMode : uint8_t {
  kSpin,      // never sleeps: lowest latency, burns a core per thread
  kAdaptive,  // spins for ThreadingOptions::spin_budget, then blocks; a wait site
              // whose recent waits mostly outlasted the budget blocks at once
  kBlocking,  // blocks in the kernel (epoll / condition variable)
};
STEPMESH_EXPORT absl::StatusOr<PollMode> ParsePollMode(absl::string_view name);
STEPMESH_EXPORT absl::string_view PollModeName(PollMode mode);

// Whether the RDMA transport moves device (GPU) tensors straight between the
// NIC and device memory (GPUDirect RDMA: a dma-buf MR, or a plain MR on a
// driver with nvidia-peermem) instead of staging them through pinned host memory.
enum class GpuDirect : uint8_t {
  kAuto,     // register device memory directly; stage a tensor the NIC refuses
  kOff,      // always stage
  kRequire,  // registering a device tensor fails rather than stage it
};
STEPMESH_EXPORT absl::StatusOr<GpuDirect> ParseGpuDirect(absl::string_view name);
STEPMESH_EXPORT absl::string_view GpuDirectName(GpuDirect mode);

// The RDMA transport's knobs (docs/rdma.md explains each; every one has a
// STEPMESH_RDMA_* variable, docs/configuration.md). The defaults suit RoCE v2
// and InfiniBand fabrics; empty / zero / negative means "choose automatically".
struct STEPMESH_EXPORT RdmaOptions {
  // Which NIC, port and address.
  std::string device;     // verbs device name ("mlx5_0") or a comma-separated list of the
                          // allowed ones; empty: the best active port of any
  int port = 0;           // 0: any active port
  int gid_index = -1;     // -1: automatic (RoCE v2 IPv4-mapped first, never link-local v2)
  std::string interface;  // RoCE: only GIDs inside this netdev's subnets ("eth2") or a
                          // CIDR ("10.0.0.0/24"); empty: any
  // Traffic class and reliability.
  int traffic_class = 0;  // GRH traffic class, DSCP << 2 (0..255)
  int service_level = 0;  // SL / priority (0..15)
  // InfiniBand partition key (NCCL_IB_PKEY's meaning): the QPs use the port's
  // P_Key table entry of this partition (low 15 bits; full membership
  // preferred); 0: table index 0, the default partition.
  int pkey = 0;
  int path_mtu = 0;        // bytes (256, 512, 1024, 2048, 4096); 0: the smaller active MTU
  int ack_timeout = 18;    // local ACK timeout, 4.096 us * 2^n per try (1..31): 18 = 1.07 s
  int retry_count = 7;     // transport retries after the first try (0..7)
  int rnr_retry = 3;       // 0..6; credits make an RNR a bug, 7 (= forever) is refused
  int min_rnr_timer = 12;  // responder's RNR NAK delay code (1..31)
  // Queues.
  int recv_depth = 256;                 // receives = credits = header-ring slots per QP (4..8192)
  int qps_per_peer = 1;                 // 2 stripes large payloads over two QPs (LAG ports)
  int64_t stripe_min_bytes = 64 << 10;  // with 2 QPs, payloads this large are striped (>= 8192)
  GpuDirect gpudirect = GpuDirect::kAuto;
  // IBV_ACCESS_RELAXED_ORDERING (PCIe relaxed ordering of the NIC's writes,
  // which many PCIe topologies need for full speed into GPU memory):
  // "auto": on the tensors' MRs (the provider drops it where the device has
  // none), "on": on every MR, the control blocks too, "off": never.
  std::string relaxed_ordering = "auto";
  // ibv_fork_init before the first registration: "auto": unless
  // ibv_is_fork_initialized says the kernel copies pinned pages on fork
  // itself (IBV_FORK_UNNEEDED), "on": always, "off": never (the process must
  // then not touch registered memory in a child it forks).
  std::string fork_init = "auto";

  // NIC choice by PCI topology. The PCI address of the accelerator this
  // participant drives ("0000:3b:00.0"); empty: the core fills it in from the
  // backend (Backend::Locate), so with CUDA it is the physical GPU behind the
  // CUDA index under CUDA_VISIBLE_DEVICES. Among equally good ports the NIC
  // nearest it on the PCI tree is chosen (sysfs, as NCCL does).
  std::string gpu_pci_bus_id;
  std::string sysfs_root = "/sys";  // tests point it at a fake tree

  absl::Status Validate() const;
};

// Whether a mesh insists on the shared secret (MeshOptions::auth_token).
enum class AuthMode : uint8_t {
  kAuto,  // required when a listener binds a non-loopback address (refused to
          // start without a token); on loopback only the scheduler warns
  kOn,    // required everywhere
  kOff,   // never required (a token that is set is still used); no warning
};
STEPMESH_EXPORT absl::StatusOr<AuthMode> ParseAuthMode(absl::string_view name);
STEPMESH_EXPORT absl::string_view AuthModeName(AuthMode mode);

// A fresh random secret for auth_token (64 hex digits from getrandom), for
// launchers that start every process of a mesh themselves.
STEPMESH_EXPORT absl::StatusOr<std::string> GenerateAuthToken();

struct ThreadingOptions {
  PollMode poll_mode = PollMode::kAdaptive;
  absl::Duration spin_budget = absl::Milliseconds(1);
  // Core ids for the send and receive threads; empty means unpinned.
  std::vector<int> send_cores;
  std::vector<int> recv_cores;
  // Pick cores near the device/NIC through hwloc (ignored when cores are given).
  bool auto_pin = false;
};

struct TraceOptions {
  bool enabled = true;  // stamps are cheap (a clock read each); off removes even that
  // Keep the stamps of the newest `events` requests (a worker: requests
  // completed; a server: requests answered) in a ring sized at creation, for
  // ChromeTraceJson(); 0: not recorded (the cost is then one branch per
  // request). Needs `enabled`.
  int events = 0;
};

// StepMesh's fserver_lib launch settings (DMLC_ROLE=joint, DMLC_GROUP_SIZE,
// DMLC_NODE_RANK, DMLC_RANK_OFFSET, DMLC_INSTANCE_ID, STEPMESH_GPU). The C++
// core ignores them; the fserver_lib drop-in (python/stepmesh/fserver.py)
// turns them into ranks, mesh sizes and meshes (docs/python.md).
struct FserverOptions {
  std::string role;      // DMLC_ROLE as given (worker, server, scheduler, joint); empty: unset
  int group_size = 1;    // instances (GPUs) per worker / server group, >= 1
  int node_rank = 0;     // the group's rank
  int rank_offset = 0;   // added to gpu for the instance rank and index
  int instance_id = -1;  // instance index in the group; -1: gpu + rank_offset
  int gpu = 0;           // StepMesh's device index
};

struct STEPMESH_EXPORT MeshOptions {
  Role role = Role::kWorker;
  int rank = -1;  // -1: the scheduler assigns one in arrival order
  // The start shape: the mesh forms once ranks [0, num_workers) and
  // [0, num_servers) joined.
  int num_workers = 1;
  int num_servers = 1;
  // The capacity (docs/elastic.md): ranks [0, max_workers) and
  // [0, max_servers) may be members of the running mesh, joining and leaving
  // while it decodes. 0: the start shape (nothing joins beyond it, as before
  // elastic membership). Every participant of a mesh gives the same; the
  // scheduler refuses one whose capacity differs. Per-peer state is sized for
  // it at creation: a server's receive and reply regions hold max_workers
  // slots, a worker addresses server ranks [0, max_servers); so a join
  // registers nothing new. The scheduler and etcd rendezvous change
  // membership; the framework store refuses a capacity above the start shape.
  int max_workers = 0;
  int max_servers = 0;
  int WorkerCapacity() const { return max_workers > 0 ? max_workers : num_workers; }
  int ServerCapacity() const { return max_servers > 0 ? max_servers : num_servers; }
  std::string scheduler = "127.0.0.1:9000";  // host:port of the rendezvous
  // Which rendezvous the mesh meets through (docs/deployment.md): empty or
  // "scheduler://HOST:PORT" (our scheduler; empty: at `scheduler`), or
  // "etcd://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/PREFIX]" (an etcd 3.4+
  // cluster; keys under PREFIX, default /stepmesh/<mesh_id or "default">).
  std::string rendezvous;
  std::string bind_host = "127.0.0.1";  // address the data listener binds
  // The host other participants dial to reach this one; empty: bind_host.
  std::string node_host;
  // A network interface ("eth2"): its address (IPv4 first) is bound and
  // advertised, overriding bind_host (node_host still wins for advertising);
  // an RDMA transport also takes it as rdma.interface when that is empty.
  // Resolved when a worker or server starts: an unknown name is an error
  // listing the interfaces found.
  std::string interface;

  // "tcp", "rdma", "libfabric" or "auto" (rdma when a device exists)
  std::string transport = "auto";
  // transport = "libfabric": the provider ("tcp", "shm", "efa", ...; empty:
  // the first with RMA and remote CQ data). docs/libfabric.md.
  std::string fi_provider;
  // transport = "libfabric": rails (one fabric domain + endpoint each) per
  // process; payloads of at least fi_stripe_min_bytes are split across the
  // rails a peer shares. 0: one per NIC (domain) the provider lists (EFA: every
  // EFA device); N > the NICs listed: rails share NICs round-robin.
  int fi_nics = 1;
  int64_t fi_stripe_min_bytes = 64 << 10;  // >= 4096
  // transport = "tcp": rails, one connection each per peer (docs/tcp.md): a
  // comma-separated list of this host's addresses or interface names, rail 0
  // first (at most 4); empty: one connection per peer, on bind_host. Payloads
  // of at least tcp_stripe_min_bytes are split across the rails both ends
  // have; a rail that fails hands its unacknowledged bytes to the others.
  std::string tcp_rails;
  int64_t tcp_stripe_min_bytes = 256 << 10;  // >= 4096
  std::string backend = "cpu_mock";          // "cpu_mock" or "cuda"
  int device = 0;
  // The process's CUDA_DEVICE_MAX_CONNECTIONS (0: not set). With 1 the cuda
  // backend never waits with stream memory operations (docs/cuda.md, rule 7).
  int cuda_device_max_connections = 0;

  RdmaOptions rdma;

  ThreadingOptions threads;
  absl::Duration timeout = absl::Seconds(30);            // connect, barrier, peer silence
  absl::Duration heartbeat_interval = absl::Seconds(1);  // scheduler liveness probes
  int max_inflight_requests = 64;                        // worker request slots (bounded pool)
  int max_registrations = 1024;                          // per participant
  std::string auth_token;           // shared secret (challenge-response, never sent)
  AuthMode auth = AuthMode::kAuto;  // when a missing auth_token is refused
  // Names the mesh: every participant's join carries it and the scheduler
  // refuses one that differs from its own (as it refuses another mesh shape).
  std::string mesh_id;
  // End-to-end CRC32C of every payload both ends can read (host memory): the
  // sender seals it in the frame, the receiver fails the request with
  // DATA_LOSS on a mismatch. Costs one pass over the bytes on each side
  // (~0.2 ms per 1.75 MiB); for chasing corruption, off in production.
  bool payload_checksum = false;
  TraceOptions trace;
  FserverOptions fserver;

  // `base` with every set STEPMESH_* / DMLC_* variable applied. Bad values are errors.
  static absl::StatusOr<MeshOptions> FromEnv(const MeshOptions& base);
  static absl::StatusOr<MeshOptions> FromEnv();
  // Each field against its row's check (option_table.inc), then the checks
  // across fields; INVALID_ARGUMENT naming the field and its variable.
  absl::Status Validate() const;
};

// The process's CUDA_DEVICE_MAX_CONNECTIONS (0 when unset), read through the
// one environment table; INVALID_ARGUMENT naming the variable for a bad value.
// CreateCudaBackend uses it when CudaBackendOptions::device_max_connections is 0.
STEPMESH_EXPORT absl::StatusOr<int> CudaDeviceMaxConnectionsFromEnv();

// The role STEPMESH_ROLE (or else DMLC_ROLE) names; nullopt when neither is
// set. Programs that run a whole mesh themselves unless told one role use it.
STEPMESH_EXPORT absl::StatusOr<std::optional<Role>> RoleFromEnv();

// The value of environment variable `name` (nullopt when unset), for layers
// that parse their own variables (the Python connector's AFD_*): only names of
// the one environment table, so each is documented; NOT_FOUND naming `name`
// for any other.
STEPMESH_EXPORT absl::StatusOr<std::optional<std::string>> EnvironmentValue(absl::string_view name);

}  // namespace stepmesh
