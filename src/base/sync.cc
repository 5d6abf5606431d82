#include "src/base/sync.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

namespace stepmesh::base {

void WakeWord::WaitWhile(uint32_t seen, absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return;
  const timespec ts = absl::ToTimespec(timeout);
  // Relative timeout; EAGAIN (the word moved), EINTR and ETIMEDOUT all just return.
  (void)::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word_), FUTEX_WAIT_PRIVATE, seen, &ts,
                  nullptr, 0);
}

void WakeWord::Bump() {
  word_.fetch_add(1, std::memory_order_seq_cst);
  (void)::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word_), FUTEX_WAKE_PRIVATE, INT_MAX,
                  nullptr, nullptr, 0);
}

}  // namespace stepmesh::base
