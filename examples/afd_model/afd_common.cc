#include "examples/afd_model/afd_common.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "examples/afd_model/attention_side.h"
#include "stepmesh/status.h"

namespace afd::example {

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
    flags.values_[name].push_back(value);
    flags.used_[name] = false;
  }
  return flags;
}

absl::StatusOr<int64_t> Flags::Int(absl::string_view name, int64_t fallback) {
  auto it = values_.find(std::string(name));
  if (it == values_.end()) return fallback;
  used_[it->first] = true;
  int64_t value = 0;
  if (!absl::SimpleAtoi(it->second.back(), &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, ": not an integer: ", it->second.back()));
  }
  return value;
}

std::string Flags::Str(absl::string_view name, absl::string_view fallback) {
  auto it = values_.find(std::string(name));
  if (it == values_.end()) return std::string(fallback);
  used_[it->first] = true;
  return it->second.back();
}

std::vector<std::string> Flags::All(absl::string_view name) {
  auto it = values_.find(std::string(name));
  if (it == values_.end()) return {};
  used_[it->first] = true;
  return it->second;
}

bool Flags::Bool(absl::string_view name) {
  auto it = values_.find(std::string(name));
  if (it == values_.end()) return false;
  used_[it->first] = true;
  return it->second.back() == "true" || it->second.back() == "1";
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
  if (transport != "tcp" && transport != "rdma" && transport != "libfabric") {
    return absl::InvalidArgumentError(
        "--transport must be tcp, rdma or libfabric (provider: STEPMESH_FI_PROVIDER)");
  }
  if (backend != "cpu_mock" && backend != "cuda") {
    return absl::InvalidArgumentError("--backend must be cpu_mock or cuda");
  }
  if (KvCacheFormat f; !ParseKvCacheFormat(kv_cache, &f)) {
    return absl::InvalidArgumentError("--kv-cache must be fp32, bf16 or fp8");
  }
  if (engine != "auto" && engine != "cpu" && engine != "cuda" && engine != "cpu-device") {
    return absl::InvalidArgumentError("--engine must be auto, cpu, cuda or cpu-device");
  }
  if (!emulate_compute.empty()) {
    // The emulated engine computes nothing: no kernels to pick, no KV cache.
    if (engine != "auto") {
      return absl::InvalidArgumentError(
          absl::StrCat("--emulate-compute selects the emulated engine; drop --engine ", engine));
    }
    if (kv_cache != "fp32") {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv-cache ", kv_cache, ": the emulated engine (--emulate-compute) keeps no KV cache"));
    }
  }
  if (ResolvedEngine() == "cuda" && backend != "cuda") {
    return absl::InvalidArgumentError("--engine cuda needs --backend cuda");
  }
  if (ResolvedEngine() != "cpu" && kv_cache != "fp32") {
    return absl::InvalidArgumentError(absl::StrCat("--kv-cache ", kv_cache,
                                                   " needs --engine cpu (the ", ResolvedEngine(),
                                                   " engine keeps an fp32 KV cache)"));
  }
  if (ResolvedEngine() == "cpu-device" && backend != "cpu_mock") {
    // Its host functions read "device" memory, host memory only on cpu_mock.
    return absl::InvalidArgumentError("--engine cpu-device needs --backend cpu_mock");
  }
  if (timeout <= absl::ZeroDuration())
    return absl::InvalidArgumentError("--timeout-ms must be > 0");
  if (!context_growth.empty()) {
    int from = 0, to = 0;
    if (!ParseContextGrowth(context_growth, &from, &to)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--context-growth ", context_growth,
          ": want FROM:TO, the mean context per request in tokens at the first and the last "
          "step, each in [1, 16777216] (e.g. 1024:8192)"));
    }
    if (emulate_compute.empty()) {
      return absl::InvalidArgumentError(
          "--context-growth needs --emulate-compute (the emulated attention follows the "
          "context; the model's own requests grow by one token a step)");
    }
  }
  if (emulated_batch != "per_instance" && emulated_batch != "global") {
    return absl::InvalidArgumentError(
        absl::StrCat("--emulated-batch ", emulated_batch, ": must be per_instance or global"));
  }
  if (emulated_batch == "global" && context_growth.empty()) {
    return absl::InvalidArgumentError(
        "--emulated-batch global needs --context-growth (the planner's mean load per step)");
  }
  if (max_attention < 0 || (max_attention > 0 && max_attention < attention) || decision_every < 0 ||
      (decision_every > 0) != (max_attention > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-attention ", max_attention, " / --decision-every ", decision_every,
                     ": both or neither (afd_launch --autoscale sets them), the capacity at least "
                     "--attention ",
                     attention, ", a checkpoint every K >= 1 steps"));
  }
  if (max_attention > 0 && !resize.empty() && Schedule().Capacity().attention > max_attention) {
    return absl::InvalidArgumentError(
        absl::StrCat("--resize grows past --max-attention ", max_attention));
  }
  if (!resize.empty()) {
    STEPMESH_RETURN_IF_ERROR(ResizeSchedule::Parse({attention, ffn}, steps(), resize).status());
    // Re-sharding and per-step partition counts are the host-function
    // engines' (the device engines keep their FFN weights and F fixed).
    if (ResolvedEngine() != "cpu" && ResolvedEngine() != "emulated") {
      return absl::InvalidArgumentError(absl::StrCat(
          "--resize needs the cpu or the emulated engine (--engine cpu, --emulate-compute); the ",
          ResolvedEngine(), " engine does not re-shard its FFN"));
    }
  }
  return absl::OkStatus();
}

bool ParseContextGrowth(absl::string_view text, int* from, int* to) {
  const size_t colon = text.find(':');
  return colon != absl::string_view::npos && absl::SimpleAtoi(text.substr(0, colon), from) &&
         absl::SimpleAtoi(text.substr(colon + 1), to) && *from >= 1 && *to >= 1 &&
         *from <= (1 << 24) && *to <= (1 << 24);
}

ResizeSchedule RunShape::Schedule() const {
  absl::StatusOr<ResizeSchedule> s = ResizeSchedule::Parse({attention, ffn}, steps(), resize);
  return s.ok() ? *std::move(s) : ResizeSchedule({attention, ffn}, steps());
}

MeshShape RunShape::Capacity() const {
  MeshShape cap = Schedule().Capacity();
  cap.attention = std::max(cap.attention, max_attention);
  return cap;
}

double RunShape::ContextAt(int step) const {
  int from = 0, to = 0;
  if (!ParseContextGrowth(context_growth, &from, &to)) return 0;
  if (steps() <= 1) return from;
  return from + (to - from) * static_cast<double>(step) / (steps() - 1);
}

int RunShape::VirtualBatch(int plan_batch, int instances) const {
  if (emulated_batch != "global" || instances <= 0) return plan_batch;
  // The global batch of the start shape, split over the step's instances
  // (rounded, as planner::Predict does).
  const double b = std::round(double(plan_batch) * attention / instances);
  return static_cast<int>(std::max(1.0, b));
}

RunShape RunShape::ForAttention(int rank) const {
  if (!elastic()) return *this;
  const ResizeSchedule schedule = Schedule();
  RunShape s = *this;
  s.attention = Capacity().attention;
  s.ffn = Capacity().ffn;
  s.decode_steps = schedule.AttentionSpan(rank).steps() - 1;
  return s;
}

RunShape RunShape::ForFfn() const {
  if (!elastic()) return *this;
  RunShape s = *this;
  s.attention = Capacity().attention;
  s.ffn = Capacity().ffn;
  return s;
}

int64_t LayerDumpRow(const RunShape& shape, const ModelConfig& config, int step, int layer,
                     int first_request) {
  // [step][layer][rows of the step][H]: step 0 has requests * prompt_len
  // rows, each later step one row per request.
  const int64_t per_request = shape.TokensPerRequest(step);
  const int64_t step_rows = per_request * shape.requests;
  const int64_t rows_before = step == 0
                                  ? 0
                                  : int64_t{shape.prompt_len} * shape.requests * config.num_layers +
                                        int64_t{step - 1} * shape.requests * config.num_layers;
  return rows_before + layer * step_rows + first_request * per_request;
}

absl::Status ValidateRunForModel(const RunShape& shape, const ExampleModel& model) {
  const ModelConfig& config = model.config;
  if (model.step5 && !shape.emulate_compute.empty()) {
    // The emulated engine runs no model, and the report's Step-5 lines would
    // describe a selection that never happened; a plan's latency model
    // (e.g. a Step-5-like plan) is what stands for the model there.
    return absl::InvalidArgumentError(
        absl::StrCat("--emulate-compute with the Step-5 model ", config.name,
                     ": the emulated engine runs no model; emulate with a Step-3 --model (the "
                     "wire shapes) and a plan for the model you want (docs/planning.md)"));
  }
  if (model.step5) {
    // Step-5's attention side is CPU code with fp32 caches; the device
    // engines (cpu-device, cuda) implement Step-3's MFA attention only.
    if (shape.ResolvedEngine() != "cpu") {
      return absl::InvalidArgumentError(absl::StrCat(
          "--engine ", shape.engine, " (", shape.ResolvedEngine(), "): the Step-5 model ",
          config.name, " runs on the cpu engine only (--engine cpu)"));
    }
    if (shape.kv_cache != "fp32") {
      return absl::InvalidArgumentError(absl::StrCat("--kv-cache ", shape.kv_cache,
                                                     ": the Step-5 model ", config.name,
                                                     " keeps an fp32 KV cache"));
    }
  }
  // Partition p owns experts e % F == p and a 1/F column slice of the shared
  // expert and the dense FFN: each must get at least one of each.
  const int64_t max_ffn = std::min<int64_t>(
      {config.num_experts, config.shared_intermediate, config.dense_intermediate});
  const int most_ffn = shape.Schedule().Capacity().ffn;
  if (most_ffn > max_ffn) {
    return absl::InvalidArgumentError(absl::StrCat(
        shape.ffn == most_ffn ? "--ffn " : "--resize to ", most_ffn,
        shape.ffn == most_ffn ? ": at most " : "F: at most ", max_ffn, " FFN instances for ",
        config.name, " (", config.num_experts, " experts; every instance owns at least one)"));
  }
  const int64_t positions = int64_t{shape.prompt_len} + shape.decode_steps;
  if (positions > config.max_positions) {
    return absl::InvalidArgumentError(
        absl::StrCat("--prompt-len + --decode-steps = ", positions, " exceeds ", config.name,
                     "'s max_position_embedding ", config.max_positions));
  }
  return absl::OkStatus();
}

HostMemoryEstimate EstimateHostMemory(const RunShape& shape, const ModelConfig& c) {
  constexpr int64_t kF32 = 4;
  const int64_t h = c.hidden_size;
  const int64_t attention_layer = h * (c.q_rank + 2 * c.head_dim) + c.q_rank +
                                  c.q_rank * c.attention_width() + c.attention_width() * h + 2 * h;
  int64_t attention_params = 2 * c.vocab_size * h + h + c.num_layers * attention_layer;
  int64_t ffn_params = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.is_moe_layer[l]) {
      attention_params += int64_t{c.num_experts} * h;  // router
      ffn_params += 3 * h * (c.shared_intermediate + c.num_experts * c.expert_intermediate);
    } else {
      ffn_params += 3 * h * c.dense_intermediate;
    }
  }
  const int64_t positions = int64_t{shape.prompt_len} + shape.decode_steps;
  KvCacheFormat kv_format = KvCacheFormat::kFp32;
  ParseKvCacheFormat(shape.kv_cache, &kv_format);
  const int64_t kv_per_request =
      c.num_layers * positions * KvCacheBytesPerToken(kv_format, c.head_dim);
  // Activations of the largest step: the residual stream, q, attention
  // output, FFN intermediates, logits; generous, it only has to catch runs
  // that cannot fit.
  const int64_t slot = shape.SlotRows();
  const int64_t widest = std::max({h, c.attention_width(), c.dense_intermediate,
                                   c.num_experts * c.expert_intermediate, c.vocab_size});
  const int64_t activations = 8 * slot * shape.micro_batches * widest * kF32;
  const int64_t wire = slot * shape.micro_batches * h * (1 + 2 * shape.ffn + 1);
  constexpr int64_t kProcessBase = int64_t{64} << 20;  // code, libraries, mesh buffers
  // What an attention instance collects (and the launcher reads back).
  const int64_t results = int64_t{shape.steps()} * shape.requests * c.vocab_size * kF32 +
                          int64_t{shape.requests} * positions * c.num_layers * h * kF32;
  HostMemoryEstimate e;
  e.reference = (attention_params + ffn_params) * kF32 +
                int64_t{shape.attention} * shape.requests * kv_per_request +
                activations * shape.attention + shape.attention * results + kProcessBase;
  if (shape.ResolvedEngine() != "cuda") {
    e.attention_instance = attention_params * kF32 + shape.requests * kv_per_request + activations +
                           wire + results + kProcessBase;
    e.ffn_instance =
        ffn_params * kF32 / shape.ffn + activations + wire * shape.attention + kProcessBase;
    return e;
  }
  // The cuda engine: weights (bf16 linears, fp32 embedding), KV cache and
  // activations on the device, every process on the same GPU.
  constexpr int64_t kBf16 = 2;
  e.attention_instance = results + wire + kProcessBase;
  e.ffn_instance = wire * shape.attention + kProcessBase;
  e.device_total =
      shape.attention * ((attention_params - c.vocab_size * h) * kBf16 + c.vocab_size * h * kF32 +
                         shape.requests * kv_per_request + activations + wire) +
      ffn_params * kBf16 + shape.ffn * (activations + wire * shape.attention);
  return e;
}

ProgressWriter::~ProgressWriter() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status ProgressWriter::Open(const std::string& path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) return absl::UnavailableError(absl::StrCat("cannot create ", path));
  return absl::OkStatus();
}

void ProgressWriter::Update(int step, int layer) {
  if (fd_ < 0) return;
  // Fixed width, so the reader never sees a mix of two lengths.
  char line[32];
  const int n = std::snprintf(line, sizeof(line), "%12d %12d\n", step, layer);
  if (n > 0) (void)!::pwrite(fd_, line, static_cast<size_t>(n), 0);
}

Progress ReadProgress(const std::string& path) {
  Progress p;
  std::ifstream in(path);
  int step = -1, layer = -1;
  if (in >> step >> layer) p = {step, layer};
  return p;
}

absl::StatusOr<RunShape> ParseRunFlags(Flags& flags) {
  RunShape s;
  // --model picks the model (docs/example.md, "Models"); --config is the
  // older name of the same flag.
  const std::string config = flags.Str("config", "");
  const std::string model = flags.Str("model", "");
  if (!config.empty() && !model.empty() && config != model) {
    return absl::InvalidArgumentError(
        absl::StrCat("--model ", model, " and --config ", config, " disagree; pass one"));
  }
  s.config = !model.empty() ? model : !config.empty() ? config : s.config;
  // Unset mesh flags come from the environment (STEPMESH_* / DMLC_*), as in
  // every stepmesh program; the built-in defaults where a variable is unset.
  {
    stepmesh::MeshOptions base;
    base.num_workers = s.attention;
    base.num_servers = s.ffn;
    base.transport = s.transport;
    base.backend = s.backend;
    base.timeout = s.timeout;
    STEPMESH_ASSIGN_OR_RETURN(base.threads.poll_mode, stepmesh::ParsePollMode(s.poll_mode));
    STEPMESH_ASSIGN_OR_RETURN(const stepmesh::MeshOptions env,
                              stepmesh::MeshOptions::FromEnv(base));
    s.attention = env.num_workers;
    s.ffn = env.num_servers;
    s.transport = env.transport;
    s.backend = env.backend;
    s.timeout = env.timeout;
    s.poll_mode = std::string(stepmesh::PollModeName(env.threads.poll_mode));
  }
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
  s.engine = flags.Str("engine", s.engine);
  s.kv_cache = flags.Str("kv-cache", s.kv_cache);
  s.emulate_compute = flags.Str("emulate-compute", "");
  s.resize = flags.All("resize");
  for (auto [name, field] : std::initializer_list<std::pair<absl::string_view, int*>>{
           {"max-attention", &s.max_attention}, {"decision-every", &s.decision_every}}) {
    if (absl::Status st = read_int(name, field); !st.ok()) return st;
  }
  s.context_growth = flags.Str("context-growth", "");
  s.emulated_batch = flags.Str("emulated-batch", s.emulated_batch);
  absl::StatusOr<int64_t> timeout_ms =
      flags.Int("timeout-ms", absl::ToInt64Milliseconds(s.timeout));
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
  add("engine", s.engine);
  add("kv-cache", s.kv_cache);
  add("timeout-ms", absl::StrCat(absl::ToInt64Milliseconds(s.timeout)));
  if (!s.emulate_compute.empty()) add("emulate-compute", s.emulate_compute);
  for (const std::string& spec : s.resize) add("resize", spec);
  if (s.max_attention > 0) add("max-attention", absl::StrCat(s.max_attention));
  if (s.decision_every > 0) add("decision-every", absl::StrCat(s.decision_every));
  if (!s.context_growth.empty()) add("context-growth", s.context_growth);
  if (s.emulated_batch != "per_instance") add("emulated-batch", s.emulated_batch);
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
  if (shape.elastic()) {
    // Elastic (--resize, --autoscale): the start shape forms the mesh; the
    // capacity is the most of each the run may have, so no region is
    // re-registered.
    const MeshShape cap = shape.Capacity();
    o.max_workers = cap.attention;
    o.max_servers = cap.ffn;
  }
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

uint32_t StageOf(const RunShape& shape, int layers, StageId id) {
  // 0 is left unused; push keys (1000 + ...) never name a group here: every
  // request of the example carries a stage.
  return 1 + static_cast<uint32_t>((int64_t{id.step} * layers + id.layer) * shape.micro_batches +
                                   id.micro_batch);
}

bool DecodeStage(const RunShape& shape, int layers, stepmesh::Key group, StageId* id) {
  const int64_t total = int64_t{shape.steps()} * layers * shape.micro_batches;
  if (group < 1 || static_cast<int64_t>(group) > total) return false;
  const int64_t index = static_cast<int64_t>(group) - 1;
  id->micro_batch = static_cast<int>(index % shape.micro_batches);
  id->layer = static_cast<int>(index / shape.micro_batches % layers);
  id->step = static_cast<int>(index / shape.micro_batches / layers);
  return true;
}

void WriteWireHeader(const WireHeader& h, int32_t* out) {
  const int32_t words[kWireHeaderInts] = {kWireHeaderMagic, h.step,     h.layer, h.micro_batch,
                                          h.rows,           h.instance, h.flags, h.hidden};
  std::memcpy(out, words, sizeof(words));
}

absl::Status CheckWireHeader(const int32_t* got, const WireHeader& want, int ffn) {
  const auto who = [&] {
    return absl::StrCat("ffn ", ffn, ": attention ", want.instance, " sent ");
  };
  if (got[0] != kWireHeaderMagic) {
    return absl::DataLossError(absl::StrCat(who(), "a frame without an A2F header (magic 0x",
                                            absl::Hex(static_cast<uint32_t>(got[0])), ")"));
  }
  if (got[1] != want.step || got[2] != want.layer || got[3] != want.micro_batch) {
    return absl::DataLossError(absl::StrCat(who(), "step ", got[1], " layer ", got[2],
                                            " micro-batch ", got[3], ", this FFN expects step ",
                                            want.step, " layer ", want.layer, " micro-batch ",
                                            want.micro_batch));
  }
  if (got[4] != want.rows || got[5] != want.instance || got[6] != want.flags ||
      got[7] != want.hidden) {
    return absl::DataLossError(
        absl::StrCat(who(), "a header for ", got[4], " rows from instance ", got[5], " flags ",
                     got[6], " hidden ", got[7], " with step ", want.step, " layer ", want.layer,
                     "; expected ", want.rows, " rows, instance ", want.instance, ", flags ",
                     want.flags, ", hidden ", want.hidden));
  }
  return absl::OkStatus();
}

}  // namespace afd::example
