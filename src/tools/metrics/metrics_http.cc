#include "src/tools/metrics/metrics_http.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace stepmesh::tools {
namespace {

constexpr size_t kMaxRequestBytes = 8 << 10;
constexpr absl::Duration kPerConnection = absl::Seconds(1);
// How often the loop looks at the stop flag while no one connects.
constexpr absl::Duration kStopCheck = absl::Milliseconds(100);

std::string Response(absl::string_view status, absl::string_view content_type,
                     absl::string_view body) {
  return absl::StrCat("HTTP/1.0 ", status, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(uint16_t port,
                                                                            Provider provider) {
  absl::StatusOr<base::UniqueFd> listener = base::ListenTcp("127.0.0.1", port, 8);
  if (!listener.ok()) {
    return absl::Status(listener.status().code(),
                        absl::StrCat("metrics port ", port, ": ", listener.status().message()));
  }
  absl::StatusOr<uint16_t> bound = base::LocalPort(listener->get());
  if (!bound.ok()) return bound.status();
  return std::unique_ptr<MetricsHttpServer>(
      new MetricsHttpServer(*std::move(listener), *bound, std::move(provider)));
}

MetricsHttpServer::MetricsHttpServer(base::UniqueFd listener, uint16_t port, Provider provider)
    : listener_(std::move(listener)), port_(port), provider_(std::move(provider)) {
  thread_ = std::thread([this] { Loop(); });
}

MetricsHttpServer::~MetricsHttpServer() {
  stop_.store(true);
  thread_.join();  // within kStopCheck, or one connection's kPerConnection
}

void MetricsHttpServer::Loop() {
  while (!stop_.load()) {
    absl::StatusOr<base::UniqueFd> conn =
        base::AcceptTcp(listener_.get(), absl::Now() + kStopCheck);
    if (!conn.ok()) {
      if (!absl::IsDeadlineExceeded(conn.status())) absl::SleepFor(kStopCheck);  // EMFILE etc.
      continue;
    }
    Answer(conn->get());
  }
}

void MetricsHttpServer::Answer(int fd) {
  const absl::Time deadline = absl::Now() + kPerConnection;
  // Non-blocking, so a client that stops reading cannot hold the thread past the deadline.
  if (!base::SetNonBlocking(fd, true).ok()) return;
  std::string request;
  char buf[1024];
  while (!absl::StrContains(request, "\r\n\r\n") && !absl::StrContains(request, "\n\n")) {
    if (request.size() >= kMaxRequestBytes) return;
    absl::StatusOr<bool> readable = base::WaitReadable(fd, deadline);
    if (!readable.ok() || !*readable) return;
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return;
    request.append(buf, static_cast<size_t>(n));
  }
  std::string answer;
  const absl::string_view line = absl::string_view(request).substr(0, request.find('\n'));
  if (!absl::StartsWith(line, "GET ")) {
    answer = Response("405 Method Not Allowed", "text/plain", "only GET\n");
  } else if (absl::StartsWith(line, "GET /metrics ") || absl::StartsWith(line, "GET /metrics?")) {
    answer = Response("200 OK", "text/plain; version=0.0.4; charset=utf-8", provider_());
    served_.fetch_add(1);
  } else {
    answer = Response("404 Not Found", "text/plain", "try /metrics\n");
  }
  (void)base::WriteFully(fd, answer.data(), answer.size(), deadline);
}

absl::Status WriteMetricsFile(const std::string& path, const std::string& text) {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return absl::InternalError(absl::StrCat("cannot create ", tmp));
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !written) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace stepmesh::tools
