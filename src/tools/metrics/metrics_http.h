#pragma once
// Serving a participant's Prometheus text (stepmesh::PrometheusText) to a
// scraper, for the programs' --metrics-port and --metrics-file: a tiny
// HTTP/1.0 responder on 127.0.0.1, and an atomic file writer.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/base/net.h"

namespace stepmesh::tools {

// One thread answering GET /metrics with what `provider` returns, one
// connection at a time: each connection gets at most 1 s to send its request
// line and headers (8 KiB at most) and to take the answer, then it is closed.
// Anything else gets 404 (another path) or 405 (another method). Loopback
// only: the text names the mesh's peers. Stops and closes in the destructor.
class MetricsHttpServer {
 public:
  using Provider = std::function<std::string()>;
  // `port` 0: the kernel picks one (port() says which). `provider` runs on the
  // server's thread and must stay callable until the server is destroyed.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(uint16_t port, Provider provider);
  ~MetricsHttpServer();
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  uint16_t port() const { return port_; }
  uint64_t served() const { return served_.load(); }  // 200 answers so far

 private:
  MetricsHttpServer(base::UniqueFd listener, uint16_t port, Provider provider);
  void Loop();
  void Answer(int fd);

  base::UniqueFd listener_;
  const uint16_t port_;
  const Provider provider_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> served_{0};
  std::thread thread_;
};

// Writes `text` to `path` through a temporary file and a rename, so a reader
// never sees half of it.
absl::Status WriteMetricsFile(const std::string& path, const std::string& text);

}  // namespace stepmesh::tools
