// afd_launch's child processes (afd_launch_main.cc): each one started by
// fork+exec with its stdout/stderr in files, killed and reaped by PID when
// dropped while still running, and killed by the kernel if the launcher dies
// (PR_SET_PDEATHSIG). Plus the small file helpers the launcher needs around
// them.

#ifndef STEPMESH_EXAMPLES_AFD_MODEL_LAUNCH_CHILD_H_
#define STEPMESH_EXAMPLES_AFD_MODEL_LAUNCH_CHILD_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace afd::example {

class Child {
 public:
  // `env`: the child's whole environment ("NAME=value" entries). `netns_fd`
  // (>= 0): the network namespace the child runs in (--hosts). `control_fd`
  // and `report_fd` (>= 0, --autoscale): become the child's fds
  // kChildControlFd and kChildReportFd (autoscale_launch.h).
  static absl::StatusOr<std::unique_ptr<Child>> Start(
      std::string name, const std::vector<std::string>& argv, const std::vector<std::string>& env,
      const std::string& out_path, const std::string& err_path, int netns_fd = -1,
      int control_fd = -1, int report_fd = -1);

  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() { Kill(); }

  // Non-blocking; true once exited (exit_code() then valid).
  bool Poll();
  // SIGKILL and reap.
  void Kill();
  // A signal without reaping (the kill test: the child's exit is observed by Poll).
  void Signal(int sig);

  const std::string& name() const { return name_; }
  int exit_code() const { return exit_code_; }
  absl::Time exited_at() const { return exited_at_; }
  bool killed_by_launcher() const { return killed_; }
  bool running() const { return pid_ > 0; }
  std::string Stdout() const { return ReadWholeFile(out_path_); }
  std::string Stderr() const { return ReadWholeFile(err_path_); }

 private:
  Child(std::string name, pid_t pid, std::string out_path, std::string err_path)
      : name_(std::move(name)),
        pid_(pid),
        out_path_(std::move(out_path)),
        err_path_(std::move(err_path)) {}
  static std::string ReadWholeFile(const std::string& path);

  std::string name_;
  pid_t pid_;
  std::string out_path_, err_path_;
  int exit_code_ = -1;
  absl::Time exited_at_;
  bool killed_ = false;
};

// The directory of this program (afd_attention and afd_ffn live there).
std::string SelfDir();

// The last `lines` lines of `text`, indented.
std::string Tail(const std::string& text, int lines);

// Removes the launcher's own temporary directory (flat: logs and results).
void RemoveWorkDir(const std::string& dir);

}  // namespace afd::example

#endif  // STEPMESH_EXAMPLES_AFD_MODEL_LAUNCH_CHILD_H_
