#pragma once
// One thread per server of a LoopbackMesh answering every batch it takes with
// the same replies until Stop() (at most two minutes), counting the responds
// that went out and those that failed. For tests whose subject is the
// worker's side or what the servers record, not how a server answers.

#include <atomic>
#include <thread>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "stepmesh/server.h"
#include "tests/support/loopback_mesh.h"

namespace stepmesh::testing {

class AnsweringServers {
 public:
  // `replies`: the Respond argument for every batch (one per worker answered).
  AnsweringServers(LoopbackMesh& mesh, std::vector<Reply> replies) : replies_(std::move(replies)) {
    for (int s = 0; s < mesh.num_servers(); ++s) {
      threads_.emplace_back([this, &server = mesh.server(s)] {
        const absl::Time deadline = absl::Now() + absl::Seconds(120);
        while (!done_.load() && absl::Now() < deadline) {
          absl::StatusOr<Batch> batch = server.GetBatch(absl::Milliseconds(50));
          if (!batch.ok()) continue;
          (server.Respond(*batch, replies_).ok() ? answered_ : failed_).fetch_add(1);
        }
      });
    }
  }
  ~AnsweringServers() { Stop(); }
  AnsweringServers(const AnsweringServers&) = delete;
  AnsweringServers& operator=(const AnsweringServers&) = delete;

  // Ends the threads (each within one 50 ms GetBatch) and joins them.
  void Stop() {
    done_.store(true);
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }
  int answered() const { return answered_.load(); }
  int failed() const { return failed_.load(); }

 private:
  const std::vector<Reply> replies_;
  std::atomic<bool> done_{false};
  std::atomic<int> answered_{0};
  std::atomic<int> failed_{0};
  std::vector<std::thread> threads_;
};

}  // namespace stepmesh::testing
