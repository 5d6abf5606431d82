#pragma once
// Sends this process's stderr (where the library logs) to a file while alive;
// Finish() restores it and returns what was written.

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace stepmesh::testing {

class StderrCapture {
 public:
  explicit StderrCapture(const std::string& tag)
      : path_(absl::StrCat("/tmp/stepmesh_", tag, "_", getpid(), ".log")) {
    std::fflush(stderr);
    saved_ = dup(2);
    const int fd = open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, 2);
    close(fd);
  }
  ~StderrCapture() {
    Restore();
    unlink(path_.c_str());
  }
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;

  std::string Finish() {
    Restore();
    std::ifstream in(path_);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

 private:
  void Restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    dup2(saved_, 2);
    close(saved_);
    saved_ = -1;
  }
  std::string path_;
  int saved_ = -1;
};

}  // namespace stepmesh::testing
