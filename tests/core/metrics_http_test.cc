// --metrics-port's responder: GET /metrics answers the provider's text over
// HTTP/1.0; other paths and methods are refused; a client that sends nothing
// does not hold it past its per-connection deadline; it stops in its destructor.

#include "src/tools/metrics/metrics_http.h"

#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "src/base/net.h"
#include "tests/support/status.h"

namespace stepmesh {
namespace {

// The whole answer to `request` (the server closes after one).
std::string Fetch(uint16_t port, const std::string& request) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<base::UniqueFd> fd = base::ConnectTcp({"127.0.0.1", port}, deadline);
  REQUIRE_OK(fd);
  REQUIRE_OK(base::WriteFully(fd->get(), request.data(), request.size(), deadline));
  std::string answer;
  char buf[4096];
  for (;;) {
    absl::StatusOr<bool> readable = base::WaitReadable(fd->get(), deadline);
    REQUIRE_OK(readable);
    REQUIRE(*readable);
    const ssize_t n = ::recv(fd->get(), buf, sizeof(buf), 0);
    REQUIRE(n >= 0);
    if (n == 0) return answer;
    answer.append(buf, static_cast<size_t>(n));
  }
}

TEST_CASE("metrics responder serves GET /metrics and refuses the rest", "[metrics][http]") {
  std::atomic<int> calls{0};
  auto server = tools::MetricsHttpServer::Start(
      0, [&] { return absl::StrCat("# HELP x A counter.\n# TYPE x counter\nx ", ++calls, "\n"); });
  REQUIRE_OK(server);
  const uint16_t port = (*server)->port();
  REQUIRE(port != 0);

  const std::string first = Fetch(port, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n");
  CHECK(absl::StartsWith(first, "HTTP/1.0 200 OK\r\n"));
  CHECK(absl::StrContains(first, "Content-Type: text/plain; version=0.0.4"));
  CHECK(absl::StrContains(first, "Content-Length: 41\r\n"));
  CHECK(absl::EndsWith(first, "\r\n\r\n# HELP x A counter.\n# TYPE x counter\nx 1\n"));
  // The provider runs per scrape.
  CHECK(absl::EndsWith(Fetch(port, "GET /metrics HTTP/1.1\r\n\r\n"), "\nx 2\n"));
  CHECK(absl::StartsWith(Fetch(port, "GET / HTTP/1.0\r\n\r\n"), "HTTP/1.0 404 "));
  CHECK(absl::StartsWith(Fetch(port, "POST /metrics HTTP/1.0\r\n\r\n"), "HTTP/1.0 405 "));
  CHECK((*server)->served() == 2);
  CHECK(calls.load() == 2);

  // A client that connects and says nothing is dropped after its second...
  absl::StatusOr<base::UniqueFd> silent =
      base::ConnectTcp({"127.0.0.1", port}, absl::Now() + absl::Seconds(10));
  REQUIRE_OK(silent);
  // ...and the next one is answered.
  CHECK(absl::StartsWith(Fetch(port, "GET /metrics HTTP/1.0\r\n\r\n"), "HTTP/1.0 200 OK"));

  const absl::Time before = absl::Now();
  server->reset();
  CHECK(absl::Now() - before < absl::Seconds(5));
  // Closed: nobody listens on the port any more.
  CHECK(!base::ConnectTcp({"127.0.0.1", port}, absl::Now()).ok());
}

TEST_CASE("metrics file is replaced whole, and a bad path is an error naming it", "[metrics]") {
  const std::string path = absl::StrCat(std::filesystem::temp_directory_path().string(),
                                        "/stepmesh_metrics_test.", ::getpid(), ".prom");
  const auto read = [&] {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  REQUIRE_OK(tools::WriteMetricsFile(path, "a 1\n"));
  CHECK(read() == "a 1\n");
  REQUIRE_OK(tools::WriteMetricsFile(path, "b 2\n"));
  CHECK(read() == "b 2\n");
  std::filesystem::remove(path);
  absl::Status bad = tools::WriteMetricsFile("/nonexistent-dir/m.prom", "x");
  CHECK(!bad.ok());
  CHECK(absl::StrContains(bad.message(), "/nonexistent-dir/m.prom"));
}

}  // namespace
}  // namespace stepmesh
