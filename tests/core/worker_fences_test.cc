// A draining server's record of its workers' fences on its own
// (src/core/worker_fences.h): which fences count, and whom a drain still
// waits for as workers fence, are lost, or rejoin.

#include "src/core/worker_fences.h"

#include <catch2/catch.hpp>
#include <thread>
#include <vector>

#include "src/core/lost_peers.h"

namespace stepmesh::core {
namespace {

TEST_CASE("fences: a fence before the drain began does not count", "[fences]") {
  WorkerFences f(2);
  LostPeers lost(2);
  CHECK_FALSE(f.draining());
  CHECK_FALSE(f.Fence(0));  // a previous drain's, arriving late
  CHECK_FALSE(f.fenced(0));
  CHECK(f.Unfenced(lost) == 2);
  f.BeginDrain();
  CHECK(f.draining());
  CHECK_FALSE(f.fenced(0));  // the early one was not kept
  CHECK(f.Unfenced(lost) == 2);
}

TEST_CASE("fences: a drain waits for every worker that is not gone", "[fences]") {
  WorkerFences f(3);
  LostPeers lost(3);
  f.BeginDrain();
  CHECK_FALSE(f.AllFenced(lost));
  CHECK(f.Fence(1));
  CHECK(f.fenced(1));
  CHECK_FALSE(f.fenced(0));
  CHECK(f.Unfenced(lost) == 2);
  lost.MarkLost(0);  // a lost worker is owed nothing and sends nothing
  CHECK(f.Unfenced(lost) == 1);
  CHECK_FALSE(f.AllFenced(lost));
  CHECK(f.Fence(2));
  CHECK(f.Unfenced(lost) == 0);
  CHECK(f.AllFenced(lost));
  lost.MarkBack(0);  // a worker counted back in (rejoined) is waited for again
  CHECK(f.Unfenced(lost) == 1);
  CHECK_FALSE(f.AllFenced(lost));
}

TEST_CASE("fences: a rank outside the workers is refused and changes nothing", "[fences]") {
  WorkerFences f(2);
  LostPeers lost(2);
  f.BeginDrain();
  CHECK_FALSE(f.Fence(-1));
  CHECK_FALSE(f.Fence(2));
  CHECK(f.Unfenced(lost) == 2);
  WorkerFences none(0);
  LostPeers no_peers(0);
  none.BeginDrain();
  CHECK_FALSE(none.Fence(0));
  CHECK(none.AllFenced(no_peers));
}

TEST_CASE("fences: the receive thread fences while another thread polls the drain", "[fences]") {
  constexpr int kWorkers = 64;
  WorkerFences f(kWorkers);
  LostPeers lost(kWorkers);
  f.BeginDrain();
  std::thread receive([&] {
    for (int w = 0; w < kWorkers; ++w) f.Fence(w);
  });
  // Only ever decreasing, ending at zero once the receive thread is done.
  int last = kWorkers;
  bool grew = false;
  for (int i = 0; i < 100000 && last > 0; ++i) {
    const int now = f.Unfenced(lost);
    grew |= now > last;
    last = now;
  }
  receive.join();
  CHECK_FALSE(grew);
  CHECK(f.Unfenced(lost) == 0);
  CHECK(f.AllFenced(lost));
}

}  // namespace
}  // namespace stepmesh::core
