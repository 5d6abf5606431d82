#include "src/tools/planner/http_get.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace stepmesh::planner {
namespace {

// Closes the socket on every path.
class Socket {
 public:
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket() {
    if (fd_ >= 0) ::close(fd_);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  int fd() const { return fd_; }

 private:
  int fd_;
};

absl::Status Error(const HttpUrl& url, absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(url.text, ": ", what));
}

// Waits until `fd` is ready for `events` or the deadline passes.
absl::Status WaitFor(const HttpUrl& url, int fd, short events, absl::Time deadline,
                     absl::string_view doing) {
  for (;;) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(absl::StrCat(url.text, ": deadline passed while ", doing));
    }
    pollfd p{fd, events, 0};
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(left)) + 1;
    const int n = ::poll(&p, 1, ms);
    if (n > 0) return absl::OkStatus();
    if (n < 0 && errno != EINTR) return Error(url, absl::StrCat("poll: ", std::strerror(errno)));
  }
}

}  // namespace

absl::StatusOr<HttpUrl> ParseHttpUrl(const std::string& text) {
  HttpUrl url;
  url.text = text;
  absl::string_view rest = text;
  if (absl::ConsumePrefix(&rest, "http://")) {
  } else if (absl::StrContains(rest, "://")) {
    return absl::InvalidArgumentError(absl::StrCat(text, ": only http:// URLs are read"));
  }
  const size_t slash = rest.find('/');
  absl::string_view authority = rest.substr(0, slash);
  url.path = slash == absl::string_view::npos ? "/metrics" : std::string(rest.substr(slash));
  const size_t colon = authority.rfind(':');
  if (colon == absl::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(text, ": needs a port (HOST:PORT)"));
  }
  url.host = std::string(authority.substr(0, colon));
  int port = 0;
  if (!absl::SimpleAtoi(authority.substr(colon + 1), &port) || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(text, ": port must be in [1, 65535]"));
  }
  url.port = static_cast<uint16_t>(port);
  in_addr addr{};
  if (url.host == "localhost") {
    url.host = "127.0.0.1";
  } else if (::inet_pton(AF_INET, url.host.c_str(), &addr) != 1 ||
             (ntohl(addr.s_addr) >> 24) != 127) {
    return absl::InvalidArgumentError(absl::StrCat(
        text, ": the host must be a loopback address (the metrics ports serve 127.0.0.1 only)"));
  }
  for (char c : url.path) {
    if (static_cast<unsigned char>(c) <= 0x20 || c == 0x7f) {
      return absl::InvalidArgumentError(absl::StrCat(text, ": the path has a blank or control"));
    }
  }
  return url;
}

absl::StatusOr<std::string> HttpGet(const HttpUrl& url, absl::Duration timeout, size_t max_bytes) {
  const absl::Time deadline = absl::Now() + timeout;
  Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (s.fd() < 0) return Error(url, absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(url.port);
  ::inet_pton(AF_INET, url.host.c_str(), &to.sin_addr);
  if (::connect(s.fd(), reinterpret_cast<const sockaddr*>(&to), sizeof(to)) != 0) {
    if (errno != EINPROGRESS) return Error(url, absl::StrCat("connect: ", std::strerror(errno)));
    if (absl::Status st = WaitFor(url, s.fd(), POLLOUT, deadline, "connecting"); !st.ok()) {
      return st;
    }
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return Error(url, absl::StrCat("connect: ", std::strerror(err)));
  }
  const std::string request =
      absl::StrCat("GET ", url.path, " HTTP/1.0\r\nHost: ", url.host, ":", url.port,
                   "\r\nAccept: text/plain\r\nConnection: close\r\n\r\n");
  for (size_t sent = 0; sent < request.size();) {
    if (absl::Status st = WaitFor(url, s.fd(), POLLOUT, deadline, "sending"); !st.ok()) return st;
    const ssize_t n = ::send(s.fd(), request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      return Error(url, absl::StrCat("send: ", std::strerror(errno)));
    }
    if (n > 0) sent += static_cast<size_t>(n);
  }
  std::string answer;
  char buf[16384];
  for (;;) {
    if (absl::Status st = WaitFor(url, s.fd(), POLLIN, deadline, "reading the answer"); !st.ok()) {
      return st;
    }
    const ssize_t n = ::recv(s.fd(), buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return Error(url, absl::StrCat("recv: ", std::strerror(errno)));
    }
    answer.append(buf, static_cast<size_t>(n));
    if (answer.size() > max_bytes + 64 * 1024) {
      return Error(url, absl::StrCat("answer larger than ", max_bytes, " bytes"));
    }
  }
  const size_t head_end = answer.find("\r\n\r\n");
  if (head_end == std::string::npos) return Error(url, "the answer has no complete header");
  const absl::string_view head(answer.data(), head_end);
  const std::vector<absl::string_view> lines = absl::StrSplit(head, "\r\n");
  const std::vector<absl::string_view> status = absl::StrSplit(lines[0], absl::MaxSplits(' ', 2));
  if (status.size() < 2 || !absl::StartsWith(status[0], "HTTP/1.")) {
    return Error(url, absl::StrCat("not an HTTP answer: \"", absl::CEscape(lines[0]), "\""));
  }
  if (status[1] != "200") return Error(url, absl::StrCat("HTTP status ", lines[0].substr(9)));
  std::string body = answer.substr(head_end + 4);
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    if (colon == absl::string_view::npos) continue;
    if (!absl::EqualsIgnoreCase(absl::StripAsciiWhitespace(lines[i].substr(0, colon)),
                                "content-length")) {
      continue;
    }
    size_t length = 0;
    if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(lines[i].substr(colon + 1)), &length)) {
      return Error(url, "bad Content-Length");
    }
    if (body.size() != length) {
      return Error(url, absl::StrCat("body of ", body.size(), " bytes, Content-Length ", length));
    }
  }
  if (body.size() > max_bytes) {
    return Error(url, absl::StrCat("answer larger than ", max_bytes, " bytes"));
  }
  return body;
}

}  // namespace stepmesh::planner
