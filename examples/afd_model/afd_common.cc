#include "examples/afd_model/afd_common.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace afd::example {
namespace {

constexpr char kMagic[8] = {'A', 'F', 'D', 'R', 'E', 'S', '0', '1'};

}  // namespace

absl::StatusOr<Flags> Flags::Parse(int argc, char** argv,
                                   const std::vector<std::string>& switches) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument ", arg));
    }
    std::string name = arg.substr(2);
    std::string value;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    } else if (std::find(switches.begin(), switches.end(), name) != switches.end()) {
      value = "true";
    } else {
      if (i + 1 >= argc) return absl::InvalidArgumentError(absl::StrCat("missing value for ", arg));
      value = argv[++i];
    }
    flags.values_[name] = value;
    flags.used_[name] = false;
  }
  return flags;
}

absl::StatusOr<int64_t> Flags::Int(absl::string_view name, int64_t fallback) {
  auto it = values_.find(std::string(name));
  if (it == values_.end()) return fallback;
  used_[it->first] = true;
  int64_t value = 0;
  if (!absl::SimpleAtoi(it->second, &value)) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": not an integer: ", it->second));
  }
  return value;
}

std::string Flags::Str(absl::string_view name, absl::string_view fallback) {
  auto it = values_.find(std::string(name));
  if (it == values_.end()) return std::string(fallback);
  used_[it->first] = true;
  return it->second;
}

bool Flags::Bool(absl::string_view name) {
  auto it = values_.find(std::string(name));
  if (it == values_.end()) return false;
  used_[it->first] = true;
  return it->second == "true" || it->second == "1";
}

absl::Status Flags::CheckAllUsed() const {
  std::vector<std::string> unknown;
  for (const auto& [name, used] : used_) {
    if (!used) unknown.push_back("--" + name);
  }
  if (unknown.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("unknown flag(s): ", absl::StrJoin(unknown, " ")));
}

absl::Status RunShape::Validate() const {
  if (attention < 1 || ffn < 1) return absl::InvalidArgumentError("need at least 1A1F");
  if (micro_batches < 1) return absl::InvalidArgumentError("--micro-batches must be >= 1");
  if (requests < micro_batches) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--requests (", requests, ") must be at least --micro-batches (", micro_batches, ")"));
  }
  if (prompt_len < 1 || decode_steps < 0) {
    return absl::InvalidArgumentError("--prompt-len must be >= 1 and --decode-steps >= 0");
  }
  if (transport != "tcp" && transport != "rdma") {
    return absl::InvalidArgumentError("--transport must be tcp or rdma");
  }
  if (backend != "cpu_mock" && backend != "cuda") {
    return absl::InvalidArgumentError("--backend must be cpu_mock or cuda");
  }
  if (timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("--timeout-ms must be > 0");
  return absl::OkStatus();
}

absl::StatusOr<RunShape> ParseRunFlags(Flags& flags) {
  RunShape s;
  s.config = flags.Str("config", s.config);
  auto read_int = [&](absl::string_view name, int* out) -> absl::Status {
    absl::StatusOr<int64_t> v = flags.Int(name, *out);
    if (!v.ok()) return v.status();
    *out = static_cast<int>(*v);
    return absl::OkStatus();
  };
  for (auto [name, field] : std::initializer_list<std::pair<absl::string_view, int*>>{
           {"attention", &s.attention},
           {"ffn", &s.ffn},
           {"requests", &s.requests},
           {"prompt-len", &s.prompt_len},
           {"decode-steps", &s.decode_steps},
           {"micro-batches", &s.micro_batches}}) {
    if (absl::Status st = read_int(name, field); !st.ok()) return st;
  }
  s.transport = flags.Str("transport", s.transport);
  s.backend = flags.Str("backend", s.backend);
  s.poll_mode = flags.Str("poll-mode", s.poll_mode);
  absl::StatusOr<int64_t> timeout_ms = flags.Int("timeout-ms", absl::ToInt64Milliseconds(s.timeout));
  if (!timeout_ms.ok()) return timeout_ms.status();
  s.timeout = absl::Milliseconds(*timeout_ms);
  if (absl::Status st = s.Validate(); !st.ok()) return st;
  return s;
}

void AppendRunFlags(const RunShape& s, std::vector<std::string>* argv) {
  auto add = [&](const char* name, const std::string& value) {
    argv->push_back(absl::StrCat("--", name));
    argv->push_back(value);
  };
  add("config", s.config);
  add("attention", absl::StrCat(s.attention));
  add("ffn", absl::StrCat(s.ffn));
  add("requests", absl::StrCat(s.requests));
  add("prompt-len", absl::StrCat(s.prompt_len));
  add("decode-steps", absl::StrCat(s.decode_steps));
  add("micro-batches", absl::StrCat(s.micro_batches));
  add("transport", s.transport);
  add("backend", s.backend);
  add("poll-mode", s.poll_mode);
  add("timeout-ms", absl::StrCat(absl::ToInt64Milliseconds(s.timeout)));
}

absl::StatusOr<stepmesh::MeshOptions> MeshOptionsFor(const RunShape& shape, stepmesh::Role role,
                                                     int rank, const std::string& scheduler) {
  // STEPMESH_* variables apply (the auth token the launcher passes down, the
  // log level, ...); the run shape's flags below win over them.
  absl::StatusOr<stepmesh::MeshOptions> from_env = stepmesh::MeshOptions::FromEnv();
  if (!from_env.ok()) return from_env.status();
  stepmesh::MeshOptions o = *from_env;
  o.role = role;
  o.rank = rank;
  o.num_workers = shape.attention;
  o.num_servers = shape.ffn;
  o.scheduler = scheduler;
  o.transport = shape.transport;
  o.backend = shape.backend;
  o.timeout = shape.timeout;
  // Every micro-batch has one request in flight per attention instance; a
  // few spare slots cover the end-of-run barrier.
  o.max_inflight_requests = std::max(64, 4 * shape.micro_batches);
  absl::StatusOr<stepmesh::PollMode> mode = stepmesh::ParsePollMode(shape.poll_mode);
  if (!mode.ok()) return mode.status();
  o.threads.poll_mode = *mode;
  if (absl::Status st = o.Validate(); !st.ok()) return st;
  return o;
}

int MicroBatchOfGroup(stepmesh::Key group, int micro_batches) {
  for (int m = 0; m < micro_batches; ++m) {
    if (group == PushKey(m, A2FTensor::kCodes)) return m;
  }
  return -1;
}

// The results file: a magic, the header scalars, then each vector as a
// 64-bit element count followed by its raw elements (same host, so no
// endianness concerns).
namespace {

class Writer {
 public:
  explicit Writer(std::FILE* f) : f_(f) {}
  template <typename T>
  void Scalar(const T& v) {
    ok_ = ok_ && std::fwrite(&v, sizeof(T), 1, f_) == 1;
  }
  template <typename T>
  void Vector(const std::vector<T>& v) {
    Scalar(static_cast<uint64_t>(v.size()));
    if (!v.empty()) ok_ = ok_ && std::fwrite(v.data(), sizeof(T), v.size(), f_) == v.size();
  }
  bool ok() const { return ok_; }

 private:
  std::FILE* f_;
  bool ok_ = true;
};

class Reader {
 public:
  explicit Reader(std::FILE* f) : f_(f) {}
  template <typename T>
  void Scalar(T* v) {
    ok_ = ok_ && std::fread(v, sizeof(T), 1, f_) == 1;
  }
  template <typename T>
  void Vector(std::vector<T>* v) {
    uint64_t n = 0;
    Scalar(&n);
    // A corrupt count must not allocate the world.
    if (!ok_ || n > (uint64_t{1} << 32)) {
      ok_ = false;
      return;
    }
    v->resize(n);
    if (n != 0) ok_ = ok_ && std::fread(v->data(), sizeof(T), n, f_) == n;
  }
  bool ok() const { return ok_; }

 private:
  std::FILE* f_;
  bool ok_ = true;
};

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};

template <typename IO, typename R>
void Fields(IO& io, R& r) {
  io.Scalar(&r.instance);
  io.Scalar(&r.requests);
  io.Scalar(&r.steps);
  io.Scalar(&r.layers);
  io.Scalar(&r.micro_batches);
  io.Scalar(&r.servers);
  io.Scalar(&r.hidden);
  io.Scalar(&r.vocab);
  io.Scalar(&r.start_ns);
  io.Vector(&r.step_end_ns);
  io.Vector(&r.tokens);
  io.Vector(&r.logits);
  io.Vector(&r.layer_hidden);
  io.Vector(&r.attention);
  io.Vector(&r.traces);
}

// Adapts Writer's by-value interface to the pointer-taking Fields().
class PtrWriter {
 public:
  explicit PtrWriter(Writer& w) : w_(w) {}
  template <typename T>
  void Scalar(const T* v) { w_.Scalar(*v); }
  template <typename T>
  void Vector(const std::vector<T>* v) { w_.Vector(*v); }

 private:
  Writer& w_;
};

}  // namespace

absl::Status WriteResults(const std::string& path, const AttentionResults& r) {
  // Write to a temporary name and rename, so the launcher never reads a
  // half-written file from an instance that died mid-write.
  const std::string tmp = path + ".tmp";
  {
    std::unique_ptr<std::FILE, FileCloser> f(std::fopen(tmp.c_str(), "wb"));
    if (!f) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
    Writer w(f.get());
    for (char c : kMagic) w.Scalar(c);
    PtrWriter pw(w);
    Fields(pw, r);
    if (!w.ok()) return absl::DataLossError(absl::StrCat("short write to ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<AttentionResults> ReadResults(const std::string& path) {
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
  if (!f) return absl::NotFoundError(absl::StrCat("no results file ", path));
  Reader rd(f.get());
  char magic[sizeof(kMagic)] = {};
  for (char& c : magic) rd.Scalar(&c);
  if (!rd.ok() || std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": not an afd results file"));
  }
  AttentionResults r;
  Fields(rd, r);
  if (!rd.ok()) return absl::DataLossError(absl::StrCat(path, ": truncated"));
  return r;
}

}  // namespace afd::example
