#pragma once
// The newest N per-request trace records of one participant, for the Chrome
// trace export (src/core/chrome_trace.h). Sized once at creation; recording
// takes no lock and allocates nothing, so any thread may record (the worker
// completes requests on its receive, send and peer-event threads, the server
// records on its send thread) while the application exports.
//
// Each record is a fixed number of 64-bit words. A record's slot is claimed
// with a ticket (one fetch_add) and guarded by a sequence word, seqlock style:
// odd while a writer fills it, 2 * ticket + 2 once complete. The reader keeps
// a slot only when the sequence says "complete, ticket t" before and after
// copying it, so a record overwritten or still being written while exported is
// left out (and counted as dropped), never torn. Words are relaxed atomics
// rather than plain memory so that the concurrent read is not a data race.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace stepmesh::core {

class TraceRing {
 public:
  // `capacity` records of `words` words each; capacity 0: recording is off.
  TraceRing(size_t capacity, size_t words)
      : capacity_(capacity),
        words_(words),
        seq_(capacity == 0 ? nullptr : new std::atomic<uint64_t>[capacity]),
        data_(capacity == 0 ? nullptr : new std::atomic<uint64_t>[capacity * words]) {
    for (size_t i = 0; i < capacity_; ++i) seq_[i].store(0, std::memory_order_relaxed);
    for (size_t i = 0; i < capacity_ * words_; ++i) data_[i].store(0, std::memory_order_relaxed);
  }

  bool on() const { return capacity_ != 0; }
  size_t capacity() const { return capacity_; }
  size_t words() const { return words_; }

  // Fills one record's words (indices below words()).
  class Writer {
   public:
    void Put(size_t i, uint64_t value) const { words_[i].store(value, std::memory_order_relaxed); }

   private:
    friend class TraceRing;
    explicit Writer(std::atomic<uint64_t>* words) : words_(words) {}
    std::atomic<uint64_t>* words_;
  };

  // Any thread: `fill(const Writer&)` writes the next record, replacing the
  // oldest once the ring is full. Callers test on() first (the off cost is
  // that branch). A slot another writer is still filling (a writer a whole
  // ring behind) is skipped and the record counted as dropped.
  template <typename Fill>
  void Record(Fill&& fill) {
    const uint64_t ticket = next_.fetch_add(1, std::memory_order_relaxed);
    std::atomic<uint64_t>& seq = seq_[ticket % capacity_];
    uint64_t seen = seq.load(std::memory_order_relaxed);
    // acq_rel: the word stores below stay after the odd sequence.
    if ((seen & 1) != 0 ||
        !seq.compare_exchange_strong(seen, 2 * ticket + 1, std::memory_order_acq_rel)) {
      return;  // the export counts it: its ticket never completes
    }
    fill(Writer(&data_[(ticket % capacity_) * words_]));
    seq.store(2 * ticket + 2, std::memory_order_release);
  }

  struct Snapshot {
    size_t words = 0;
    size_t capacity = 0;
    std::vector<uint64_t> data;  // the records kept, oldest first, `words` each
    uint64_t recorded = 0;       // records ever started
    uint64_t dropped = 0;        // recorded - kept: overwritten, or written during the copy
    size_t size() const { return words == 0 ? 0 : data.size() / words; }
    const uint64_t* record(size_t i) const { return &data[i * words]; }
  };

  // Any thread; allocates. The records of the last min(recorded, capacity) tickets
  // that were complete and stable while copied.
  Snapshot Copy() const {
    Snapshot s;
    s.words = words_;
    s.capacity = capacity_;
    if (capacity_ == 0) return s;
    const uint64_t end = next_.load(std::memory_order_acquire);
    const uint64_t begin = end > capacity_ ? end - capacity_ : 0;
    s.recorded = end;
    s.data.reserve((end - begin) * words_);
    std::vector<uint64_t> words(words_);
    for (uint64_t t = begin; t < end; ++t) {
      const std::atomic<uint64_t>& seq = seq_[t % capacity_];
      const uint64_t before = seq.load(std::memory_order_acquire);
      if (before != 2 * t + 2) continue;
      const std::atomic<uint64_t>* src = &data_[(t % capacity_) * words_];
      for (size_t i = 0; i < words_; ++i) words[i] = src[i].load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (seq.load(std::memory_order_relaxed) != before) continue;
      s.data.insert(s.data.end(), words.begin(), words.end());
    }
    s.dropped = end - s.size();
    return s;
  }

 private:
  const size_t capacity_;
  const size_t words_;
  std::unique_ptr<std::atomic<uint64_t>[]> seq_;
  std::unique_ptr<std::atomic<uint64_t>[]> data_;
  std::atomic<uint64_t> next_{0};
};

}  // namespace stepmesh::core
