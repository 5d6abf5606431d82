#include "examples/afd_model/placement.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace afd::example {
namespace {

std::vector<std::string> SplitList(const std::string& s) {
  if (s.empty()) return {};
  return absl::StrSplit(s, ',');
}

bool IsIpv4(const std::string& a) {
  in_addr addr;
  return ::inet_pton(AF_INET, a.c_str(), &addr) == 1;
}

}  // namespace

Placement::Placement(Placement&& other) noexcept
    : attention_(other.attention_),
      names_(std::move(other.names_)),
      addrs_(std::move(other.addrs_)),
      fds_(std::exchange(other.fds_, {})) {}

Placement& Placement::operator=(Placement&& other) noexcept {
  if (this != &other) {
    for (int fd : fds_) ::close(fd);
    attention_ = other.attention_;
    names_ = std::move(other.names_);
    addrs_ = std::move(other.addrs_);
    fds_ = std::exchange(other.fds_, {});
  }
  return *this;
}

Placement::~Placement() {
  for (int fd : fds_) ::close(fd);
}

absl::StatusOr<Placement> Placement::Open(const std::string& hosts, const std::string& addrs,
                                          int attention, int ffn) {
  Placement p;
  if (hosts.empty()) {
    if (!addrs.empty()) {
      return absl::InvalidArgumentError("--host-addrs needs --hosts");
    }
    return p;
  }
  p.attention_ = attention;
  p.names_ = SplitList(hosts);
  p.addrs_ = SplitList(addrs);
  const size_t need = static_cast<size_t>(attention) + ffn;
  if (p.names_.size() < need) {
    return absl::InvalidArgumentError(absl::StrCat("--hosts names ", p.names_.size(),
                                                   " hosts; this run needs ", need, " (", attention,
                                                   " attention + ", ffn, " FFN, one each)"));
  }
  if (p.addrs_.size() != p.names_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("--host-addrs has ", p.addrs_.size(),
                                                   " addresses for ", p.names_.size(), " hosts"));
  }
  for (const std::string& a : p.addrs_) {
    if (!IsIpv4(a)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--host-addrs: '", a, "' is not an IPv4 address"));
    }
  }
  for (const std::string& name : p.names_) {
    if (name.empty() || name.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("--hosts: bad namespace name '", name, "'"));
    }
    const std::string path = "/run/netns/" + name;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::NotFoundError(
          absl::StrCat("--hosts: cannot open ", path, ": ", std::strerror(errno)));
    }
    p.fds_.push_back(fd);
  }
  return p;
}

std::string Placement::address(int host) const {
  return enabled() ? addrs_[host] : std::string("127.0.0.1");
}

absl::Status Placement::EnterSchedulerHost() const {
  if (!enabled()) return absl::OkStatus();
  if (::setns(fds_[0], CLONE_NEWNET) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("--hosts: cannot enter namespace ", names_[0], ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::vector<std::string> Placement::Environment(int host) const {
  if (!enabled()) return {};
  return {absl::StrCat("STEPMESH_BIND_HOST=", addrs_[host])};
}

}  // namespace afd::example
