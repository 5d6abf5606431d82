#pragma once
// A minimal HTTP/1.0 GET for stepmesh_plan --watch: plain sockets, IPv4
// loopback only (the programs' --metrics-port serves 127.0.0.1 alone), one
// deadline for connect, send and the whole answer. No dependency on
// libstepmesh, no HTTP library. Every error names the URL.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace stepmesh::planner {

struct HttpUrl {
  std::string text;  // as given
  std::string host;  // 127.x.y.z or "localhost"
  uint16_t port = 0;
  std::string path;  // "/metrics" when the URL has none
};

// "http://127.0.0.1:9100/metrics", "127.0.0.1:9100" or "localhost:9100/x".
// Refuses other schemes, hosts that are not loopback, and missing or bad
// ports.
absl::StatusOr<HttpUrl> ParseHttpUrl(const std::string& url);

// The body of a 200 answer (at most `max_bytes`). Another status, a
// connection refused, a body cut short of its Content-Length, or the
// deadline passing are errors naming the URL.
absl::StatusOr<std::string> HttpGet(const HttpUrl& url, absl::Duration timeout,
                                    size_t max_bytes = 16 << 20);

}  // namespace stepmesh::planner
