// afd_launch's child processes (launch_child.h).

#include "examples/afd_model/launch_child.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "examples/afd_model/autoscale_launch.h"

namespace afd::example {

absl::StatusOr<std::unique_ptr<Child>> Child::Start(std::string name,
                                                    const std::vector<std::string>& argv,
                                                    const std::vector<std::string>& env,
                                                    const std::string& out_path,
                                                    const std::string& err_path, int netns_fd,
                                                    int control_fd, int report_fd) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::vector<char*> envp;
  for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out < 0 || err < 0) {
    if (out >= 0) ::close(out);
    if (err >= 0) ::close(err);
    return absl::UnavailableError(absl::StrCat("cannot create log files for ", name));
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(out);
    ::close(err);
    return absl::UnavailableError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    // Only async-signal-safe calls until exec (the parent has threads).
    // The kernel kills the child if the launcher dies, even by SIGKILL
    // (a ctest timeout), so nothing is left behind.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    if (netns_fd >= 0 && ::setns(netns_fd, CLONE_NEWNET) != 0) ::_exit(126);
    ::dup2(out, STDOUT_FILENO);
    ::dup2(err, STDERR_FILENO);
    // --autoscale: the pipe ends become fds 3 and 4 (dup2 clears
    // FD_CLOEXEC; via fds >= 100 so neither overwrites the other).
    if (control_fd >= 0) {
      const int c = ::fcntl(control_fd, F_DUPFD, 100);
      const int r = report_fd >= 0 ? ::fcntl(report_fd, F_DUPFD, 100) : -1;
      if (c < 0 || ::dup2(c, kChildControlFd) < 0) ::_exit(125);
      if (report_fd >= 0 && (r < 0 || ::dup2(r, kChildReportFd) < 0)) ::_exit(125);
    }
    ::execve(args[0], args.data(), envp.data());
    ::_exit(127);
  }
  ::close(out);
  ::close(err);
  return std::unique_ptr<Child>(new Child(std::move(name), pid, out_path, err_path));
}

bool Child::Poll() {
  if (pid_ <= 0) return true;
  int status = 0;
  if (::waitpid(pid_, &status, WNOHANG) != pid_) return false;
  exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  exited_at_ = absl::Now();
  pid_ = -1;
  return true;
}

void Child::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  if (exit_code_ < 0) exit_code_ = 128 + SIGKILL;
  exited_at_ = absl::Now();
  killed_ = true;
  pid_ = -1;
}

void Child::Signal(int sig) {
  if (pid_ > 0) ::kill(pid_, sig);
}

std::string Child::ReadWholeFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string SelfDir() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, n);
  return path.substr(0, path.rfind('/'));
}

std::string Tail(const std::string& text, int lines) {
  size_t pos = text.size();
  for (int i = 0; i <= lines && pos > 0; ++i) {
    const size_t nl = text.rfind('\n', pos - 1);
    if (nl == std::string::npos) {
      pos = 0;
      break;
    }
    if (i < lines)
      pos = nl;
    else
      pos = nl + 1;
  }
  std::string out;
  std::istringstream in(text.substr(pos));
  for (std::string line; std::getline(in, line);) absl::StrAppend(&out, "    ", line, "\n");
  return out;
}

void RemoveWorkDir(const std::string& dir) {
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") ::unlink((dir + "/" + name).c_str());
    }
    ::closedir(d);
  }
  ::rmdir(dir.c_str());
}

}  // namespace afd::example
