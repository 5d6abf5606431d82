// The raw-tcp and ZeroMQ baselines move exactly the bytes asked for, in every
// receive discipline, for sizes that are not multiples of the low-water chunk
// (a receive that sleeps for a whole chunk at the end of a message would stall
// there until the timeout), to one and two servers, and with a batch of two
// clients that the echo side answers only together.

#include "benchmarks/perf_baselines.h"

#include <atomic>
#include <cstring>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "catch2/catch.hpp"

namespace stepmesh::bench {
namespace {

constexpr int kSockBuf = 8 << 20;  // as stepmesh_perf
// Long enough for a loaded CI machine, far shorter than a stalled receive
// (the echo side's blocking header read waits indefinitely).
constexpr absl::Duration kTimeout = absl::Seconds(20);

// Echo servers on `count` free ports below the ephemeral range (Start binds,
// so a port taken meanwhile is just another attempt).
std::vector<std::unique_ptr<BaselineServers>> StartServers(int count,
                                                           std::vector<base::HostPort>& addrs) {
  std::vector<std::unique_ptr<BaselineServers>> servers;
  std::mt19937 rng{std::random_device{}()};
  std::uniform_int_distribution<int> pick(10000, 30000);
  for (int attempt = 0; attempt < 200 && static_cast<int>(servers.size()) < count; ++attempt) {
    const int raw = pick(rng) & ~1;  // raw on the even port, ZeroMQ on the next
    auto s = BaselineServers::Start("127.0.0.1", static_cast<uint16_t>(raw),
                                    static_cast<uint16_t>(raw + 1), kSockBuf);
    if (!s.ok()) continue;
    servers.push_back(std::move(*s));
    addrs.push_back({"127.0.0.1", static_cast<uint16_t>(raw)});
  }
  REQUIRE(static_cast<int>(servers.size()) == count);
  return servers;
}

std::vector<size_t> Sizes() {
  // 1 byte; just over a page; 896 KiB and 1.75 MiB (the acceptance sizes, whole
  // multiples of 256 KiB); odd sizes whose last chunk is short.
  return {1, 4097, 917504, 1835008, 300001, 1835008 + 12345};
}

// `rounds` exchanges of every size pair; each reply fully overwritten (the
// echo side fills with 1s) and exactly pull_bytes long (the byte after it
// untouched).
void CheckExchanges(BaselineClient& client, int servers, int rounds) {
  std::vector<char> push(2 << 20, 'Z');
  std::vector<std::vector<unsigned char>> pull(servers, std::vector<unsigned char>((2 << 20) + 1));
  std::vector<void*> into;
  for (auto& p : pull) into.push_back(p.data());
  for (size_t push_bytes : Sizes()) {
    for (size_t pull_bytes : Sizes()) {
      for (int r = 0; r < rounds; ++r) {
        for (auto& p : pull) std::memset(p.data(), 0, p.size());
        const absl::Status s = client.Exchange(push.data(), push_bytes, into, pull_bytes);
        INFO("push " << push_bytes << " pull " << pull_bytes << " round " << r);
        REQUIRE(s.ok());
        for (int k = 0; k < servers; ++k) {
          INFO("server " << k);
          size_t ones = 0;
          while (ones < pull_bytes && pull[k][ones] == 1) ++ones;
          REQUIRE(ones == pull_bytes);
          REQUIRE(pull[k][pull_bytes] == 0);
        }
      }
    }
  }
}

TEST_CASE("raw-tcp baselines deliver every size in every discipline", "[baselines]") {
  for (int servers : {1, 2}) {
    std::vector<base::HostPort> addrs;
    auto echo = StartServers(servers, addrs);
    std::vector<RawDiscipline> rows(std::begin(kRawFloorDisciplines),
                                    std::end(kRawFloorDisciplines));
    rows.push_back(kRawNaive);
    for (const RawDiscipline& d : rows) {
      INFO("servers " << servers << " " << d.method);
      auto client = ConnectRawTcp(addrs, kSockBuf, kTimeout, /*batch=*/1, d);
      REQUIRE(client.ok());
      CheckExchanges(**client, servers, /*rounds=*/2);
    }
  }
}

TEST_CASE("raw-tcp baselines: many round trips at the acceptance sizes", "[baselines]") {
  // A receive stall at the end of a message depends on where the sender is
  // when the receiver starts a chunk: rare per round trip, so many of them.
  std::vector<base::HostPort> addrs;
  auto echo = StartServers(1, addrs);
  std::vector<char> push(917504, 'Z');
  std::vector<char> pull(1835008 + 12345);
  void* into = pull.data();
  for (const RawDiscipline& d : kRawFloorDisciplines) {
    INFO(d.method);
    auto client = ConnectRawTcp(addrs, kSockBuf, kTimeout, /*batch=*/1, d);
    REQUIRE(client.ok());
    for (int i = 0; i < 300; ++i) {
      INFO("round trip " << i);
      const size_t pull_bytes = i % 2 == 0 ? 1835008 : pull.size();
      REQUIRE((*client)->Exchange(push.data(), push.size(), {&into, 1}, pull_bytes).ok());
    }
  }
}

TEST_CASE("raw-tcp echo answers a batch of two clients only together", "[baselines]") {
  std::vector<base::HostPort> addrs;
  auto echo = StartServers(1, addrs);
  for (const RawDiscipline& d : kRawFloorDisciplines) {
    INFO(d.method);
    auto first = ConnectRawTcp(addrs, kSockBuf, kTimeout, /*batch=*/2, d);
    auto second = ConnectRawTcp(addrs, kSockBuf, kTimeout, /*batch=*/2, d);
    REQUIRE(first.ok());
    REQUIRE(second.ok());
    std::vector<char> push(4096, 'Z');
    std::vector<char> reply_a(8192), reply_b(8192);
    void* into_a = reply_a.data();
    void* into_b = reply_b.data();
    // The first client alone gets no reply: on a thread, it must still be
    // waiting 200 ms later, before the second client pushed (its own timeout
    // is 20 s, so a late reply cannot be mistaken for a timeout).
    std::atomic<bool> done{false};
    absl::Status first_status;
    std::thread t([&] {
      first_status = (*first)->Exchange(push.data(), push.size(), {&into_a, 1}, reply_a.size());
      done = true;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const bool answered_alone = done.load();
    const absl::Status second_status =
        (*second)->Exchange(push.data(), push.size(), {&into_b, 1}, reply_b.size());
    t.join();
    CHECK_FALSE(answered_alone);
    REQUIRE(first_status.ok());
    REQUIRE(second_status.ok());
    CHECK(reply_a[8191] == 1);
    CHECK(reply_b[8191] == 1);
  }
}

TEST_CASE("zmq baseline delivers every size", "[baselines]") {
  if (!ZmqAvailable()) FAIL("built without libzmq (scripts/install-deps.sh installs libzmq3-dev)");
  std::vector<base::HostPort> raw;
  auto echo = StartServers(2, raw);
  std::vector<base::HostPort> addrs;
  for (const base::HostPort& hp : raw)
    addrs.push_back({hp.host, static_cast<uint16_t>(hp.port + 1)});
  auto client = ConnectZmq(addrs, kTimeout, /*batch=*/1);
  REQUIRE(client.ok());
  std::vector<char> push(2 << 20, 'Z');
  std::vector<void*> into(2, nullptr);  // zmq checks size and first byte in its own message
  for (size_t pull_bytes : Sizes()) {
    INFO("pull " << pull_bytes);
    REQUIRE((*client)->Exchange(push.data(), 917504, into, pull_bytes).ok());
  }
}

}  // namespace
}  // namespace stepmesh::bench
