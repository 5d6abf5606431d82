// A server's record of its workers' processes and the rejoin window on its
// own (src/core/worker_rejoins.h): which losses are set aside, which are
// counted after all, and the receive thread seeing each new process once.

#include "src/core/worker_rejoins.h"

#include <catch2/catch.hpp>
#include <thread>

namespace stepmesh::core {
namespace {

TEST_CASE("rejoins: a loss outside any rejoin window is not set aside", "[rejoins]") {
  WorkerRejoins r(2);
  CHECK_FALSE(r.SetAsideLoss(0));
  CHECK_FALSE(r.SetAsideLoss(1));
  CHECK_FALSE(r.TakeSetAsideLoss(0));  // an orderly leave of a worker never set aside: nothing
  CHECK(r.epoch(0) == 0);
  CHECK_FALSE(r.NewProcessSeen(0));  // the first process is not new
}

TEST_CASE("rejoins: each rejoin is a new epoch, seen once by the receive thread", "[rejoins]") {
  WorkerRejoins r(3);
  r.BeginRejoin(1);
  r.EndRejoin(1);
  CHECK(r.epoch(1) == 1);
  CHECK(r.epoch(0) == 0);
  CHECK(r.NewProcessSeen(1));
  CHECK_FALSE(r.NewProcessSeen(1));
  CHECK_FALSE(r.NewProcessSeen(0));
  r.BeginRejoin(1);
  r.EndRejoin(1);
  r.BeginRejoin(1);
  r.EndRejoin(1);
  CHECK(r.epoch(1) == 3);
  CHECK(r.NewProcessSeen(1));  // two rejoins between frames: one forget is enough
  CHECK_FALSE(r.NewProcessSeen(1));
}

TEST_CASE("rejoins: losses inside the window are set aside, and counted after an orderly leave",
          "[rejoins]") {
  WorkerRejoins r(2);
  r.BeginRejoin(0);
  CHECK(r.SetAsideLoss(0));        // the previous process's connection, read late
  CHECK(r.SetAsideLoss(0));        // a second report in the same window
  CHECK_FALSE(r.SetAsideLoss(1));  // another worker is not in a window
  r.EndRejoin(0);
  CHECK_FALSE(r.SetAsideLoss(0));  // the window closed: a loss counts again
  // The scheduler says worker 0 left in order: the loss set aside was its own.
  CHECK(r.TakeSetAsideLoss(0));
  CHECK_FALSE(r.TakeSetAsideLoss(0));  // once
}

TEST_CASE("rejoins: a window without a loss leaves nothing to count", "[rejoins]") {
  WorkerRejoins r(1);
  r.BeginRejoin(0);
  r.EndRejoin(0);
  CHECK_FALSE(r.TakeSetAsideLoss(0));
  // A loss set aside in an earlier window does not survive a clean one.
  r.BeginRejoin(0);
  CHECK(r.SetAsideLoss(0));
  r.EndRejoin(0);
  r.BeginRejoin(0);
  r.EndRejoin(0);
  CHECK_FALSE(r.TakeSetAsideLoss(0));
}

TEST_CASE("rejoins: ranks out of range are never set aside", "[rejoins]") {
  WorkerRejoins r(2);
  CHECK_FALSE(r.SetAsideLoss(-1));
  CHECK_FALSE(r.SetAsideLoss(2));
  CHECK_FALSE(r.TakeSetAsideLoss(7));
}

TEST_CASE("rejoins: a loss racing the end of the window is either set aside or counted",
          "[rejoins]") {
  // The receive thread reports a loss while the rendezvous thread closes the
  // window: exactly one of "set aside, then taken by the leave" and "not set
  // aside" happens, never both, never neither.
  for (int round = 0; round < 200; ++round) {
    WorkerRejoins r(1);
    r.BeginRejoin(0);
    bool set_aside = false;
    std::thread receive([&] { set_aside = r.SetAsideLoss(0); });
    r.EndRejoin(0);
    receive.join();
    const bool counted_at_leave = r.TakeSetAsideLoss(0);
    REQUIRE(set_aside == counted_at_leave);
  }
}

}  // namespace
}  // namespace stepmesh::core
