#pragma once
// Child processes for multi-process tests: spawned by path, waited with a
// deadline, and killed by PID (never by name) if still running when dropped.

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace stepmesh::testing {

class ChildProcess {
 public:
  static absl::StatusOr<ChildProcess> Spawn(const std::vector<std::string>& argv) {
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, args[0], nullptr, nullptr, args.data(), environ);
    if (rc != 0) return absl::InternalError(absl::StrCat("posix_spawn ", argv[0], ": ", rc));
    return ChildProcess(pid);
  }

  ChildProcess(ChildProcess&& other) noexcept : pid_(other.pid_) { other.pid_ = -1; }
  ChildProcess& operator=(ChildProcess&&) = delete;
  ~ChildProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }

  pid_t pid() const { return pid_; }
  void Kill() { ::kill(pid_, SIGKILL); }

  // Non-blocking: the exit code (128+signal when killed) once it ended, else nullopt.
  std::optional<int> TryWait() {
    int status = 0;
    if (pid_ <= 0 || ::waitpid(pid_, &status, WNOHANG) != pid_) return std::nullopt;
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }

  // The exit code, 128+signal when killed, or DEADLINE_EXCEEDED (then killed).
  absl::StatusOr<int> Wait(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (pid_ > 0) {
      int status = 0;
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (absl::Now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        pid_ = -1;
        return absl::DeadlineExceededError("child process did not exit in time (killed)");
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return absl::FailedPreconditionError("already waited");
  }

 private:
  explicit ChildProcess(pid_t pid) : pid_(pid) {}
  pid_t pid_;
};

}  // namespace stepmesh::testing
