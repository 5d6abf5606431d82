#include "examples/afd_model/afd_report.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "examples/afd_model/kernels/cpu_kernels.h"
#include "examples/afd_model/model_weights.h"
#include "examples/afd_model/reference.h"
#include "examples/afd_model/step5/step5_attention_side.h"
#include "stepmesh/trace.h"

namespace afd::example {
namespace {

double Ms(uint64_t ns) { return static_cast<double>(ns) * 1e-6; }

// b - a in ns, or -1 when a stamp is missing or out of order.
int64_t Span(uint64_t a, uint64_t b) {
  if (a == 0 || b == 0 || b < a) return -1;
  return static_cast<int64_t>(b - a);
}

struct Mean {
  double sum = 0.0;
  int64_t n = 0;
  void Add(int64_t ns) {
    if (ns < 0) return;
    sum += static_cast<double>(ns);
    ++n;
  }
  double ms() const { return n == 0 ? 0.0 : sum / n * 1e-6; }
};

uint64_t StepEnd(const AttentionResults& r, int step) {
  uint64_t end = 0;
  for (int m = 0; m < r.micro_batches; ++m) {
    end = std::max(end, r.step_end_ns[size_t(step) * r.micro_batches + m]);
  }
  return end;
}

using Interval = std::pair<uint64_t, uint64_t>;

// Sorted, disjoint union of the intervals.
std::vector<Interval> Union(std::vector<Interval> v) {
  std::sort(v.begin(), v.end());
  std::vector<Interval> out;
  for (const Interval& i : v) {
    if (!out.empty() && i.first <= out.back().second) {
      out.back().second = std::max(out.back().second, i.second);
    } else {
      out.push_back(i);
    }
  }
  return out;
}

// Length of [a, b) covered by the sorted disjoint `busy` intervals.
uint64_t Covered(const std::vector<Interval>& busy, uint64_t a, uint64_t b) {
  uint64_t covered = 0;
  auto it = std::upper_bound(busy.begin(), busy.end(), Interval{a, ~uint64_t{0}});
  if (it != busy.begin()) --it;
  for (; it != busy.end() && it->first < b; ++it) {
    const uint64_t lo = std::max(a, it->first);
    const uint64_t hi = std::min(b, it->second);
    if (hi > lo) covered += hi - lo;
  }
  return covered;
}

// Step-5: what its caches hold per token, and how much history the global
// layers' selection kept.
void AppendStep5Lines(const RunShape& shape, const step5::Step5Config& c,
                      const std::vector<AttentionResults>& results, std::string* out) {
  constexpr int64_t kElement = 4;  // this example's K/V caches are fp32
  const int64_t kv_row = 2 * c.kv_width() * kElement;
  absl::StrAppendFormat(out,
                        "  step5 attention: %d sliding layers (window %d) + %d global sparse "
                        "layers (top-%d blocks of %d + the current block)\n",
                        c.num_sliding_layers(), c.sliding_window, c.num_global_layers(),
                        c.topk_blocks, c.block_size);
  absl::StrAppendFormat(
      out,
      "KV bytes per token (fp32 cache): original K/V %d B (global layers; sliding rings %d B per "
      "sequence, bounded), proxy keys 0 B (pending block < %d tokens x %d B per global layer, "
      "per sequence), summaries %.0f B (FP8, %d B per block per global layer)\n",
      c.num_global_layers() * kv_row, c.num_sliding_layers() * c.sliding_window * kv_row,
      c.block_size, 2 * c.index_dim * 4,
      static_cast<double>(c.num_global_layers() * c.index_dim) / c.block_size, c.index_dim);
  const int64_t final_length = int64_t{shape.prompt_len} + shape.decode_steps;
  const step5::KvFootprint end = step5::KvBytes(c, final_length, kElement);
  absl::StrAppendFormat(out,
                        "KV bytes per sequence at %d tokens: original %d, proxy %d, summaries %d "
                        "(total %d)\n",
                        final_length, end.original, end.proxy, end.summaries, end.total());
  int64_t blocks[4] = {0, 0, 0, 0};
  for (const AttentionResults& r : results) {
    for (size_t i = 0; i < 4 && i < r.selection_blocks.size(); ++i) {
      blocks[i] += r.selection_blocks[i];
    }
  }
  auto fraction = [](int64_t attended, int64_t history) {
    return history == 0 ? std::string("no history yet")
                        : absl::StrFormat("%d/%d = %.3f", attended, history,
                                          static_cast<double>(attended) / history);
  };
  absl::StrAppendFormat(out,
                        "history blocks attended by the global layers, per (token, KV group): "
                        "decode %s; prefill %s\n",
                        fraction(blocks[3], blocks[2]), fraction(blocks[1], blocks[0]));
}

}  // namespace

std::string FormatReport(const RunShape& shape, const ExampleModel& model,
                         const std::vector<AttentionResults>& results) {
  const ModelConfig& config = model.config;
  std::string out;
  const int layers = config.num_layers;
  const int mbs = shape.micro_batches;
  // An elastic run (--resize): every instance has its own span of steps
  // (r.steps), its traces one slot per server of the capacity (r.servers).
  const int servers = results.empty() ? shape.ffn : results.front().servers;
  const int64_t total_requests = int64_t{shape.attention} * shape.requests;
  int64_t elastic_tokens = 0, elastic_requests = 0, elastic_decode_tokens = 0;
  uint64_t elastic_decode_begin = ~uint64_t{0}, elastic_decode_end = 0;
  for (const AttentionResults& r : results) {
    elastic_requests += r.requests;
    elastic_tokens += int64_t{r.requests} * r.steps;
    elastic_decode_tokens += int64_t{r.requests} * (r.steps - 1);
    elastic_decode_begin = std::min(elastic_decode_begin, StepEnd(r, 0));
    elastic_decode_end = std::max(elastic_decode_end, StepEnd(r, r.steps - 1));
  }
  absl::StrAppendFormat(
      &out,
      "AFD run: %s (%d layers, hidden %d, %d experts top-%d), %dA%dF over %s, backend %s\n"
      "  %d requests per attention instance in %d micro-batches, prompt %d tokens, %d decode "
      "steps\n",
      config.name, layers, config.hidden_size, config.num_experts, config.top_k, shape.attention,
      shape.ffn, shape.transport, shape.backend, shape.requests, mbs, shape.prompt_len,
      shape.decode_steps);
  if (model.step5) AppendStep5Lines(shape, *model.step5, results, &out);

  // Throughput: every instance runs the same schedule; the slowest sets the pace.
  double prefill_s = 0.0;
  double decode_s = 0.0;
  for (const AttentionResults& r : results) {
    prefill_s = std::max(prefill_s, Ms(StepEnd(r, 0) - r.start_ns) * 1e-3);
    if (shape.decode_steps > 0) {
      decode_s = std::max(decode_s, Ms(StepEnd(r, shape.decode_steps) - StepEnd(r, 0)) * 1e-3);
    }
  }
  if (!shape.resize.empty()) {
    // Instances join and leave: tokens over the union of their decodes.
    const double window = Ms(elastic_decode_end - elastic_decode_begin) * 1e-3;
    absl::StrAppendFormat(&out,
                          "tokens generated: %d (%d requests over the run's shapes, each from its "
                          "instance's first step to its last)\n",
                          elastic_tokens, elastic_requests);
    absl::StrAppendFormat(&out, "decode: %d tokens in %.1f ms, %.0f tokens/s\n",
                          elastic_decode_tokens, window * 1e3,
                          window > 0 ? elastic_decode_tokens / window : 0.0);
    return out;
  }
  absl::StrAppendFormat(&out, "tokens generated: %d (%d requests x %d)\n",
                        total_requests * shape.steps(), total_requests, shape.steps());
  absl::StrAppendFormat(&out, "prefill: %.1f ms, %.0f prompt tokens/s\n", prefill_s * 1e3,
                        total_requests * shape.prompt_len / prefill_s);
  if (shape.decode_steps > 0) {
    absl::StrAppendFormat(&out, "decode: TPOT %.3f ms, %.0f tokens/s (%d steps, batch %d)\n",
                          decode_s * 1e3 / shape.decode_steps,
                          total_requests * shape.decode_steps / decode_s, shape.decode_steps,
                          total_requests);
  }

  // Per layer and micro-batch, decode steps only (the steady state; prefill
  // stages are 32x bigger and would dominate the means).
  const int first_step = shape.decode_steps > 0 ? 1 : 0;
  absl::StrAppendFormat(&out,
                        "per layer and micro-batch, %s, mean ms over steps, attention instances "
                        "and FFN servers:\n",
                        first_step == 1 ? "decode" : "prefill");
  absl::StrAppendFormat(&out, "  %5s %3s %10s %9s %9s %9s\n", "layer", "mb", "attention", "A2F",
                        "FFN", "F2A");
  Mean total_attn, total_a2f, total_ffn, total_f2a;
  for (int l = 0; l < layers; ++l) {
    for (int m = 0; m < mbs; ++m) {
      Mean attn, a2f, ffn, f2a;
      for (const AttentionResults& r : results) {
        for (int s = first_step; s < shape.steps(); ++s) {
          const size_t stage = r.StageIndex(s, l, m);
          attn.Add(Span(r.attention[stage].begin_ns, r.attention[stage].end_ns));
          for (int p = 0; p < servers; ++p) {
            const stepmesh::TraceStamps& t = r.traces[stage * servers + p];
            a2f.Add(Span(t.post_ns, t.server_arrival_ns));
            ffn.Add(Span(t.server_handler_ns, t.server_reply_ns));
            f2a.Add(Span(t.server_reply_ns, t.reply_arrival_ns));
          }
        }
      }
      absl::StrAppendFormat(&out, "  %5d %3d %10.3f %9.3f %9.3f %9.3f\n", l, m, attn.ms(), a2f.ms(),
                            ffn.ms(), f2a.ms());
      total_attn.sum += attn.sum, total_attn.n += attn.n;
      total_a2f.sum += a2f.sum, total_a2f.n += a2f.n;
      total_ffn.sum += ffn.sum, total_ffn.n += ffn.n;
      total_f2a.sum += f2a.sum, total_f2a.n += f2a.n;
    }
  }
  absl::StrAppendFormat(&out, "  %9s %10.3f %9.3f %9.3f %9.3f\n", "all", total_attn.ms(),
                        total_a2f.ms(), total_ffn.ms(), total_f2a.ms());

  // Peers: mean FFN time and round trip per server, and how often each was
  // the last reply a request waited for.
  std::vector<Mean> peer_ffn(servers), peer_rtt(servers);
  std::vector<int64_t> last_count(servers, 0);
  int64_t requests_seen = 0;
  for (const AttentionResults& r : results) {
    for (int s = first_step; s < shape.steps(); ++s) {
      for (int l = 0; l < layers; ++l) {
        for (int m = 0; m < mbs; ++m) {
          const size_t stage = r.StageIndex(s, l, m);
          int last = -1;
          uint64_t last_ns = 0;
          for (int p = 0; p < servers; ++p) {
            const stepmesh::TraceStamps& t = r.traces[stage * servers + p];
            peer_ffn[p].Add(Span(t.server_handler_ns, t.server_reply_ns));
            peer_rtt[p].Add(Span(t.post_ns, t.reply_arrival_ns));
            if (t.reply_arrival_ns >= last_ns) last_ns = t.reply_arrival_ns, last = p;
          }
          if (last >= 0) ++last_count[last], ++requests_seen;
        }
      }
    }
  }
  int slowest = 0;
  for (int p = 0; p < servers; ++p) {
    absl::StrAppendFormat(&out,
                          "  ffn %d: FFN %.3f ms, round trip %.3f ms, last reply in %.0f%% of "
                          "requests\n",
                          p, peer_ffn[p].ms(), peer_rtt[p].ms(),
                          requests_seen == 0 ? 0.0 : 100.0 * last_count[p] / requests_seen);
    if (peer_rtt[p].ms() > peer_rtt[slowest].ms()) slowest = p;
  }
  absl::StrAppendFormat(&out, "slowest peer: ffn %d (round trip %.3f ms)\n", slowest,
                        peer_rtt[slowest].ms());

  // Hiding: the share of each transfer (A2F, F2A) and of the whole remote
  // round trip during which this attention instance was computing another
  // micro-batch's attention. Same host, so worker and server stamps share
  // CLOCK_MONOTONIC.
  uint64_t comm = 0, comm_hidden = 0, remote = 0, remote_hidden = 0;
  for (const AttentionResults& r : results) {
    std::vector<Interval> busy;
    for (int s = first_step; s < shape.steps(); ++s) {
      for (int l = 0; l < layers; ++l) {
        for (int m = 0; m < mbs; ++m) {
          const StageTiming& t = r.attention[r.StageIndex(s, l, m)];
          if (Span(t.begin_ns, t.end_ns) >= 0) busy.push_back({t.begin_ns, t.end_ns});
        }
      }
    }
    busy = Union(std::move(busy));
    for (int s = first_step; s < shape.steps(); ++s) {
      for (int l = 0; l < layers; ++l) {
        for (int m = 0; m < mbs; ++m) {
          const size_t stage = r.StageIndex(s, l, m);
          for (int p = 0; p < servers; ++p) {
            const stepmesh::TraceStamps& t = r.traces[stage * servers + p];
            for (auto [a, b] : {Interval{t.post_ns, t.server_arrival_ns},
                                Interval{t.server_reply_ns, t.reply_arrival_ns}}) {
              if (Span(a, b) < 0) continue;
              comm += b - a;
              comm_hidden += Covered(busy, a, b);
            }
            if (Span(t.post_ns, t.reply_arrival_ns) >= 0) {
              remote += t.reply_arrival_ns - t.post_ns;
              remote_hidden += Covered(busy, t.post_ns, t.reply_arrival_ns);
            }
          }
        }
      }
    }
  }
  absl::StrAppendFormat(&out,
                        "communication hidden by the pipeline: %.1f%% of A2F+F2A (%.1f of %.1f "
                        "ms); %.1f%% of the whole FFN round trip (%.1f of %.1f ms)\n",
                        comm == 0 ? 0.0 : 100.0 * comm_hidden / comm, Ms(comm_hidden), Ms(comm),
                        remote == 0 ? 0.0 : 100.0 * remote_hidden / remote, Ms(remote_hidden),
                        Ms(remote));
  return out;
}

std::string ApplicationTraceJson(const RunShape& shape,
                                 const std::vector<AttentionResults>& results,
                                 const std::vector<int64_t>& worker_offset_ns,
                                 const std::vector<int64_t>& server_offset_ns) {
  // Threads from 10000 on: below are the library's (stepmesh/trace.h).
  constexpr int kFirstTid = 10001;
  std::string json = "{\"traceEvents\":[\n";
  bool first = true;
  auto event = [&](absl::string_view name, int pid, int tid, int64_t offset_ns, uint64_t a,
                   uint64_t b, absl::string_view args) {
    if (a == 0 || Span(a, b) < 0) return;
    absl::StrAppendFormat(&json,
                          "%s{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,"
                          "\"dur\":%.3f,\"args\":%s}",
                          first ? "" : ",\n", name, pid, tid,
                          (static_cast<int64_t>(a) + offset_ns) * 1e-3, (b - a) * 1e-3, args);
    first = false;
  };
  auto thread = [&](int pid, int tid, absl::string_view name) {
    absl::StrAppendFormat(&json,
                          "%s{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,"
                          "\"args\":{\"name\":\"%s\"}}",
                          first ? "" : ",\n", pid, tid, name);
    first = false;
  };
  for (int m = 0; m < shape.micro_batches; ++m) {
    for (int a = 0; a < shape.attention; ++a) {
      thread(stepmesh::ChromeTraceProcessId(stepmesh::Role::kWorker, a), kFirstTid + m,
             absl::StrCat("attention mb", m));
    }
    for (int p = 0; p < shape.ffn; ++p) {
      thread(stepmesh::ChromeTraceProcessId(stepmesh::Role::kServer, p), kFirstTid + m,
             absl::StrCat("FFN mb", m));
    }
  }
  for (const AttentionResults& r : results) {
    const int pid = stepmesh::ChromeTraceProcessId(stepmesh::Role::kWorker, r.instance);
    for (int s = 0; s < r.steps; ++s) {
      for (int l = 0; l < r.layers; ++l) {
        for (int m = 0; m < r.micro_batches; ++m) {
          const size_t stage = r.StageIndex(s, l, m);
          const std::string tag = absl::StrCat("s", s, " L", l, " mb", m);
          // args: what latency models are calibrated against (docs/planning.md).
          event(absl::StrCat("attention ", tag), pid, kFirstTid + m, worker_offset_ns[r.instance],
                r.attention[stage].begin_ns, r.attention[stage].end_ns,
                absl::StrFormat("{\"step\":%d,\"layer\":%d,\"mb\":%d,\"rows\":%d,"
                                "\"kv_tokens\":%d}",
                                s, l, m, r.attention[stage].rows, r.attention[stage].kv_tokens));
          // A batch spans every attention instance; drawn once, from instance 0's stamps.
          if (r.instance != 0) continue;
          int64_t rows = 0;  // the batch holds this stage of every attention instance
          for (const AttentionResults& other : results) rows += other.attention[stage].rows;
          for (int p = 0; p < r.servers; ++p) {
            const stepmesh::TraceStamps& t = r.traces[stage * r.servers + p];
            event(absl::StrCat("FFN ", tag),
                  stepmesh::ChromeTraceProcessId(stepmesh::Role::kServer, p), kFirstTid + m,
                  server_offset_ns[p], t.server_handler_ns, t.server_reply_ns,
                  absl::StrFormat("{\"rows\":%d}", rows));
          }
        }
      }
    }
  }
  json += "\n]}\n";
  return json;
}

namespace {

// Top-1 minus top-2 of a logits row.
float Margin(const float* row, int64_t v) {
  float first = -INFINITY, second = -INFINITY;
  for (int64_t c = 0; c < v; ++c) {
    if (row[c] > first) {
      second = first;
      first = row[c];
    } else if (row[c] > second) {
      second = row[c];
    }
  }
  return first - second;
}

// "2" for a fixed shape; "2 (steps 0-5), 3 (steps 6-16)" for an expert
// layout schedule.
std::string PartitionText(const ResizeSchedule& schedule) {
  std::vector<std::string> parts;
  int begin = 0;
  for (int s = 1; s <= schedule.steps(); ++s) {
    if (s < schedule.steps() && schedule.At(s).ffn == schedule.At(begin).ffn) continue;
    parts.push_back(absl::StrCat(schedule.At(begin).ffn, " (steps ", begin, "-", s - 1, ")"));
    begin = s;
  }
  if (parts.size() == 1) return absl::StrCat(schedule.start().ffn);
  return absl::StrJoin(parts, ", ");
}

}  // namespace

ReferenceCheck CheckAgainstReference(const RunShape& shape, const ExampleModel& model,
                                     const std::vector<AttentionResults>& results,
                                     bool layers_expected,
                                     const std::function<void(int step)>& progress, GateMode mode) {
  const ModelConfig& config = model.config;
  const int64_t h = config.hidden_size;
  const int64_t v = config.vocab_size;
  const bool bitwise = mode == GateMode::kBitwise;
  for (const AttentionResults& r : results) {
    // ValidateResults has checked the sizes; this only guards the
    // comparisons below against a caller that skipped it.
    if (r.layer_hidden.empty() == layers_expected) {
      return {false, absl::StrCat("attention ", r.instance,
                                  layers_expected ? " did not dump its per-layer residuals"
                                                  : " dumped residuals nobody asked for")};
    }
  }

  const auto start = std::chrono::steady_clock::now();
  // An elastic run (--resize): instance a's requests exist in its span of
  // steps, and step s's FFN is F(s) partitions (the expert layout schedule).
  // Without --resize every instance spans the run and F is --ffn.
  const ResizeSchedule schedule = shape.Schedule();
  const int ranks = schedule.Capacity().attention;
  const int total = ranks * shape.requests;
  // The model's own attention side and the wire emulated in process: the
  // same units the disaggregated run used, in one process.
  KvCacheFormat kv_format = KvCacheFormat::kFp32;
  ParseKvCacheFormat(shape.kv_cache, &kv_format);  // validated with the run shape
  std::string error;
  const std::unique_ptr<AttentionModel> side =
      model.NewAttention(total, int64_t{shape.prompt_len} + shape.decode_steps, kv_format, &error);
  if (side == nullptr) return {false, absl::StrCat("no reference: ", error)};
  std::map<int, std::unique_ptr<AfdWireEmulation>> wires;  // by partition count
  for (int step = 0; step < shape.steps(); ++step) {
    const int f = schedule.At(step).ffn;
    if (!wires.contains(f)) wires[f] = std::make_unique<AfdWireEmulation>(config, f);
  }
  const std::vector<int32_t> prompts = GeneratePromptTokens(config, total, shape.prompt_len);
  std::vector<const AttentionResults*> by_rank(ranks, nullptr);
  for (const AttentionResults& r : results) {
    if (r.instance >= 0 && r.instance < ranks) by_rank[r.instance] = &r;
  }

  // Step by hand so the residual stream after every layer can be compared.
  const StepStatePtr state_ptr = side->NewStepState();
  StepState& state = *state_ptr;
  for (int g = 0; g < total; ++g) side->ResetSequence(g);
  std::vector<int32_t> next(total);  // the reference's greedy tokens
  std::vector<int32_t> fed(total);   // what each request is fed next
  int64_t token_mismatches = 0;
  int64_t near_ties = 0;      // bounded: differing tokens within the reference's margin
  int64_t logits_differ = 0;  // (request, step) pairs not bitwise equal / over the bound
  int64_t layers_differ = 0;  // (instance, step, layer) blocks likewise
  int64_t tokens = 0;         // (request, step) pairs compared
  int64_t blocks = 0;         // (instance, step, layer) blocks compared
  double worst_logits = 0.0;
  double worst_layer = 0.0;
  std::string first_mismatch;
  auto note = [&](std::string what) {
    if (first_mismatch.empty()) first_mismatch = absl::StrCat("; first difference: ", what);
  };
  std::vector<SequenceChunk> chunks;
  std::vector<int32_t> inputs;
  for (int step = 0; step < shape.steps(); ++step) {
    // The members of this step, in rank order; each one's requests are
    // contiguous rows of the step (request-major), as in the instance.
    struct Member {
      int rank;
      int local_step;     // its own step: 0 is its requests' prefill
      int64_t first_row;  // in the reference's rows of this step
    };
    std::vector<Member> members;
    chunks.clear();
    inputs.clear();
    int64_t rows = 0;
    for (int a = 0; a < ranks; ++a) {
      const MemberSpan span = schedule.AttentionSpan(a);
      if (!span.Contains(step)) continue;
      const int local = step - span.begin;
      members.push_back({a, local, rows});
      for (int i = 0; i < shape.requests; ++i) {
        const int g = a * shape.requests + i;
        if (local == 0) {
          chunks.push_back({g, shape.prompt_len});
          inputs.insert(inputs.end(), prompts.begin() + int64_t{g} * shape.prompt_len,
                        prompts.begin() + int64_t{g + 1} * shape.prompt_len);
        } else {
          chunks.push_back({g, 1});
          inputs.push_back(fed[g]);
        }
        rows += chunks.back().num_tokens;
      }
    }
    if (!side->BeginStep(chunks, inputs, &state)) {
      return {false, "the reference could not start a step (KV cache overflow)"};
    }
    AfdWireEmulation& wire = *wires[schedule.At(step).ffn];
    for (int l = 0; l < config.num_layers; ++l) {
      side->Attention(l, &state);
      wire.ComputeFfnOutput(l, *side, &state);
      side->AddFfnOutput(&state);
      if (!layers_expected) continue;
      for (const Member& m : members) {
        const AttentionResults* r = by_rank[m.rank];
        if (r == nullptr) continue;
        const RunShape local = shape.ForAttention(m.rank);
        const int64_t instance_rows = local.TokensPerRequest(m.local_step) * shape.requests;
        const int64_t row = LayerDumpRow(local, config, m.local_step, l, 0);
        std::span<const float> got(r->layer_hidden.data() + row * h, instance_rows * h);
        std::span<const float> want(state.hidden.data() + m.first_row * h, instance_rows * h);
        const double rel = RelativeL2(got, want);
        worst_layer = std::max(worst_layer, rel);
        ++blocks;
        const bool differs = bitwise ? std::memcmp(got.data(), want.data(), got.size_bytes()) != 0
                                     : !(rel <= kGateCBound);
        if (differs && layers_differ++ == 0) {
          note(absl::StrCat("residual after layer ", l, ", step ", step, ", attention ", m.rank));
        }
      }
    }
    std::vector<float> logits;
    side->LastTokenLogits(state, nullptr, &logits);
    std::vector<int32_t> step_tokens(chunks.size());
    cpu::ArgmaxRows(logits.data(), static_cast<int64_t>(chunks.size()), v, step_tokens.data());
    for (size_t c = 0; c < chunks.size(); ++c) next[chunks[c].sequence] = step_tokens[c];
    size_t c = 0;  // the chunk of (member, request)
    for (const Member& m : members) {
      const AttentionResults* r = by_rank[m.rank];
      for (int i = 0; i < shape.requests; ++i, ++c) {
        const int g = m.rank * shape.requests + i;
        fed[g] = next[g];
        if (r == nullptr) continue;
        ++tokens;
        const int32_t got = r->tokens[size_t(i) * r->steps + m.local_step];
        // Bounded: the reference is fed the run's tokens (teacher forcing),
        // so a legitimate near-tie flip does not make every later step
        // incomparable. Bitwise: it decodes its own greedy tokens, so a
        // divergence shows up as mismatches instead of being masked.
        if (!bitwise) fed[g] = got;
        if (got != next[g]) {
          // Bounded: a near tie in the reference may go either way.
          if (!bitwise && Margin(logits.data() + c * v, v) <= kTokenMargin) {
            ++near_ties;
          } else if (token_mismatches++ == 0) {
            note(absl::StrCat("token of request ", g, " step ", step, ": ", got, " vs ", next[g]));
          }
        }
        std::span<const float> got_logits(
            r->logits.data() + (size_t(m.local_step) * r->requests + i) * v, v);
        std::span<const float> want_logits(logits.data() + c * v, v);
        const double rel = RelativeL2(got_logits, want_logits);
        worst_logits = std::max(worst_logits, rel);
        const bool differs = bitwise ? std::memcmp(got_logits.data(), want_logits.data(),
                                                   got_logits.size_bytes()) != 0
                                     : !(rel <= kGateCBound);
        if (differs && logits_differ++ == 0) {
          note(absl::StrCat("logits of request ", g, " step ", step));
        }
      }
    }
    if (progress) progress(step);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // What was compared: every instance in `results` (afd_launch
  // --lost-attention checks the survivors only), over its span of steps.
  ReferenceCheck check;
  check.pass = token_mismatches == 0 && logits_differ == 0 && layers_differ == 0;
  auto verdict = [&](int64_t differ, int64_t of, double rel) {
    if (bitwise) {
      return differ == 0 ? absl::StrFormat("bitwise equal (memcmp; max rel-L2 %.3g)", rel)
                         : absl::StrFormat("%d of %d differ (max rel-L2 %.3g)", differ, of, rel);
    }
    return absl::StrFormat("max rel-L2 %.3g (<= %g%s)", rel, kGateCBound,
                           differ == 0 ? "" : absl::StrFormat("; %d of %d over", differ, of));
  };
  const std::string token_text =
      bitwise
          ? absl::StrFormat("%d/%d tokens identical", tokens - token_mismatches, tokens)
          : absl::StrFormat(
                "%d/%d tokens identical where the reference's top-1 margin > %g (%d near "
                "ties differ; reference fed the run's tokens)",
                tokens - token_mismatches - near_ties, tokens - near_ties, kTokenMargin, near_ties);
  check.summary = absl::StrFormat(
      "%s%s, logits %s, per-layer residuals %s; reference afd codec, %s partitions, %s KV "
      "cache, %.2f s%s",
      bitwise ? "" : "gate C bounds (bf16 GEMMs): ", token_text,
      verdict(logits_differ, tokens, worst_logits),
      layers_expected ? verdict(layers_differ, blocks, worst_layer)
                      : std::string("not checked (--no-layer-check)"),
      PartitionText(schedule), shape.kv_cache, seconds, first_mismatch);
  return check;
}

}  // namespace afd::example
