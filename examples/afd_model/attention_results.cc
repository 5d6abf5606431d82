// The results file of an attention instance (afd_common.h, AttentionResults).

#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "examples/afd_model/afd_common.h"
#include "stepmesh/status.h"

namespace afd::example {

AttentionResults SizedResults(int instance, const RunShape& shape, const ModelConfig& config) {
  AttentionResults r;
  r.instance = instance;
  r.requests = shape.requests;
  r.steps = shape.steps();
  r.layers = config.num_layers;
  r.micro_batches = shape.micro_batches;
  r.servers = shape.ffn;
  r.hidden = config.hidden_size;
  r.vocab = config.vocab_size;
  r.step_end_ns.assign(size_t(r.steps) * r.micro_batches, 0);
  const size_t stages = size_t(r.steps) * r.layers * r.micro_batches;
  r.attention.assign(stages, {});
  r.traces.assign(stages * r.servers, {});
  r.selection_blocks.assign(kSelectionBlockCounts, 0);
  return r;
}

// The results file: a magic, the header scalars, then each vector as a
// 64-bit element count followed by its raw elements (same host, so no
// endianness concerns).
namespace {

constexpr char kMagic[8] = {'A', 'F', 'D', 'R', 'E', 'S', '0', '1'};

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
  Reader(std::FILE* f, uint64_t file_bytes) : f_(f), left_(file_bytes) {}
  template <typename T>
  void Scalar(T* v) {
    ok_ = ok_ && left_ >= sizeof(T) && std::fread(v, sizeof(T), 1, f_) == 1;
    if (ok_) left_ -= sizeof(T);
  }
  template <typename T>
  void Vector(std::vector<T>* v) {
    uint64_t n = 0;
    Scalar(&n);
    // A corrupt count must not allocate more than the file holds.
    if (!ok_ || n > left_ / sizeof(T)) {
      ok_ = false;
      return;
    }
    v->resize(n);
    if (n != 0) ok_ = ok_ && std::fread(v->data(), sizeof(T), n, f_) == n;
    if (ok_) left_ -= n * sizeof(T);
  }
  bool ok() const { return ok_; }
  uint64_t left() const { return left_; }

 private:
  std::FILE* f_;
  uint64_t left_;
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
  io.Vector(&r.selection_blocks);
}

// Adapts Writer's by-value interface to the pointer-taking Fields().
class PtrWriter {
 public:
  explicit PtrWriter(Writer& w) : w_(w) {}
  template <typename T>
  void Scalar(const T* v) {
    w_.Scalar(*v);
  }
  template <typename T>
  void Vector(const std::vector<T>* v) {
    w_.Vector(*v);
  }

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

absl::Status ValidateResults(const AttentionResults& r, const ExpectedResults& e) {
  const RunShape& s = *e.shape;
  const uint64_t steps = s.steps();
  const uint64_t stages = steps * e.layers * s.micro_batches;
  const uint64_t rows = uint64_t(s.requests) * (s.prompt_len + s.decode_steps);
  struct Field {
    const char* name;
    uint64_t got, want;
  };
  const Field fields[] = {
      {"instance", uint64_t(r.instance), uint64_t(e.instance)},
      {"requests", uint64_t(r.requests), uint64_t(s.requests)},
      {"steps", uint64_t(r.steps), steps},
      {"layers", uint64_t(r.layers), uint64_t(e.layers)},
      {"micro_batches", uint64_t(r.micro_batches), uint64_t(s.micro_batches)},
      {"servers", uint64_t(r.servers), uint64_t(s.ffn)},
      {"hidden", uint64_t(r.hidden), uint64_t(e.hidden)},
      {"vocab", uint64_t(r.vocab), uint64_t(e.vocab)},
      {"step_end_ns elements", r.step_end_ns.size(), steps * s.micro_batches},
      {"tokens elements", r.tokens.size(), uint64_t(s.requests) * steps},
      {"logits elements", r.logits.size(), steps * s.requests * uint64_t(e.vocab)},
      {"layer_hidden elements", r.layer_hidden.size(),
       e.layers_dumped ? rows * e.layers * uint64_t(e.hidden) : 0},
      {"attention elements", r.attention.size(), stages},
      {"traces elements", r.traces.size(), stages * s.ffn},
      {"selection_blocks elements", r.selection_blocks.size(), kSelectionBlockCounts},
  };
  for (const Field& f : fields) {
    if (f.got != f.want) {
      return absl::DataLossError(absl::StrCat(
          "results of attention ", e.instance, ": ", f.name, " is ", f.got, ", the run needs ",
          f.want, f.want != 0 && f.got == 0 && e.layers_dumped ? " (not dumped?)" : ""));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<AttentionResults> ReadResults(const std::string& path,
                                             const ExpectedResults& expected) {
  std::unique_ptr<std::FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
  if (!f) return absl::NotFoundError(absl::StrCat("no results file ", path));
  struct stat st {};
  if (::fstat(::fileno(f.get()), &st) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot stat ", path));
  }
  Reader rd(f.get(), static_cast<uint64_t>(st.st_size));
  char magic[sizeof(kMagic)] = {};
  for (char& c : magic) rd.Scalar(&c);
  if (!rd.ok() || std::memcmp(magic, kMagic, sizeof(kMagic)) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": not an afd results file"));
  }
  AttentionResults r;
  Fields(rd, r);
  if (!rd.ok()) return absl::DataLossError(absl::StrCat(path, ": truncated"));
  if (rd.left() != 0) {
    return absl::DataLossError(absl::StrCat(path, ": trailing bytes after the results"));
  }
  if (absl::Status s = ValidateResults(r, expected); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  }
  return r;
}

}  // namespace afd::example
