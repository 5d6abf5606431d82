#pragma once
// Counts retired user-space instructions of the calling thread through
// perf_event_open, so micro-benchmarks can report instructions per operation:
// a count is stable where wall time is not (shared CI cores). Absent —
// available() false, with the reason — where the kernel or the VM refuses
// (perf_event_paranoid > 2, no PMU virtualisation, seccomp).

#include <linux/perf_event.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>

namespace stepmesh::bench {

class InstructionCounter {
 public:
  InstructionCounter() {
    perf_event_attr attr{};
    attr.type = PERF_TYPE_HARDWARE;
    attr.size = sizeof(attr);
    attr.config = PERF_COUNT_HW_INSTRUCTIONS;
    attr.disabled = 1;
    // User space only: allowed at perf_event_paranoid <= 2 without privileges.
    attr.exclude_kernel = 1;
    attr.exclude_hv = 1;
    fd_ = static_cast<int>(syscall(SYS_perf_event_open, &attr, 0 /*this thread*/, -1, -1, 0));
    if (fd_ < 0) why_ = std::string("perf_event_open: ") + std::strerror(errno);
  }
  ~InstructionCounter() {
    if (fd_ >= 0) close(fd_);
  }
  InstructionCounter(const InstructionCounter&) = delete;
  InstructionCounter& operator=(const InstructionCounter&) = delete;

  bool available() const { return fd_ >= 0; }
  const std::string& why_unavailable() const { return why_; }

  void Start() {
    if (fd_ < 0) return;
    ioctl(fd_, PERF_EVENT_IOC_RESET, 0);
    ioctl(fd_, PERF_EVENT_IOC_ENABLE, 0);
  }
  // Instructions since Start(), or 0 when unavailable.
  uint64_t Stop() {
    if (fd_ < 0) return 0;
    ioctl(fd_, PERF_EVENT_IOC_DISABLE, 0);
    uint64_t count = 0;
    if (read(fd_, &count, sizeof(count)) != sizeof(count)) return 0;
    return count;
  }

 private:
  int fd_ = -1;
  std::string why_;
};

}  // namespace stepmesh::bench
