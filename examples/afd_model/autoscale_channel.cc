#include "examples/afd_model/autoscale_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace afd::example {

bool IsCheckpoint(const RunShape& run, int step) {
  return run.decision_every > 0 && step > 0 && step % run.decision_every == 0 &&
         step + kDecisionLead < run.steps();
}

std::string FormatWorkloadReport(const WorkloadReport& r) {
  return absl::StrCat("checkpoint ", r.checkpoint, " requests ", r.requests, " context ",
                      r.context_tokens, " micro_batches ", r.micro_batches, "\n");
}

absl::StatusOr<WorkloadReport> ParseWorkloadReport(absl::string_view line) {
  const std::vector<absl::string_view> w =
      absl::StrSplit(absl::StripSuffix(line, "\n"), ' ', absl::SkipEmpty());
  WorkloadReport r;
  if (w.size() != 8 || w[0] != "checkpoint" || w[2] != "requests" || w[4] != "context" ||
      w[6] != "micro_batches" || !absl::SimpleAtoi(w[1], &r.checkpoint) ||
      !absl::SimpleAtoi(w[3], &r.requests) || !absl::SimpleAtoi(w[5], &r.context_tokens) ||
      !absl::SimpleAtoi(w[7], &r.micro_batches) || r.checkpoint < 1 || r.requests < 1 ||
      r.context_tokens < 0 || r.micro_batches < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", line,
        "\" is not a workload report (checkpoint C requests R context T micro_batches M)"));
  }
  return r;
}

std::string FormatDecision(const Decision& d) {
  if (!d.resize) return absl::StrCat("checkpoint ", d.checkpoint, ": no change\n");
  return absl::StrCat("checkpoint ", d.checkpoint, ": resize at ", d.step, ": ", d.to.Name(), "\n");
}

absl::StatusOr<Decision> ParseDecision(absl::string_view line) {
  line = absl::StripSuffix(line, "\n");
  std::vector<absl::string_view> w = absl::StrSplit(line, ' ', absl::SkipEmpty());
  Decision d;
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", line,
        "\" is not a decision (checkpoint C: no change | checkpoint C: resize at S: xAyF)"));
  };
  if (w.size() < 3 || w[0] != "checkpoint" || !absl::ConsumeSuffix(&w[1], ":") ||
      !absl::SimpleAtoi(w[1], &d.checkpoint)) {
    return bad();
  }
  if (w.size() == 4 && w[2] == "no" && w[3] == "change") return d;
  absl::string_view step = w.size() == 6 ? w[4] : absl::string_view();
  if (w.size() != 6 || w[2] != "resize" || w[3] != "at" || !absl::ConsumeSuffix(&step, ":") ||
      !absl::SimpleAtoi(step, &d.step)) {
    return bad();
  }
  absl::StatusOr<MeshShape> to = ParseMeshShape(w[5]);
  if (!to.ok()) return bad();
  d.resize = true;
  d.to = *to;
  if (d.step <= d.checkpoint) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", line, "\": the change must come after its checkpoint"));
  }
  return d;
}

bool LineReader::TakeLine(std::string* line) {
  const size_t nl = buffer_.find('\n');
  if (nl == std::string::npos) return false;
  *line = buffer_.substr(0, nl + 1);
  buffer_.erase(0, nl + 1);
  return true;
}

absl::Status LineReader::ReadAvailable(std::vector<std::string>* lines) {
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd_, buf, sizeof(buf));
    if (n > 0) {
      buffer_.append(buf, static_cast<size_t>(n));
      if (buffer_.size() > (1 << 20)) {
        return absl::ResourceExhaustedError("over 1 MiB without a line end");
      }
      continue;
    }
    if (n == 0) {
      closed_ = true;
      break;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) break;
    return absl::UnavailableError(absl::StrCat("read: ", std::strerror(errno)));
  }
  for (std::string line; TakeLine(&line);) lines->push_back(std::move(line));
  return absl::OkStatus();
}

absl::StatusOr<std::string> LineReader::ReadLine(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (std::string line;;) {
    if (TakeLine(&line)) return line;
    if (closed_) return absl::UnavailableError("the writer closed the pipe");
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat("no line within ", absl::FormatDuration(timeout)));
    }
    pollfd p{fd_, POLLIN, 0};
    const int ms = static_cast<int>(
        std::clamp<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1, int64_t{1} << 30));
    const int r = ::poll(&p, 1, ms);
    if (r < 0 && errno != EINTR) {
      return absl::UnavailableError(absl::StrCat("poll: ", std::strerror(errno)));
    }
    char buf[512];
    if (r > 0) {
      const ssize_t n = ::read(fd_, buf, sizeof(buf));
      if (n > 0) {
        buffer_.append(buf, static_cast<size_t>(n));
      } else if (n == 0) {
        closed_ = true;
      } else if (errno != EINTR && errno != EAGAIN) {
        return absl::UnavailableError(absl::StrCat("read: ", std::strerror(errno)));
      }
    }
  }
}

ControlChannel::ControlChannel(std::string who, int control_fd, int report_fd)
    : who_(std::move(who)), in_(control_fd), out_(report_fd) {
  ::fcntl(control_fd, F_SETFD, FD_CLOEXEC);
  if (report_fd >= 0) ::fcntl(report_fd, F_SETFD, FD_CLOEXEC);
}

ControlChannel::~ControlChannel() {
  ::close(in_.fd());
  if (out_ >= 0) ::close(out_);
}

absl::Status ControlChannel::Report(const WorkloadReport& r) {
  if (out_ < 0) return absl::FailedPreconditionError(absl::StrCat(who_, " has no report pipe"));
  const std::string line = FormatWorkloadReport(r);
  // One line is far below PIPE_BUF: written whole or not at all.
  ssize_t n;
  do {
    n = ::write(out_, line.data(), line.size());
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(line.size())) {
    return absl::UnavailableError(absl::StrCat(
        who_, ": checkpoint ", r.checkpoint,
        ": cannot report to the launcher: ", n < 0 ? std::strerror(errno) : "short write"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Decision> ControlChannel::Await(int checkpoint, absl::Duration timeout) {
  absl::StatusOr<std::string> line = in_.ReadLine(timeout);
  if (!line.ok()) {
    return absl::Status(line.status().code(),
                        absl::StrCat(who_, ": checkpoint ", checkpoint,
                                     ": no decision from the launcher: ", line.status().message()));
  }
  absl::StatusOr<Decision> d = ParseDecision(*line);
  if (!d.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who_, ": checkpoint ", checkpoint, ": ", d.status().message()));
  }
  if (d->checkpoint != checkpoint) {
    return absl::FailedPreconditionError(absl::StrCat(
        who_, ": at checkpoint ", checkpoint, " got the decision of checkpoint ", d->checkpoint));
  }
  return d;
}

absl::StatusOr<bool> ApplyDecision(const Decision& d, absl::string_view who, int step,
                                   ResizeSchedule* schedule) {
  if (!d.resize) return false;
  const MeshShape now = schedule->At(d.step - 1);
  if (d.to.ffn != now.ffn || d.to.attention < now.attention) {
    return absl::UnimplementedError(absl::StrCat(who, ": checkpoint ", step, ": ", now.Name(),
                                                 " -> ", d.to.Name(),
                                                 ": --autoscale grows the attention side only"));
  }
  if (absl::Status s = schedule->Append(d.step, d.to); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(who, ": checkpoint ", step, ": ", s.message()));
  }
  return true;
}

}  // namespace afd::example
