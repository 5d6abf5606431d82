#include "tests/rdma/fake_verbs.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "src/base/sync.h"

namespace stepmesh::testing {

namespace {

struct FakeNic;
struct FakeContext;
struct FakePd;
struct FakeQp;

// Fake objects start with the ibv struct the caller sees, so a pointer to it
// converts back (the same trick providers use).
struct FakeChannel {
  ibv_comp_channel channel{};
  std::deque<ibv_cq*> events;
};

struct FakeCq {
  struct Entry {
    ibv_wc wc;
    uint32_t frees_sq_slots = 0;  // send completions: slots released when polled
  };
  ibv_cq cq{};
  FakeContext* ctx = nullptr;
  FakeChannel* channel = nullptr;
  int capacity = 0;
  std::deque<Entry> entries;
  bool armed = false;
  bool overflowed = false;
  uint32_t events_delivered = 0;
  uint32_t events_acked = 0;
  int users = 0;  // QPs attached
};

struct FakeMr {
  ibv_mr mr{};
  FakePd* pd = nullptr;
  int access = 0;
  uint64_t pinned = 0;  // host bytes it charged against RLIMIT_MEMLOCK
};

struct FakePd {
  ibv_pd pd{};
  FakeContext* ctx = nullptr;
  int users = 0;  // MRs and QPs
};

// Places `n` bytes at `dst` as a NIC's DMA does: every aligned 8-byte word in
// one piece (a CPU never sees half of one; the RDMA transport polls its credit
// mailbox, one such word, with an atomic load and no completion), the
// unaligned head and tail in any order. The words are relaxed atomic stores,
// so ThreadSanitizer sees what the hardware guarantees and no more: a polling
// atomic load of a whole word is not a race, a plain read of the data before
// its completion (or other ordering) still is, and nothing is suppressed.
void DmaWrite(std::byte* dst, const std::byte* src, size_t n) {
  if (n == 0) return;
  if (dst < src + n && src < dst + n) {  // overlapping: no real NIC does this
    std::memmove(dst, src, n);
    return;
  }
  const size_t head = std::min(n, (8 - reinterpret_cast<uintptr_t>(dst) % 8) % 8);
  std::memcpy(dst, src, head);
  size_t i = head;
  for (; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, src + i, 8);
    std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(dst + i))
        .store(word, std::memory_order_relaxed);
  }
  std::memcpy(dst + i, src + i, n - i);
}

// A posted send work request, as the NIC holds it until it executes.
struct PendingWr {
  uint64_t wr_id = 0;
  ibv_wr_opcode opcode = IBV_WR_RDMA_WRITE;
  bool signalled = false;
  uint32_t imm = 0;
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  std::vector<ibv_sge> sges;           // gathered at execution
  std::vector<std::byte> inline_data;  // copied at post time
  bool is_inline = false;
  uint64_t total = 0;
  absl::Time due = absl::InfinitePast();
  absl::Time first_try = absl::InfinitePast();  // when the NIC first sent it
};

struct FakeQp {
  ibv_qp qp{};
  FakeContext* ctx = nullptr;
  FakeCq* send_cq = nullptr;
  FakeCq* recv_cq = nullptr;
  FakePd* pd = nullptr;
  ibv_qp_cap cap{};  // as granted
  bool sq_sig_all = false;
  int access = 0;
  uint8_t port = 0;  // bound at INIT
  ibv_mtu path_mtu = IBV_MTU_256;
  uint32_t dest_qpn = 0;
  bool is_global = false;
  ibv_gid dest_gid{};
  uint16_t dest_lid = 0;
  uint8_t timeout = 0;  // local ACK timeout exponent; 0 = wait forever
  uint8_t retry_cnt = 0;
  uint32_t next_send_psn = 0;      // PSN of the next request we send
  uint32_t expected_recv_psn = 0;  // PSN we expect from the peer
  uint32_t sq_used = 0;            // slots held until a signalled CQE is polled
  uint32_t unsignalled_run = 0;    // executed WRs waiting for a signalled one
  std::deque<uint64_t> recv_queue;
  std::deque<PendingWr> pending;  // asynchronous mode: posted, not executed
  absl::Time last_due = absl::InfinitePast();
  bool held = false;
  bool drop = false;
  uint8_t lag_port = 0;                           // mlx5dv_modify_qp_lag_port; 0: never set
  uint16_t pkey = 0xFFFF;                         // the port's table entry at pkey_index (INIT)
  ibv_gid_type sgid_type = IBV_GID_TYPE_ROCE_V2;  // of the GRH's source GID (RTR)
};

struct FakePort {
  ibv_port_state state = IBV_PORT_ACTIVE;
  uint16_t lid = 0;
  std::vector<FakeGid> gids;
  std::vector<uint16_t> pkeys;
};

struct FakeNic {
  ibv_device device{};
  FakeNicSpec spec;
  std::vector<FakePort> ports;      // port p at index p - 1
  std::map<uint32_t, FakeQp*> qps;  // by qp_num
  std::map<uint32_t, FakeMr*> mrs_by_lkey;
  std::map<uint32_t, FakeMr*> mrs_by_rkey;
  std::vector<FakeContext*> contexts;
  absl::Time paused_until = absl::InfinitePast();
  bool ib() const { return spec.link_layer == IBV_LINK_LAYER_INFINIBAND; }
};

struct FakeContext {
  ibv_context context{};
  FakeNic* nic = nullptr;
  std::deque<ibv_async_event> async_events;
  std::vector<FakeQp*> qps;
};

ibv_gid Ipv4Gid(uint32_t ipv4) {
  ibv_gid gid{};
  gid.raw[10] = 0xFF;
  gid.raw[11] = 0xFF;
  for (int i = 0; i < 4; ++i) gid.raw[12 + i] = static_cast<uint8_t>(ipv4 >> (24 - 8 * i));
  return gid;
}
// fe80::<interface id>, the interface id derived from the address (like a MAC).
ibv_gid LinkLocalGid(uint32_t ipv4, uint8_t tag) {
  ibv_gid gid{};
  gid.raw[0] = 0xFE;
  gid.raw[1] = 0x80;
  gid.raw[8] = 0x02;
  gid.raw[11] = tag;
  for (int i = 0; i < 4; ++i) gid.raw[12 + i] = static_cast<uint8_t>(ipv4 >> (24 - 8 * i));
  return gid;
}

uint64_t MrBegin(const FakeMr* mr) { return reinterpret_cast<uintptr_t>(mr->mr.addr); }
uint32_t NextPow2(uint64_t n) {
  uint64_t p = 1;
  while (p < n) p <<= 1;
  return static_cast<uint32_t>(std::min<uint64_t>(p, uint64_t{1} << 31));
}

void Signal(int fd) {
  const uint64_t one = 1;
  (void)!::write(fd, &one, sizeof(one));
}
void Unsignal(int fd) {
  uint64_t value;
  (void)!::read(fd, &value, sizeof(value));
}

[[noreturn]] void Misuse(const char* what) {
  std::fprintf(stderr, "fake verbs misuse: %s\n", what);
  std::abort();
}

// What stops a request from being acknowledged right now.
enum class Blocked { kNo, kPaused, kNoAck };

}  // namespace

struct FakeFabric::State {
  explicit State(const FakeFabricOptions& o)
      : options(o), rng(o.seed != 0 ? o.seed : std::random_device{}()) {
    if (options.asynchronous) thread = std::thread([this] { Run(); });
  }
  ~State() {
    {
      ::stepmesh::base::MutexLock lock(&mu);
      stopping = true;
    }
    wake.Bump();
    if (thread.joinable()) thread.join();
  }

  const FakeFabricOptions options;
  mutable ::stepmesh::base::Mutex mu;
  std::vector<std::unique_ptr<FakeNic>> nics ABSL_GUARDED_BY(mu);
  uint32_t next_qpn ABSL_GUARDED_BY(mu) = 0x100;
  uint32_t next_key ABSL_GUARDED_BY(mu) = 1;
  uint16_t next_lid ABSL_GUARDED_BY(mu) = 1;
  FakeFabricStats stats ABSL_GUARDED_BY(mu);
  std::vector<std::pair<uintptr_t, size_t>> device_memory ABSL_GUARDED_BY(mu);
  bool dmabuf ABSL_GUARDED_BY(mu) = true;
  bool peer_memory ABSL_GUARDED_BY(mu) = false;
  int dmabuf_errno ABSL_GUARDED_BY(mu) = EOPNOTSUPP;
  bool fork_initialized ABSL_GUARDED_BY(mu) = false;
  bool copy_on_fork ABSL_GUARDED_BY(mu) = false;
  std::function<bool(const void*, size_t)> device_oracle ABSL_GUARDED_BY(mu);
  bool registered_any ABSL_GUARDED_BY(mu) = false;
  std::mt19937_64 rng ABSL_GUARDED_BY(mu);
  std::vector<FakeQp*> active ABSL_GUARDED_BY(mu);  // QPs with pending requests
  bool stopping ABSL_GUARDED_BY(mu) = false;
  std::atomic<bool> sleeping{false};
  ::stepmesh::base::WakeWord wake;
  std::thread thread;

  // ---- Addressing ----

  // The device range wholly containing [address, address + bytes), if any.
  const std::pair<uintptr_t, size_t>* DeviceRange(uintptr_t address, size_t bytes) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (const auto& range : device_memory) {
      if (address >= range.first && address + bytes <= range.first + range.second) return &range;
    }
    return nullptr;
  }
  // [address, address + bytes) lies wholly in device memory.
  bool InsideDevice(uintptr_t address, size_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return DeviceRange(address, bytes) != nullptr ||
           (device_oracle && device_oracle(reinterpret_cast<const void*>(address), bytes));
  }
  bool TouchesDevice(uintptr_t address, size_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (device_oracle && device_oracle(reinterpret_cast<const void*>(address), 1)) return true;
    for (const auto& [base, size] : device_memory) {
      if (address < base + size && base < address + bytes) return true;
    }
    return false;
  }

  FakeNic* NicNamed(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto& nic : nics) {
      if (nic->spec.name == name) return nic.get();
    }
    return nullptr;
  }
  FakeQp* QpNumbered(uint32_t qpn) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (const auto& nic : nics) {
      if (auto it = nic->qps.find(qpn); it != nic->qps.end()) return it->second;
    }
    return nullptr;
  }

  // The port `qp` addresses (by GID with a GRH, else by LID) and the
  // responder QP there, if it exists and is bound to that port.
  struct Target {
    FakeNic* nic = nullptr;
    FakePort* port = nullptr;
    FakeQp* qp = nullptr;
  };
  Target Responder(const FakeQp* qp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (auto& nic : nics) {
      for (size_t p = 0; p < nic->ports.size(); ++p) {
        FakePort& port = nic->ports[p];
        bool match = false;
        if (qp->is_global) {
          // RoCE v1 and v2 are different packets: only an entry of the
          // sender's GID type receives them.
          for (const FakeGid& g : port.gids) {
            match = match || (std::memcmp(&g.gid, &qp->dest_gid, sizeof(ibv_gid)) == 0 &&
                              g.type == qp->sgid_type);
          }
        } else {
          match = nic->ib() && port.lid == qp->dest_lid;
        }
        if (!match) continue;
        Target target{nic.get(), &port, nullptr};
        auto it = nic->qps.find(qp->dest_qpn);
        if (it != nic->qps.end() && it->second->port == p + 1) target.qp = it->second;
        return target;
      }
    }
    return {};
  }

  // ---- Completions ----

  void PushCqe(FakeCq* cq, const ibv_wc& wc, uint32_t frees) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (cq->overflowed) return;
    if (static_cast<int>(cq->entries.size()) >= cq->capacity) {
      cq->overflowed = true;
      ++stats.cq_overflows;
      ibv_async_event event{};
      event.event_type = IBV_EVENT_CQ_ERR;
      event.element.cq = &cq->cq;
      cq->ctx->async_events.push_back(event);
      Signal(cq->ctx->context.async_fd);
      for (FakeQp* qp : cq->ctx->qps) {
        if (qp->send_cq == cq || qp->recv_cq == cq) qp->qp.state = IBV_QPS_ERR;
      }
      return;
    }
    cq->entries.push_back({wc, frees});
    if (cq->armed && cq->channel != nullptr) {
      cq->armed = false;
      cq->channel->events.push_back(&cq->cq);
      ++cq->events_delivered;
      Signal(cq->channel->channel.fd);
    }
  }

  void SendCqe(FakeQp* qp, uint64_t wr_id, ibv_wc_status status, bool signalled)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ++qp->unsignalled_run;
    if (status == IBV_WC_WR_FLUSH_ERR) ++stats.flushed;
    // Errors (flushes included) always complete; successes only when asked to.
    if (!signalled && status == IBV_WC_SUCCESS) return;
    ibv_wc wc{};
    wc.wr_id = wr_id;
    wc.status = status;
    wc.opcode = IBV_WC_RDMA_WRITE;
    wc.qp_num = qp->qp.qp_num;
    const uint32_t frees = std::exchange(qp->unsignalled_run, 0);
    PushCqe(qp->send_cq, wc, frees);
  }

  void Deactivate(FakeQp* qp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    active.erase(std::remove(active.begin(), active.end(), qp), active.end());
  }

  // ERR: every request not yet executed, signalled or not, completes as
  // flushed (in order), then every posted receive.
  void MoveToError(FakeQp* qp) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    qp->qp.state = IBV_QPS_ERR;
    while (!qp->pending.empty()) {
      const uint64_t id = qp->pending.front().wr_id;
      qp->pending.pop_front();
      SendCqe(qp, id, IBV_WC_WR_FLUSH_ERR, true);
    }
    Deactivate(qp);
    while (!qp->recv_queue.empty()) {
      ibv_wc wc{};
      wc.wr_id = qp->recv_queue.front();
      qp->recv_queue.pop_front();
      wc.status = IBV_WC_WR_FLUSH_ERR;
      wc.opcode = IBV_WC_RECV;
      wc.qp_num = qp->qp.qp_num;
      ++stats.flushed;
      PushCqe(qp->recv_cq, wc, 0);
    }
  }

  void RaisePortEvent(FakeNic* nic, uint8_t port, ibv_event_type type)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (FakeContext* ctx : nic->contexts) {
      ibv_async_event event{};
      event.event_type = type;
      event.element.port_num = port;
      ctx->async_events.push_back(event);
      Signal(ctx->context.async_fd);
    }
  }

  // ---- Execution ----

  // 4.096 us * 2^timeout per try, retry_cnt retries after the first.
  absl::Duration RetryBudget(const FakeQp* qp) const {
    if (qp->timeout == 0) return absl::InfiniteDuration();
    return absl::Nanoseconds(4096) * (int64_t{1} << qp->timeout) * (qp->retry_cnt + 1);
  }

  // Whether `qp`'s next request could be acknowledged now.
  Blocked Check(const FakeQp* qp, absl::Time now, absl::Time* until)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const FakeNic* own = qp->ctx->nic;
    if (qp->drop || own->ports[qp->port - 1].state != IBV_PORT_ACTIVE) return Blocked::kNoAck;
    const Target target = Responder(qp);
    const FakeQp* peer = target.qp;
    if (target.port == nullptr || target.port->state != IBV_PORT_ACTIVE) return Blocked::kNoAck;
    if (peer == nullptr || (peer->qp.state != IBV_QPS_RTR && peer->qp.state != IBV_QPS_RTS) ||
        peer->dest_qpn != qp->qp.qp_num || peer->expected_recv_psn != qp->next_send_psn) {
      return Blocked::kNoAck;
    }
    // One partition, and not two limited members.
    if ((qp->pkey & 0x7FFF) != (peer->pkey & 0x7FFF) || ((qp->pkey | peer->pkey) & 0x8000) == 0) {
      return Blocked::kNoAck;
    }
    *until = std::max(own->paused_until, target.nic->paused_until);
    return *until > now ? Blocked::kPaused : Blocked::kNo;
  }

  // Executes one send request that can be acknowledged; returns its status.
  ibv_wc_status Execute(FakeQp* qp, const PendingWr& wr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    // Gather: inline data was copied at post time; otherwise every SGE must
    // sit inside a local MR of the QP's PD -- now, not when it was posted.
    if (!wr.is_inline) {
      for (const ibv_sge& sge : wr.sges) {
        if (sge.length == 0) continue;
        auto it = qp->ctx->nic->mrs_by_lkey.find(sge.lkey);
        if (it == qp->ctx->nic->mrs_by_lkey.end() || it->second->pd != qp->pd ||
            sge.addr < MrBegin(it->second) ||
            sge.addr + sge.length > MrBegin(it->second) + it->second->mr.length) {
          ++stats.access_errors;
          return IBV_WC_LOC_PROT_ERR;
        }
      }
    }
    if (wr.total > qp->ctx->nic->spec.max_msg_sz) {
      ++stats.length_errors;
      return IBV_WC_LOC_LEN_ERR;
    }
    const Target target = Responder(qp);
    FakeNic* nic = target.nic;
    FakeQp* peer = target.qp;
    // Remote access: rkey, PD, MR and QP access flags, bounds.
    if (wr.total > 0) {
      auto it = nic->mrs_by_rkey.find(wr.rkey);
      const bool ok = it != nic->mrs_by_rkey.end() && it->second->pd == peer->pd &&
                      (it->second->access & IBV_ACCESS_REMOTE_WRITE) &&
                      (peer->access & IBV_ACCESS_REMOTE_WRITE) &&
                      wr.remote_addr >= MrBegin(it->second) &&
                      wr.remote_addr + wr.total <= MrBegin(it->second) + it->second->mr.length;
      if (!ok) {
        ++stats.access_errors;
        MoveToError(peer);
        return IBV_WC_REM_ACCESS_ERR;
      }
    }
    if (wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM && peer->recv_queue.empty()) {
      ++stats.rnr_errors;
      return IBV_WC_RNR_RETRY_EXC_ERR;
    }
    // Place the data.
    auto* dst = reinterpret_cast<std::byte*>(wr.remote_addr);
    if (wr.is_inline) {
      DmaWrite(dst, wr.inline_data.data(), wr.inline_data.size());
    } else {
      for (const ibv_sge& sge : wr.sges) {
        DmaWrite(dst, reinterpret_cast<const std::byte*>(sge.addr), sge.length);
        dst += sge.length;
      }
    }
    ++stats.writes;
    stats.bytes_written += wr.total;
    const uint64_t mtu = 128u << qp->path_mtu;
    const uint32_t packets =
        static_cast<uint32_t>(std::max<uint64_t>(1, (wr.total + mtu - 1) / mtu));
    qp->next_send_psn = (qp->next_send_psn + packets) & 0xFFFFFF;
    peer->expected_recv_psn = (peer->expected_recv_psn + packets) & 0xFFFFFF;
    if (wr.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
      ibv_wc wc{};
      wc.wr_id = peer->recv_queue.front();
      peer->recv_queue.pop_front();
      wc.status = IBV_WC_SUCCESS;
      wc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
      wc.wc_flags = IBV_WC_WITH_IMM;
      wc.imm_data = wr.imm;
      wc.byte_len = static_cast<uint32_t>(wr.total);
      wc.qp_num = peer->qp.qp_num;
      wc.src_qp = qp->qp.qp_num;
      PushCqe(peer->recv_cq, wc, 0);
    }
    return IBV_WC_SUCCESS;
  }

  void Complete(FakeQp* qp, const PendingWr& wr, ibv_wc_status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    SendCqe(qp, wr.wr_id, status, wr.signalled);
    if (status != IBV_WC_SUCCESS) MoveToError(qp);
  }

  // Synchronous mode: the request executes inside PostSend.
  void RunNow(FakeQp* qp, const PendingWr& wr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    absl::Time until;
    if (Check(qp, absl::Now(), &until) == Blocked::kNoAck) {
      ++stats.retry_errors;
      return Complete(qp, wr, IBV_WC_RETRY_EXC_ERR);
    }
    Complete(qp, wr, Execute(qp, wr));
  }

  // Asynchronous mode: one step of the head request of `qp`.
  void Step(FakeQp* qp, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    PendingWr& wr = qp->pending.front();
    if (wr.first_try == absl::InfinitePast()) wr.first_try = now;
    const absl::Time give_up = wr.first_try + RetryBudget(qp);
    absl::Time until = absl::InfinitePast();
    const Blocked blocked = Check(qp, now, &until);
    if (blocked != Blocked::kNo) {
      if (now >= give_up) {
        ++stats.retry_errors;
        const PendingWr failed = std::move(wr);
        qp->pending.pop_front();
        return Complete(qp, failed, IBV_WC_RETRY_EXC_ERR);
      }
      // Retransmissions go on until the pause ends or the budget is spent;
      // a silent peer is looked at again every millisecond.
      wr.due = blocked == Blocked::kPaused ? std::min(until, give_up)
                                           : std::min(give_up, now + absl::Milliseconds(1));
      return;
    }
    const PendingWr current = std::move(wr);
    qp->pending.pop_front();
    if (qp->pending.empty()) Deactivate(qp);
    Complete(qp, current, Execute(qp, current));
  }

  void Enqueue(FakeQp* qp, PendingWr wr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const int64_t span = absl::ToInt64Nanoseconds(options.max_delay);
    const absl::Time now = absl::Now();
    absl::Time due = now + absl::Nanoseconds(span > 0 ? static_cast<int64_t>(rng() % span) : 0);
    due = std::max(due, qp->last_due);  // FIFO within the QP
    qp->last_due = due;
    wr.due = due;
    if (qp->pending.empty()) active.push_back(qp);
    qp->pending.push_back(std::move(wr));
    if (sleeping.load(std::memory_order_seq_cst)) wake.Bump();
  }

  // The fabric thread.
  void Run() {
    std::vector<FakeQp*> ready;
    for (;;) {
      absl::Time next = absl::InfiniteFuture();
      absl::Time now;
      uint32_t seen;
      {
        ::stepmesh::base::MutexLock lock(&mu);
        if (stopping) return;
        now = absl::Now();
        ready.clear();
        for (FakeQp* qp : active) {
          if (qp->held) continue;
          const absl::Time due = qp->pending.front().due;
          if (due <= now) {
            ready.push_back(qp);
          } else {
            next = std::min(next, due);
          }
        }
        if (!ready.empty()) {
          Step(ready[rng() % ready.size()], now);
          continue;
        }
        sleeping.store(true, std::memory_order_seq_cst);
        seen = wake.Load();
      }
      wake.WaitWhile(seen, std::min(next - now, absl::Milliseconds(20)));
      sleeping.store(false, std::memory_order_relaxed);
    }
  }
};

namespace {

// One host's view of the fabric: its NICs only.
class FakeVerbs final : public VerbsApi {
 public:
  using State = FakeFabric::State;
  FakeVerbs(std::shared_ptr<State> state, std::vector<FakeNic*> nics, FakeHostSpec host)
      : state_(std::move(state)), nics_(std::move(nics)), host_(host) {}

  ibv_fork_status IsForkInitialized() override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    if (state_->copy_on_fork) return IBV_FORK_UNNEEDED;
    return state_->fork_initialized ? IBV_FORK_ENABLED : IBV_FORK_DISABLED;
  }
  int GetMemlockLimit(uint64_t* bytes) override {
    *bytes = host_.memlock_limit;
    return 0;
  }
  int QueryPkey(ibv_context* context, uint8_t port, int index, uint16_t* pkey) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeNic* nic = Ctx(context)->nic;
    if (port < 1 || port > nic->ports.size()) return EINVAL;
    const FakePort& p = nic->ports[port - 1];
    if (index < 0 || static_cast<size_t>(index) >= p.pkeys.size()) return EINVAL;
    *pkey = p.pkeys[static_cast<size_t>(index)];
    return 0;
  }

  int ForkInit() override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    ++state_->stats.fork_init_calls;
    if (state_->fork_initialized) return 0;
    // rdma-core: too late once memory was registered without it.
    if (state_->registered_any) return EINVAL;
    state_->fork_initialized = true;
    return 0;
  }

  ibv_device** GetDeviceList(int* num_devices) override {
    auto** list = new ibv_device*[nics_.size() + 1];
    for (size_t i = 0; i < nics_.size(); ++i) list[i] = &nics_[i]->device;
    list[nics_.size()] = nullptr;
    if (num_devices != nullptr) *num_devices = static_cast<int>(nics_.size());
    return list;
  }
  void FreeDeviceList(ibv_device** list) override { delete[] list; }
  const char* GetDeviceName(ibv_device* device) override { return device->name; }

  ibv_context* OpenDevice(ibv_device* device) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    auto* ctx = new FakeContext;
    ctx->nic = Nic(device);
    ctx->context.device = device;
    ctx->context.async_fd = ::eventfd(0, EFD_NONBLOCK | EFD_SEMAPHORE | EFD_CLOEXEC);
    ctx->context.num_comp_vectors = 1;
    ctx->nic->contexts.push_back(ctx);
    return &ctx->context;
  }
  int CloseDevice(ibv_context* context) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeContext* ctx = Ctx(context);
    if (!ctx->qps.empty()) return EBUSY;
    auto& list = ctx->nic->contexts;
    list.erase(std::find(list.begin(), list.end(), ctx));
    ::close(ctx->context.async_fd);
    delete ctx;
    return 0;
  }
  int QueryDevice(ibv_context* context, ibv_device_attr* attr) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    const FakeNicSpec& spec = Ctx(context)->nic->spec;
    *attr = {};
    attr->max_qp = 1 << 16;
    attr->max_qp_wr = spec.max_qp_wr;
    attr->max_sge = 30;
    attr->max_cq = 1 << 16;
    attr->max_cqe = spec.max_cqe;
    attr->max_mr = 1 << 20;
    attr->max_pd = 1 << 16;
    attr->max_mr_size = uint64_t{1} << 40;
    attr->phys_port_cnt = spec.ports;
    return 0;
  }
  int QueryPort(ibv_context* context, uint8_t port, ibv_port_attr* attr) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeNic* nic = Ctx(context)->nic;
    if (port < 1 || port > nic->ports.size()) return EINVAL;
    const FakePort& p = nic->ports[port - 1];
    *attr = {};
    attr->state = p.state;
    attr->max_mtu = IBV_MTU_4096;
    attr->active_mtu = nic->spec.active_mtu;
    attr->gid_tbl_len = static_cast<int>(p.gids.size());
    attr->link_layer = nic->spec.link_layer;
    attr->max_msg_sz = static_cast<uint32_t>(std::min<uint64_t>(nic->spec.max_msg_sz, UINT32_MAX));
    attr->lid = p.lid;
    return 0;
  }
  int QueryGidEx(ibv_context* context, uint8_t port, uint32_t index,
                 ibv_gid_entry* entry) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeNic* nic = Ctx(context)->nic;
    if (port < 1 || port > nic->ports.size()) return EINVAL;
    const FakePort& p = nic->ports[port - 1];
    if (index >= p.gids.size()) return ENODATA;
    *entry = {};
    entry->gid = p.gids[index].gid;
    entry->gid_index = index;
    entry->port_num = port;
    entry->gid_type = p.gids[index].type;
    return 0;
  }

  ibv_pd* AllocPd(ibv_context* context) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    auto* pd = new FakePd;
    pd->ctx = Ctx(context);
    pd->pd.context = context;
    return &pd->pd;
  }
  int DeallocPd(ibv_pd* pd) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakePd* fake = Pd(pd);
    if (fake->users != 0) return EBUSY;
    delete fake;
    return 0;
  }
  ibv_mr* RegMr(ibv_pd* pd, void* addr, size_t length, int access) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    if (addr == nullptr || length == 0) {
      errno = EINVAL;
      return nullptr;
    }
    const bool device = state_->TouchesDevice(reinterpret_cast<uintptr_t>(addr), length);
    if (!state_->peer_memory && device) {
      errno = EFAULT;  // get_user_pages cannot pin GPU memory without peer memory
      return nullptr;
    }
    // Host pages are pinned against RLIMIT_MEMLOCK, every MR on its own.
    const uint64_t pages = device ? 0 : PinnedBytes(addr, length);
    if (pages > 0 && (pinned_ + pages > host_.memlock_limit || pinned_ + pages < pinned_)) {
      ++state_->stats.memlock_refusals;
      errno = ENOMEM;
      return nullptr;
    }
    ibv_mr* mr = NewMr(pd, addr, length, access);
    if (mr == nullptr) return nullptr;
    if (device) ++state_->stats.peer_memory_mrs;
    reinterpret_cast<FakeMr*>(mr)->pinned = pages;
    pinned_ += pages;
    state_->stats.peak_pinned_bytes = std::max(state_->stats.peak_pinned_bytes, pinned_);
    return mr;
  }
  ibv_mr* RegDmabufMr(ibv_pd* pd, uint64_t offset, size_t length, uint64_t iova, int fd,
                      int access) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    if (!state_->dmabuf) {
      errno = state_->dmabuf_errno;
      return nullptr;
    }
    if (fd < 0 || ::fcntl(fd, F_GETFD) == -1) {
      errno = EBADF;
      return nullptr;
    }
    // The buffer was exported from a page-aligned start inside device memory;
    // iova - offset must land there, or the MR would map other memory.
    const uintptr_t export_start = static_cast<uintptr_t>(iova - offset);
    if (length == 0 || offset > iova || export_start % 4096 != 0 ||
        !state_->InsideDevice(export_start, static_cast<size_t>(iova + length - export_start))) {
      errno = EINVAL;
      return nullptr;
    }
    ibv_mr* mr = NewMr(pd, reinterpret_cast<void*>(static_cast<uintptr_t>(iova)), length, access);
    if (mr != nullptr) ++state_->stats.dmabuf_mrs;
    return mr;
  }
  int DeregMr(ibv_mr* mr) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    auto* fake = reinterpret_cast<FakeMr*>(mr);
    pinned_ -= fake->pinned;
    FakeNic* nic = fake->pd->ctx->nic;
    nic->mrs_by_lkey.erase(mr->lkey);
    nic->mrs_by_rkey.erase(mr->rkey);
    --fake->pd->users;
    delete fake;
    return 0;
  }

  ibv_comp_channel* CreateCompChannel(ibv_context* context) override {
    auto* channel = new FakeChannel;
    channel->channel.context = context;
    channel->channel.fd = ::eventfd(0, EFD_NONBLOCK | EFD_SEMAPHORE | EFD_CLOEXEC);
    return &channel->channel;
  }
  int DestroyCompChannel(ibv_comp_channel* channel) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    if (channel->refcnt != 0) return EBUSY;
    ::close(channel->fd);
    delete reinterpret_cast<FakeChannel*>(channel);
    return 0;
  }
  ibv_cq* CreateCq(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel,
                   int comp_vector) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeContext* ctx = Ctx(context);
    if (cqe <= 0 || cqe > ctx->nic->spec.max_cqe || comp_vector != 0) {
      errno = EINVAL;
      return nullptr;
    }
    auto* cq = new FakeCq;
    cq->ctx = ctx;
    cq->capacity = cqe;
    cq->channel = reinterpret_cast<FakeChannel*>(channel);
    if (channel != nullptr) ++channel->refcnt;
    cq->cq.context = context;
    cq->cq.channel = channel;
    cq->cq.cq_context = cq_context;
    cq->cq.cqe = cqe;
    return &cq->cq;
  }
  int DestroyCq(ibv_cq* cq) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeCq* fake = Cq(cq);
    if (fake->users != 0 || fake->events_acked != fake->events_delivered) return EBUSY;
    if (fake->channel != nullptr) {
      --fake->channel->channel.refcnt;
      auto& events = fake->channel->events;
      events.erase(std::remove(events.begin(), events.end(), cq), events.end());
    }
    delete fake;
    return 0;
  }
  int ReqNotifyCq(ibv_cq* cq, int solicited_only) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeCq* fake = Cq(cq);
    if (fake->channel == nullptr) return EINVAL;
    fake->armed = true;
    return 0;
  }
  int GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    auto* fake = reinterpret_cast<FakeChannel*>(channel);
    if (fake->events.empty()) {
      errno = EAGAIN;  // the transport reads only after the fd polled readable
      return -1;
    }
    Unsignal(channel->fd);
    *cq = fake->events.front();
    fake->events.pop_front();
    *cq_context = (*cq)->cq_context;
    return 0;
  }
  void AckCqEvents(ibv_cq* cq, unsigned int nevents) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    Cq(cq)->events_acked += nevents;
  }
  int PollCq(ibv_cq* cq, int num_entries, ibv_wc* wc) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeCq* fake = Cq(cq);
    if (fake->overflowed) return -EOVERFLOW;
    int n = 0;
    while (n < num_entries && !fake->entries.empty()) {
      const FakeCq::Entry& entry = fake->entries.front();
      wc[n++] = entry.wc;
      if (entry.frees_sq_slots > 0) {
        auto it = fake->ctx->nic->qps.find(entry.wc.qp_num);
        if (it != fake->ctx->nic->qps.end()) it->second->sq_used -= entry.frees_sq_slots;
      }
      fake->entries.pop_front();
    }
    return n;
  }

  ibv_qp* CreateQp(ibv_pd* pd, ibv_qp_init_attr* attr) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakePd* fake_pd = Pd(pd);
    const FakeNicSpec& spec = fake_pd->ctx->nic->spec;
    ibv_qp_cap& cap = attr->cap;
    if (attr->qp_type != IBV_QPT_RC || attr->send_cq == nullptr || attr->recv_cq == nullptr ||
        attr->srq != nullptr || cap.max_send_wr == 0 ||
        cap.max_send_wr > static_cast<uint32_t>(spec.max_qp_wr) ||
        cap.max_recv_wr > static_cast<uint32_t>(spec.max_qp_wr) || cap.max_send_sge > 30 ||
        cap.max_recv_sge > 30 || cap.max_inline_data > spec.max_inline_data) {
      errno = EINVAL;
      return nullptr;
    }
    if (!spec.exact_grants) {
      // mlx5: a WQE holds control and remote-address segments plus the inline
      // data or the gather list, in 64-byte blocks; the queue is a power of
      // two of bytes, and every WQE that fits counts as granted.
      const uint32_t data = std::max(cap.max_inline_data > 0 ? cap.max_inline_data + 4 : 0,
                                     16 * std::max<uint32_t>(1, cap.max_send_sge));
      const uint32_t wqe = (32 + data + 63) / 64 * 64;
      cap.max_inline_data = std::min<uint32_t>(spec.max_inline_data, wqe - 36);
      const uint32_t queue = NextPow2(uint64_t{cap.max_send_wr} * wqe);
      cap.max_send_wr = std::min<uint32_t>(queue / wqe, spec.max_qp_wr);
      if (cap.max_recv_wr > 0) {
        cap.max_recv_wr = std::min<uint32_t>(NextPow2(cap.max_recv_wr), spec.max_qp_wr);
      }
    }
    auto* qp = new FakeQp;
    qp->ctx = fake_pd->ctx;
    qp->pd = fake_pd;
    qp->send_cq = Cq(attr->send_cq);
    qp->recv_cq = Cq(attr->recv_cq);
    qp->cap = cap;
    qp->sq_sig_all = attr->sq_sig_all != 0;
    qp->qp.context = pd->context;
    qp->qp.qp_context = attr->qp_context;
    qp->qp.pd = pd;
    qp->qp.send_cq = attr->send_cq;
    qp->qp.recv_cq = attr->recv_cq;
    qp->qp.qp_num = state_->next_qpn++;
    qp->qp.state = IBV_QPS_RESET;
    qp->qp.qp_type = IBV_QPT_RC;
    ++fake_pd->users;
    ++qp->send_cq->users;
    ++qp->recv_cq->users;
    fake_pd->ctx->nic->qps[qp->qp.qp_num] = qp;
    fake_pd->ctx->qps.push_back(qp);
    return &qp->qp;
  }

  int QueryLagPorts(ibv_context* context, uint8_t* num_lag_ports) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    const uint8_t lag = Ctx(context)->nic->spec.lag_ports;
    if (lag == 0) return EOPNOTSUPP;
    *num_lag_ports = lag;
    return 0;
  }
  int ModifyQpLagPort(ibv_qp* qp, uint8_t port) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeQp* fake = Qp(qp);
    const uint8_t lag = fake->ctx->nic->spec.lag_ports;
    if (lag < 2) return EOPNOTSUPP;  // "not in LAG mode"
    // A later state change may re-pick the port, so only RTS is accepted here.
    if (fake->qp.state != IBV_QPS_RTS || port < 1 || port > lag) return EINVAL;
    fake->lag_port = port;
    return 0;
  }
  int QueryQpLagPort(ibv_qp* qp, uint8_t* port, uint8_t* active_port) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeQp* fake = Qp(qp);
    if (fake->ctx->nic->spec.lag_ports < 2) return EOPNOTSUPP;
    *port = fake->lag_port;
    *active_port = fake->lag_port == 0 ? 1 : fake->lag_port;
    return 0;
  }

  int ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int mask) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeQp* fake = Qp(qp);
    FakeNic* nic = fake->ctx->nic;
    if (!(mask & IBV_QP_STATE)) return EINVAL;
    const ibv_qp_state from = fake->qp.state;
    const ibv_qp_state to = attr->qp_state;
    auto has = [mask](int needed) { return (mask & needed) == needed; };
    if (to == IBV_QPS_ERR) {
      state_->MoveToError(fake);
      return 0;
    }
    if (to == IBV_QPS_RESET) {
      fake->qp.state = IBV_QPS_RESET;
      fake->recv_queue.clear();
      fake->pending.clear();
      state_->Deactivate(fake);
      fake->sq_used = 0;
      fake->unsignalled_run = 0;
      return 0;
    }
    if (to == IBV_QPS_INIT && (from == IBV_QPS_RESET || from == IBV_QPS_INIT)) {
      if (from == IBV_QPS_RESET && !has(IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) {
        return EINVAL;
      }
      if (mask & IBV_QP_PORT) {
        if (attr->port_num < 1 || attr->port_num > nic->ports.size()) return EINVAL;
        fake->port = attr->port_num;
      }
      if (mask & IBV_QP_ACCESS_FLAGS) fake->access = attr->qp_access_flags;
      if (mask & IBV_QP_PKEY_INDEX) {
        const FakePort& port = nic->ports[fake->port - 1];
        if (attr->pkey_index >= port.pkeys.size()) return EINVAL;
        fake->pkey = port.pkeys[attr->pkey_index];
      }
      fake->qp.state = IBV_QPS_INIT;
      return 0;
    }
    if (to == IBV_QPS_RTR && from == IBV_QPS_INIT) {
      if (!has(IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) {
        return EINVAL;
      }
      const ibv_ah_attr& ah = attr->ah_attr;
      if (ah.port_num != fake->port) return EINVAL;
      const FakePort& port = nic->ports[fake->port - 1];
      if (ah.is_global && ah.grh.sgid_index >= port.gids.size()) return EINVAL;
      if (ah.is_global) fake->sgid_type = port.gids[ah.grh.sgid_index].type;
      if (nic->ib()) {
        if (ah.dlid == 0) return EINVAL;  // InfiniBand routes by LID
      } else if (!ah.is_global) {
        return EINVAL;  // RoCE: the address vector must carry a GRH
      }
      if (attr->path_mtu > nic->spec.active_mtu || attr->path_mtu < IBV_MTU_256) {
        return EINVAL;
      }
      fake->path_mtu = attr->path_mtu;
      fake->dest_qpn = attr->dest_qp_num;
      fake->is_global = ah.is_global != 0;
      fake->dest_gid = ah.grh.dgid;
      fake->dest_lid = ah.dlid;
      fake->expected_recv_psn = attr->rq_psn & 0xFFFFFF;
      fake->qp.state = IBV_QPS_RTR;
      return 0;
    }
    if (to == IBV_QPS_RTS && from == IBV_QPS_RTR) {
      if (!has(IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
               IBV_QP_MAX_QP_RD_ATOMIC)) {
        return EINVAL;
      }
      if (attr->retry_cnt > 7 || attr->rnr_retry > 7 || attr->timeout > 31) return EINVAL;
      fake->timeout = attr->timeout;
      fake->retry_cnt = attr->retry_cnt;
      fake->next_send_psn = attr->sq_psn & 0xFFFFFF;
      fake->qp.state = IBV_QPS_RTS;
      return 0;
    }
    return EINVAL;
  }

  int DestroyQp(ibv_qp* qp) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeQp* fake = Qp(qp);
    state_->Deactivate(fake);
    fake->ctx->nic->qps.erase(fake->qp.qp_num);
    auto& list = fake->ctx->qps;
    list.erase(std::find(list.begin(), list.end(), fake));
    --fake->pd->users;
    --fake->send_cq->users;
    --fake->recv_cq->users;
    delete fake;
    return 0;
  }

  int PostSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeQp* fake = Qp(qp);
    for (; wr != nullptr; wr = wr->next) {
      const ibv_qp_state state = fake->qp.state;
      if (state != IBV_QPS_RTS && state != IBV_QPS_ERR) return Bad(bad_wr, wr, EINVAL);
      if (wr->opcode != IBV_WR_RDMA_WRITE && wr->opcode != IBV_WR_RDMA_WRITE_WITH_IMM) {
        return Bad(bad_wr, wr, EINVAL);  // the only opcodes the transport may use
      }
      if (wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM && fake->ctx->nic->spec.iwarp) {
        return Bad(bad_wr, wr, EINVAL);  // iWARP carries no immediate data
      }
      if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > fake->cap.max_send_sge) {
        return Bad(bad_wr, wr, EINVAL);
      }
      PendingWr pending;
      pending.wr_id = wr->wr_id;
      pending.opcode = wr->opcode;
      pending.imm = wr->imm_data;
      pending.remote_addr = wr->wr.rdma.remote_addr;
      pending.rkey = wr->wr.rdma.rkey;
      pending.is_inline = (wr->send_flags & IBV_SEND_INLINE) != 0;
      for (int i = 0; i < wr->num_sge; ++i) pending.total += wr->sg_list[i].length;
      if (pending.is_inline && pending.total > fake->cap.max_inline_data) {
        return Bad(bad_wr, wr, EINVAL);
      }
      if (fake->sq_used >= fake->cap.max_send_wr) return Bad(bad_wr, wr, ENOMEM);
      ++fake->sq_used;
      pending.signalled = fake->sq_sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
      if (state == IBV_QPS_ERR) {
        state_->SendCqe(fake, wr->wr_id, IBV_WC_WR_FLUSH_ERR, true);
        continue;
      }
      if (pending.is_inline) {
        // The NIC copies inline data when the request is posted.
        for (int i = 0; i < wr->num_sge; ++i) {
          const auto* from = reinterpret_cast<const std::byte*>(wr->sg_list[i].addr);
          pending.inline_data.insert(pending.inline_data.end(), from, from + wr->sg_list[i].length);
        }
      } else {
        pending.sges.assign(wr->sg_list, wr->sg_list + wr->num_sge);
      }
      if (state_->options.asynchronous) {
        state_->Enqueue(fake, std::move(pending));
      } else {
        state_->RunNow(fake, pending);
      }
    }
    return 0;
  }

  int PostRecv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeQp* fake = Qp(qp);
    for (; wr != nullptr; wr = wr->next) {
      if (fake->qp.state == IBV_QPS_RESET) return Bad(bad_wr, wr, EINVAL);
      if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > fake->cap.max_recv_sge) {
        return Bad(bad_wr, wr, EINVAL);
      }
      if (fake->recv_queue.size() >= fake->cap.max_recv_wr) return Bad(bad_wr, wr, ENOMEM);
      fake->recv_queue.push_back(wr->wr_id);
      if (fake->qp.state == IBV_QPS_ERR) state_->MoveToError(fake);
    }
    return 0;
  }

  int GetAsyncEvent(ibv_context* context, ibv_async_event* event) override {
    ::stepmesh::base::MutexLock lock(&state_->mu);
    FakeContext* ctx = Ctx(context);
    if (ctx->async_events.empty()) {
      errno = EAGAIN;
      return -1;
    }
    Unsignal(context->async_fd);
    *event = ctx->async_events.front();
    ctx->async_events.pop_front();
    return 0;
  }
  void AckAsyncEvent(ibv_async_event*) override {}

 private:
  template <typename Wr>
  static int Bad(Wr** bad_wr, Wr* wr, int err) {
    if (bad_wr != nullptr) *bad_wr = wr;
    return err;
  }
  FakeNic* Nic(ibv_device* device) {
    for (FakeNic* nic : nics_) {
      if (&nic->device == device) return nic;
    }
    return nullptr;
  }
  // The MR both registration calls make once their own checks passed.
  ibv_mr* NewMr(ibv_pd* pd, void* addr, size_t length, int access)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_->mu) {
    // Remote write (or atomic) access requires local write, as in the kernel.
    if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
        !(access & IBV_ACCESS_LOCAL_WRITE)) {
      errno = EINVAL;
      return nullptr;
    }
    if (!state_->fork_initialized) ++state_->stats.registrations_before_fork_init;
    if (state_->fork_initialized && !state_->copy_on_fork) ++state_->stats.dontfork_registrations;
    if (access & IBV_ACCESS_RELAXED_ORDERING) ++state_->stats.relaxed_ordering_mrs;
    state_->registered_any = true;
    FakePd* fake_pd = Pd(pd);
    auto* mr = new FakeMr;
    mr->pd = fake_pd;
    mr->access = access;
    mr->mr.context = pd->context;
    mr->mr.pd = pd;
    mr->mr.addr = addr;
    mr->mr.length = length;
    const uint32_t n = state_->next_key++;
    mr->mr.lkey = n;
    mr->mr.rkey = 0x40000000u | (n * 7919u);  // never equal to any lkey
    ++fake_pd->users;
    FakeNic* nic = fake_pd->ctx->nic;
    nic->mrs_by_lkey[mr->mr.lkey] = mr;
    nic->mrs_by_rkey[mr->mr.rkey] = mr;
    return &mr->mr;
  }

  static uint64_t PinnedBytes(const void* addr, size_t length) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(addr) & ~uintptr_t{4095};
    const uintptr_t end = (reinterpret_cast<uintptr_t>(addr) + length + 4095) & ~uintptr_t{4095};
    return end - begin;
  }
  static FakeContext* Ctx(ibv_context* c) { return reinterpret_cast<FakeContext*>(c); }
  static FakePd* Pd(ibv_pd* p) { return reinterpret_cast<FakePd*>(p); }
  static FakeCq* Cq(ibv_cq* c) { return reinterpret_cast<FakeCq*>(c); }
  static FakeQp* Qp(ibv_qp* q) { return reinterpret_cast<FakeQp*>(q); }

  std::shared_ptr<State> state_;
  std::vector<FakeNic*> nics_;
  const FakeHostSpec host_;
  uint64_t pinned_ = 0;  // guarded by state_->mu  // host bytes pinned by this host's MRs
};

}  // namespace

FakeFabric::FakeFabric(FakeFabricOptions options) : state_(std::make_shared<State>(options)) {}
FakeFabric::~FakeFabric() = default;

bool FakeFabric::asynchronous() const { return state_->options.asynchronous; }

std::shared_ptr<VerbsApi> FakeFabric::AddHost(const FakeNicSpec& spec) {
  return AddHost(std::vector<FakeNicSpec>{spec});
}

void FakeFabric::SetDeviceMemoryOracle(std::function<bool(const void*, size_t)> is_device) {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  state_->device_oracle = std::move(is_device);
}

void FakeFabric::SetKernelCopyOnFork(bool copy_on_fork) {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  state_->copy_on_fork = copy_on_fork;
}

std::shared_ptr<VerbsApi> FakeFabric::AddHost(const std::vector<FakeNicSpec>& specs,
                                              const FakeHostSpec& host) {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  std::vector<FakeNic*> nics;
  for (const FakeNicSpec& spec : specs) {
    auto nic = std::make_unique<FakeNic>();
    nic->spec = spec;
    std::snprintf(nic->device.name, sizeof(nic->device.name), "%s", spec.name.c_str());
    nic->device.node_type = spec.iwarp ? IBV_NODE_RNIC : IBV_NODE_CA;
    nic->device.transport_type = spec.iwarp ? IBV_TRANSPORT_IWARP : IBV_TRANSPORT_IB;
    for (uint8_t p = 1; p <= std::max<uint8_t>(1, spec.ports); ++p) {
      FakePort port;
      port.state = spec.port_state;
      const uint32_t ip = spec.ipv4 + ((p - 1u) << 8);
      if (nic->ib()) {
        port.lid = spec.lid != 0 ? static_cast<uint16_t>(spec.lid + p - 1) : state_->next_lid++;
        port.gids.push_back({LinkLocalGid(ip, p), IBV_GID_TYPE_IB});
      } else if (!spec.gids.empty()) {
        port.gids = spec.gids;
      } else {
        port.gids = {{LinkLocalGid(ip, p), IBV_GID_TYPE_ROCE_V1},
                     {LinkLocalGid(ip, p), IBV_GID_TYPE_ROCE_V2},
                     {Ipv4Gid(ip), IBV_GID_TYPE_ROCE_V1},
                     {Ipv4Gid(ip), IBV_GID_TYPE_ROCE_V2}};
      }
      port.pkeys = spec.pkeys;
      nic->ports.push_back(port);
    }
    nic->spec.ports = static_cast<uint8_t>(nic->ports.size());
    nics.push_back(nic.get());
    state_->nics.push_back(std::move(nic));
  }
  return std::make_shared<FakeVerbs>(state_, std::move(nics), host);
}

void FakeFabric::FailNic(const std::string& name) {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  for (auto& nic : state_->nics) {
    if (nic->spec.name != name) continue;
    for (auto& [qpn, qp] : nic->qps) state_->MoveToError(qp);
  }
}

void FakeFabric::InjectPortEvent(const std::string& name, uint8_t port, ibv_event_type type) {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  FakeNic* nic = state_->NicNamed(name);
  if (nic == nullptr || port < 1 || port > nic->ports.size())
    Misuse("InjectPortEvent: no such port");
  if (type == IBV_EVENT_PORT_ERR) nic->ports[port - 1].state = IBV_PORT_DOWN;
  if (type == IBV_EVENT_PORT_ACTIVE) nic->ports[port - 1].state = IBV_PORT_ACTIVE;
  state_->RaisePortEvent(nic, port, type);
}

void FakeFabric::ChangeGid(const std::string& name, uint8_t port, uint32_t index,
                           const ibv_gid& gid) {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  FakeNic* nic = state_->NicNamed(name);
  if (nic == nullptr || port < 1 || port > nic->ports.size() ||
      index >= nic->ports[port - 1].gids.size()) {
    Misuse("ChangeGid: no such GID");
  }
  nic->ports[port - 1].gids[index].gid = gid;
  state_->RaisePortEvent(nic, port, IBV_EVENT_GID_CHANGE);
}

void FakeFabric::PauseNic(const std::string& name, absl::Duration duration) {
  if (!state_->options.asynchronous) Misuse("PauseNic needs the asynchronous fabric");
  ::stepmesh::base::MutexLock lock(&state_->mu);
  FakeNic* nic = state_->NicNamed(name);
  if (nic == nullptr) Misuse("PauseNic: no such NIC");
  nic->paused_until = absl::Now() + duration;
}

void FakeFabric::DropTraffic(uint32_t qpn, bool drop) {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  FakeQp* qp = state_->QpNumbered(qpn);
  if (qp == nullptr) Misuse("DropTraffic: no such QP");
  qp->drop = drop;
  state_->wake.Bump();
}

void FakeFabric::HoldQp(uint32_t qpn, bool hold) {
  if (!state_->options.asynchronous) Misuse("HoldQp needs the asynchronous fabric");
  ::stepmesh::base::MutexLock lock(&state_->mu);
  FakeQp* qp = state_->QpNumbered(qpn);
  if (qp == nullptr) Misuse("HoldQp: no such QP");
  qp->held = hold;
  state_->wake.Bump();
}

std::vector<uint32_t> FakeFabric::QpNumbers(const std::string& name) const {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  std::vector<uint32_t> out;
  for (const auto& nic : state_->nics) {
    if (nic->spec.name != name) continue;
    for (const auto& [qpn, qp] : nic->qps) out.push_back(qpn);
  }
  return out;
}

int FakeFabric::SendCqCapacity(uint32_t qpn) const {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  const FakeQp* qp = state_->QpNumbered(qpn);
  return qp == nullptr ? 0 : qp->send_cq->capacity;
}

uint32_t FakeFabric::GrantedSendWr(uint32_t qpn) const {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  const FakeQp* qp = state_->QpNumbered(qpn);
  return qp == nullptr ? 0 : qp->cap.max_send_wr;
}

size_t FakeFabric::Outstanding(uint32_t qpn) const {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  const FakeQp* qp = state_->QpNumbered(qpn);
  return qp == nullptr ? 0 : qp->pending.size();
}

void FakeFabric::AddDeviceMemory(const void* base, size_t bytes) {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  state_->device_memory.emplace_back(reinterpret_cast<uintptr_t>(base), bytes);
}

void FakeFabric::SetGpuDirect(bool dmabuf, bool peer_memory, int dmabuf_errno) {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  state_->dmabuf = dmabuf;
  state_->peer_memory = peer_memory;
  state_->dmabuf_errno = dmabuf_errno;
}

std::vector<uint8_t> FakeFabric::LagPorts(const std::string& nic) const {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  std::vector<uint8_t> ports;
  for (const auto& n : state_->nics) {
    if (n->spec.name != nic) continue;
    for (const auto& [qpn, qp] : n->qps) ports.push_back(qp->lag_port);
  }
  return ports;
}

FakeFabricStats FakeFabric::stats() const {
  ::stepmesh::base::MutexLock lock(&state_->mu);
  return state_->stats;
}

}  // namespace stepmesh::testing
