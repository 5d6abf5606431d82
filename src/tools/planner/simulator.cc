#include "src/tools/planner/simulator.h"

#include <algorithm>
#include <memory>
#include <queue>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "src/tools/planner/workload.h"

namespace stepmesh::planner {
namespace {

// A resource that serves one job at a time in the order jobs become ready.
// Jobs are reserved at the event that makes them ready, and events run in
// time order, so reserving is FIFO.
struct Timeline {
  double free_at = 0;
  double busy = 0;  // summed service time, measured part only
  double Reserve(double ready, double duration, bool measured) {
    const double start = std::max(ready, free_at);
    free_at = start + duration;
    if (measured) busy += duration;
    return free_at;
  }
};

enum class Kind : uint8_t { kAttnDone, kA2FDone, kArrive, kFfnDone, kPartial, kReply };

struct Event {
  double t;
  uint64_t seq;  // ties in time run in scheduling order: deterministic
  Kind kind;
  int a, j, f;
  bool operator>(const Event& o) const { return t != o.t ? t > o.t : seq > o.seq; }
};

struct MicroBatch {
  std::unique_ptr<SlotBatch> slots;
  int layer = 0;
  int step = 0;  // decode steps completed
  double t_a = 0;
};

class Simulation {
 public:
  Simulation(const Plan& plan, const SimOptions& o)
      : c_(plan.coefficients), w_(plan.workload), wire_(plan.wire), o_(o) {
    w_.ffn_instances = o.ffn;
    x_ = o.attention;
    y_ = o.ffn;
    m_ = w_.micro_batches > 0 ? w_.micro_batches : 1;
    layers_ = w_.layers;
    mbs_.resize(size_t(x_) * m_);
    for (int a = 0; a < x_; ++a) {
      for (int j = 0; j < m_; ++j) {
        // One stream per (instance, micro-batch): adding instances does not
        // reshuffle the others' draws (common random numbers across ratios).
        Mb(a, j).slots = std::make_unique<SlotBatch>(w_, w_.batch, Rng::Derive(o.seed, a, j),
                                                     o.stationary_start);
      }
    }
    attn_.resize(x_);
    tx_.resize(x_);
    rx_.resize(x_);
    ffn_.resize(y_);
    ffn_rx_.resize(y_);
    ffn_tx_.resize(y_);
    arrived_.assign(size_t(m_) * y_, 0);
    partials_.assign(size_t(x_) * m_, 0);
    partial_ready_.assign(size_t(x_) * m_, 0.0);
    barrier_t_a_.assign(m_, 0.0);
    t_c_ = CommTime(c_, w_);
    t_f_ = c_.ffn.At(double(x_) * w_.batch) / y_;
    if (wire_.ffn_link_gbps > 0) {
      const double us_per_byte = 8.0 / (wire_.ffn_link_gbps * 1e3);
      link_in_ = w_.batch * wire_.a2f_bytes_per_row * us_per_byte;
      link_out_ = w_.batch * wire_.f2a_bytes_per_row * us_per_byte;
    }
    step_start_.assign(size_t(x_) * m_, 0.0);
  }

  absl::StatusOr<SimResult> Run() {
    for (int a = 0; a < x_; ++a) {
      for (int j = 0; j < m_; ++j) Stage(a, j, 0.0);
    }
    const int last_step = o_.warmup_steps + o_.measure_steps;
    // Every event is finite work; the bound is a safety net against a bug.
    const int64_t max_events =
        int64_t{last_step + 2} * layers_ * m_ * (x_ * (4 + 2 * y_) + 2 * y_) * 4 + 1000;
    int64_t events = 0;
    while (!queue_.empty() && !done_) {
      if (++events > max_events) return absl::InternalError("simulator: event budget exceeded");
      const Event e = queue_.top();
      queue_.pop();
      Handle(e);
    }
    if (!done_) return absl::InternalError("simulator: ran out of events before the window ended");
    return Result();
  }

 private:
  MicroBatch& Mb(int a, int j) { return mbs_[size_t(a) * m_ + j]; }
  bool Measured(const MicroBatch& mb) const {
    return mb.step >= o_.warmup_steps && mb.step < o_.warmup_steps + o_.measure_steps;
  }
  void Push(double t, Kind k, int a, int j, int f) { queue_.push({t, seq_++, k, a, j, f}); }

  void Stage(int a, int j, double now) {
    MicroBatch& mb = Mb(a, j);
    if (mb.layer == 0) {
      mb.t_a = c_.attention.At(mb.slots->KvTokens());
      if (Measured(mb)) {
        kv_sum_ += mb.slots->KvTokens();
        ++kv_n_;
      }
    }
    const bool measured = Measured(mb);
    if (measured) {
      t_a_sum_ += mb.t_a;
      ++t_a_n_;
    }
    barrier_t_a_[j] = std::max(barrier_t_a_[j], mb.t_a);
    Push(attn_[a].Reserve(now, mb.t_a, measured), Kind::kAttnDone, a, j, 0);
  }

  void Handle(const Event& e) {
    MicroBatch& mb = Mb(e.a, e.j);
    switch (e.kind) {
      case Kind::kAttnDone:
        Push(tx_[e.a].Reserve(e.t, c_.a2f_fraction * t_c_, false), Kind::kA2FDone, e.a, e.j, 0);
        break;
      case Kind::kA2FDone:
        for (int f = 0; f < y_; ++f) {
          if (link_in_ > 0)
            Push(ffn_rx_[f].Reserve(e.t, link_in_, false), Kind::kArrive, e.a, e.j, f);
          else
            Arrive(e.j, f, e.t);
        }
        break;
      case Kind::kArrive:
        Arrive(e.j, e.f, e.t);
        break;
      case Kind::kFfnDone:
        for (int a = 0; a < x_; ++a) {
          if (link_out_ > 0)
            Push(ffn_tx_[e.f].Reserve(e.t, link_out_, false), Kind::kPartial, a, e.j, e.f);
          else
            Partial(a, e.j, e.t);
        }
        break;
      case Kind::kPartial:
        Partial(e.a, e.j, e.t);
        break;
      case Kind::kReply:
        Reply(e.a, e.j, e.t, mb);
        break;
    }
  }

  // The barrier: FFN f starts micro-batch j's batch when all x rows are in.
  void Arrive(int j, int f, double now) {
    int& n = arrived_[size_t(j) * y_ + f];
    if (++n < x_) return;
    n = 0;
    const bool measured = Measured(Mb(0, j));
    if (f == 0) {
      if (measured) {
        barrier_sum_ += barrier_t_a_[j];
        ++barrier_n_;
      }
      barrier_t_a_[j] = 0;
    }
    Push(ffn_[f].Reserve(now, t_f_, measured), Kind::kFfnDone, 0, j, f);
  }

  // F2A into attention instance a once every FFN instance's partial is there.
  void Partial(int a, int j, double now) {
    const size_t k = size_t(a) * m_ + j;
    partial_ready_[k] = std::max(partial_ready_[k], now);
    if (++partials_[k] < y_) return;
    partials_[k] = 0;
    Push(rx_[a].Reserve(partial_ready_[k], t_c_, false), Kind::kReply, a, j, 0);
    partial_ready_[k] = 0;
  }

  void Reply(int a, int j, double now, MicroBatch& mb) {
    if (++mb.layer == layers_) {
      mb.layer = 0;
      const bool measured = Measured(mb);
      ended_.clear();
      mb.slots->FinishStep(now, &ended_);
      ++mb.step;
      if (mb.step == o_.warmup_steps) t0_ = std::max(t0_, now);
      if (measured) {
        step_ends_.push_back(now);
        for (const SlotBatch::Completion& c : ended_) {
          completions_.push_back({now, c.started_at, c.tokens});
        }
      }
      if (mb.step == o_.warmup_steps + o_.measure_steps) {
        // The first micro-batch to finish its measured steps closes the
        // window; everything before it has been simulated.
        t1_ = now;
        done_ = true;
        return;
      }
    }
    Stage(a, j, now);
  }

  absl::StatusOr<SimResult> Result() {
    if (o_.warmup_steps == 0) t0_ = 0;
    if (!(t1_ > t0_)) return absl::InternalError("simulator: empty measurement window");
    SimResult r;
    r.window_us = t1_ - t0_;
    int64_t steps = 0;
    for (double t : step_ends_) {
      if (t > t0_ && t <= t1_) ++steps;
    }
    r.tokens = steps * w_.batch;
    r.tokens_per_s = r.tokens / r.window_us * 1e6;
    r.tokens_per_s_per_instance = r.tokens_per_s / (x_ + y_);
    r.mean_cycle_us = r.window_us * x_ * m_ / (double(steps) * layers_ * m_);
    r.mean_kv_tokens = kv_n_ ? kv_sum_ / kv_n_ : 0;
    r.mean_t_a_us = t_a_n_ ? t_a_sum_ / t_a_n_ : 0;
    r.mean_barrier_t_a_us = barrier_n_ ? barrier_sum_ / barrier_n_ : 0;
    double attn_busy = 0, ffn_busy = 0;
    for (const Timeline& t : attn_) attn_busy += t.busy;
    for (const Timeline& t : ffn_) ffn_busy += t.busy;
    // Busy time was summed over the measured steps of each micro-batch,
    // which span about the window.
    r.attention_busy = attn_busy / (x_ * r.window_us);
    r.ffn_busy = ffn_busy / (y_ * r.window_us);
    r.slots = double(x_) * m_ * w_.batch;
    double residence = 0;
    int64_t tokens = 0;
    for (const auto& c : completions_) {
      if (c.at <= t0_ || c.at > t1_ || c.started_at < 0) continue;
      residence += c.at - c.started_at;
      tokens += c.tokens;
      ++r.completed;
    }
    if (r.completed > 0) {
      r.completion_rate_per_us = r.completed / r.window_us;
      r.mean_residence_us = residence / r.completed;
      r.mean_tokens_per_request = double(tokens) / r.completed;
    }
    return r;
  }

  const Coefficients c_;
  Workload w_;
  const WireModel wire_;
  const SimOptions o_;
  int x_ = 1, y_ = 1, m_ = 1, layers_ = 1;
  double t_c_ = 0, t_f_ = 0, link_in_ = 0, link_out_ = 0;
  std::vector<MicroBatch> mbs_;
  std::vector<Timeline> attn_, tx_, rx_, ffn_, ffn_rx_, ffn_tx_;
  std::vector<int> arrived_, partials_;
  std::vector<double> partial_ready_, barrier_t_a_, step_start_;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> queue_;
  uint64_t seq_ = 0;
  bool done_ = false;
  double t0_ = 0, t1_ = 0;
  std::vector<double> step_ends_;
  struct Done {
    double at, started_at;
    int64_t tokens;
  };
  std::vector<Done> completions_;
  std::vector<SlotBatch::Completion> ended_;
  double kv_sum_ = 0, t_a_sum_ = 0, barrier_sum_ = 0;
  int64_t kv_n_ = 0, t_a_n_ = 0, barrier_n_ = 0;
};

}  // namespace

absl::StatusOr<SimResult> Simulate(const Plan& plan, const SimOptions& options) {
  if (options.attention < 1 || options.ffn < 1) {
    return absl::InvalidArgumentError(
        "simulator: need at least one attention and one FFN instance");
  }
  if (options.measure_steps < 2 || options.warmup_steps < 0) {
    return absl::InvalidArgumentError("simulator: need measure_steps >= 2 and warmup_steps >= 0");
  }
  if (!plan.has_coefficients)
    return absl::InvalidArgumentError("simulator: the plan has no coefficients");
  if (absl::Status s = ValidatePlan(plan); !s.ok()) return s;
  return Simulation(plan, options).Run();
}

}  // namespace stepmesh::planner
