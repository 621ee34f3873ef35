// flatshard/fsdp/trace.h — per-unit step traces: what every unit did, when, on which stream.
//
// Switched on by ShardingOptions::trace.path or the environment (below). Each rank records, per
// step and per unit, the events of the state machine (unit.cpp) and the runtime (runtime.cpp):
//   host track            pre_forward, fwd (the unit's forward), all_gather (issue; on CPU the
//                         whole collective), reshard, pre_backward, bwd, reduce_scatter /
//                         all_reduce, optimizer, step
//   compute stream        fwd, bwd, wait all_gather (the stream waiting for the unit's gathered
//                         parameters: exposed all-gather time), wait reduce (waiting for the
//                         previous reduction before its buffers are reused), optimizer
//   all-gather stream     all_gather (the collective itself)
//   reduce-scatter stream reduce_scatter / all_reduce
//   CPU optimizer         offload_wait, offload_step (the offload stepper's thread: Note
//                         [Offload step in backward], fsdp/offload_step.h)
// and writes them as Chrome trace JSON (ui.perfetto.dev and chrome://tracing open it): process =
// rank, one thread track per row above. tools/flatshard-trace summarises such files.
//
// Contract
// - Off: no Tracer exists and every hook is one predictable branch on a null pointer.
// - GPU streams are timed with CUDA events (timing enabled) recorded next to the host events.
//   Nothing synchronises in the middle of a step: when a new step starts, the events of earlier
//   steps that have completed (query()) are resolved to times with Event::elapsedTime against
//   each step's reference event (recorded on the compute stream at the step's first hook); the
//   rest wait for the next step, and write() waits for all of them (the only host sync).
// - GPU times are placed on the host timeline (steady_clock, microseconds, the same clock in
//   every process of a machine, so per-rank files line up) by the smallest offset that puts no
//   GPU event before the host call that recorded it. Durations and gaps within the GPU tracks
//   are exact; their alignment to host events is exact when the GPU had no backlog at some
//   event of the run (true at startup) and otherwise early by the smallest backlog. GPU events
//   carry the host time of their recording (args.host_ts), so readers can tell whether the GPU
//   was starved (it ran the event as soon as the host recorded it) or busy.
// - CPU: every collective completes before it returns and there are no streams: host events are
//   the whole truth (there are no GPU tracks and no wait events).
// - NVTX (CUDA builds, CUDA device): the same host spans as NVTX ranges named after the unit
//   ("fwd blocks.3", "all_gather blocks.4"), so Nsight Systems shows them.
// - A step ends at the end of a backward pass (finalize_backward); the next hook starts the next
//   one. The optimizer scope after it belongs to the step that just ended. Forward passes
//   without backward (evaluation) stay in the step that is open. Recording stops after
//   TraceOptions::max_steps steps, or 2^20 events, so memory stays bounded; hooks then cost a
//   call each.
// - One tracer per ShardedModel per rank; driven by one thread at a time, like the runtime,
//   except record_worker(), which the offload stepper's thread calls (its own records, locked,
//   in the step its work was queued in: a delayed step runs during the next step's forward).
// - The file is written by write() and when the tracer is destroyed (with the ShardedModel),
//   whole or not at all (support/output_file.h: a failed write leaves an earlier file at the
//   path as it was); the destructor never throws (a failed write is a warning).
//
// Environment (read when a ShardedModel is built, only if TraceOptions::path is empty):
//   FLATSHARD_TRACE        unset/empty: off. A path: trace to it ("{rank}" is replaced by the
//                          rank; without it world sizes > 1 get ".rank<R>" before ".json").
//                          A file path, never a directory: a path that is an existing
//                          directory or ends in '/' (or whose rank file is one) is refused
//                          when the ShardedModel is built (c10::Error naming it and the fix,
//                          "<dir>/trace.json"), instead of writing "<dir>.rank<R>" beside it.
//                          The same holds for TraceOptions::path.
//                          "nvtx": NVTX ranges only, no events recorded, no file.
//   FLATSHARD_TRACE_STEPS  steps to record (default TraceOptions::max_steps = 64).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/macros/Macros.h>

#include <cstdint>
#include <deque>
#include <iosfwd>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fsdp/options.h"

namespace flatshard {

class Communicator;

enum class TraceKind : uint8_t {
  kPreForward,      // host: Runtime::pre_forward (prefetch, unshard, wait); its end starts kForward
  kForward,         // host + compute stream: the unit's forward, after its parameters are ready
  kAllGather,       // host: issuing the all-gather (CPU: running it); all-gather stream
  kWaitAllGather,   // compute stream only: waiting for the unit's all-gather
  kReshard,         // host: freeing the unsharded buffer
  kPreBackward,     // host: Runtime::pre_backward; its end starts kBackward
  kBackward,        // host + compute stream: the unit's backward, until its post-backward hook
  kReduce,          // host: issuing the reduction (CPU: running it); reduce-scatter stream
  kWaitReduce,      // compute stream only: waiting for the previous reduction
  kOptimizer,       // host + compute stream: ShardedModel::trace_optimizer_step() scope
  // The offload stepper's thread (Tracer::record_worker): waiting for a unit's gradient on the
  // host, then its CPU step (and the upload it issues after, offload_step backward).
  kOffloadWait,
  kOffloadStep,
};
const char* to_string(TraceKind kind);

// What the tracer needs to know about a unit, as plain data: the unit fills it once when it is
// built (fsdp/unit.cpp) and passes it to every hook, so the tracer depends on no Unit.
struct TraceUnit {
  int index = -1;  // in the plan
  std::string name;
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  bool reshard_after_forward = false;
  int64_t padded_numel = 0;      // flat buffer elements (0: the unit issues no collective)
  int64_t all_gather_bytes = 0;  // one all-gather: bytes this rank sends
  int64_t reduce_bytes = 0;      // one reduction: bytes this rank sends
  // The unit's kind for per-kind summaries: its first member module's type as a policy writes
  // it ("<root>" for the root), e.g. "Block", "Linear" (policy_type_name(), policy.h).
  std::string kind;
};

// One recorded event (exposed for tests and tools; times in microseconds).
struct TraceRecord {
  TraceKind kind = TraceKind::kForward;
  int unit = -1;  // index in the plan; -1: none (optimizer)
  int step = 0;
  bool backward = false;  // recorded during a backward pass
  double host_begin = 0, host_end = -1;  // steady_clock; end < begin: still open
  // GPU side: pool indices while pending, then resolved times (< 0: none / not resolved).
  int gpu_begin_event = -1, gpu_end_event = -1;
  double gpu_begin = -1, gpu_end = -1;  // relative to step 0's reference event
  int64_t bytes = 0;
  uint64_t nvtx_range = 0;
};

class Tracer {
 public:
  // nullptr when tracing is off (options.path empty and FLATSHARD_TRACE unset or empty).
  static std::unique_ptr<Tracer> create(const ShardingOptions& options, Communicator& comm,
                                        c10::Stream all_gather_stream,
                                        c10::Stream reduce_scatter_stream);
  // `path` "": NVTX only. The options are written into the file for readers (prefetch depths).
  Tracer(std::string path, int max_steps, const ShardingOptions& options, Communicator& comm,
         c10::Stream all_gather_stream, c10::Stream reduce_scatter_stream);
  ~Tracer();
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  // Hooks (call them through TraceScope / trace_end / trace_step_end below).
  struct Open {
    TraceKind kind = TraceKind::kForward;
    int unit = -1;
    int record = -1;    // index in records(), -1: not recorded
    bool nvtx = false;  // an NVTX range was pushed
    bool active = false;
  };
  Open open(TraceKind kind, const TraceUnit* unit);  // unit nullptr: none (optimizer, waits)
  void close(const Open& open);
  void end(TraceKind kind, const TraceUnit& unit);  // closes the unit's open kForward / kBackward
  void step_end();
  // The step being recorded (-1: none: before the first hook, or past max_steps). Main thread.
  int recording_step() const;
  // Any thread: a host span [begin_us, end_us) (now_us()'s clock) of the offload stepper, for
  // unit index `unit` (kOffloadWait, kOffloadStep), in `step` (recording_step() when the work
  // was queued; -1: not recorded). Not recorded past the record bound.
  void record_worker(TraceKind kind, int unit, int step, double begin_us, double end_us);
  static double now_us();  // the host clock of every record (steady_clock, microseconds)

  // Resolves every pending GPU event (waits for them) and writes the JSON file; returns its
  // path ("" in NVTX-only mode). Throws c10::Error if the file cannot be written.
  std::string write();
  const std::string& path() const { return path_; }
  // Resolves what has completed without waiting (all of it on CPU) and returns the records.
  const std::vector<TraceRecord>& records();

 private:
  struct UnitInfo {
    std::string name;
    std::string strategy;
    bool reshard_after_forward = false;
    int64_t padded_numel = 0, all_gather_bytes = 0, reduce_bytes = 0;
    std::string kind;
  };
  struct OpenSpan {  // a kForward / kBackward span between two hooks
    TraceKind kind;
    int record;
    uint64_t nvtx_range;
  };
  struct Step {
    int ref_event = -1;
    double ref = -1;  // resolved: microseconds after step 0's reference
    double host_begin = 0, host_end = -1;
  };
  bool ensure_step(TraceKind kind);
  void note_unit(const TraceUnit& unit);
  void begin_span(TraceKind kind, int unit);
  int record_event(const c10::Stream& stream);
  void release_event(int id);
  void resolve(bool wait);
  c10::Stream stream_for(TraceKind kind) const;
  std::string event_name(TraceKind kind, int unit) const;
  void write_json(std::ostream& os) const;

  std::string path_;
  bool record_;  // false: NVTX only
  int max_steps_;
  int forward_prefetch_, backward_prefetch_;
  Communicator& comm_;
  c10::Stream all_gather_stream_;
  c10::Stream reduce_scatter_stream_;
  bool gpu_ = false;   // streams are CUDA: record events
  bool nvtx_ = false;  // emit NVTX ranges

  std::vector<UnitInfo> units_;  // by unit index, filled as units show up
  std::vector<TraceRecord> records_;
  std::vector<Step> steps_;
  std::vector<std::vector<OpenSpan>> open_;  // per unit
  static constexpr size_t kMaxRecords = size_t{1} << 20;  // ~100 MB: a bound, not a budget
  bool full_warned_ = false;
  bool step_open_ = false;
  bool backward_ = false;
  int last_reduce_unit_ = -1;  // whose reduction a kWaitReduce waits for
  size_t first_pending_ = 0;   // records before it have no pending GPU event
  std::deque<c10::Event> events_;  // pool; deque: addresses stay valid as it grows
  std::vector<int> free_events_;
  mutable std::mutex worker_mu_;             // worker_records_ (record_worker's thread)
  std::vector<TraceRecord> worker_records_;
};

// RAII host span (+ GPU span on the kind's stream). A null tracer makes it a no-op.
class TraceScope {
 public:
  TraceScope() = default;
  TraceScope(Tracer* tracer, TraceKind kind, const TraceUnit* unit) : tracer_(tracer) {
    if (C10_UNLIKELY(tracer_ != nullptr)) open_ = tracer_->open(kind, unit);
  }
  ~TraceScope() {
    if (C10_UNLIKELY(tracer_ != nullptr)) tracer_->close(open_);
  }
  TraceScope(TraceScope&& o) noexcept : tracer_(o.tracer_), open_(o.open_) { o.tracer_ = nullptr; }
  TraceScope& operator=(TraceScope&&) = delete;
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  Tracer* tracer_ = nullptr;
  Tracer::Open open_;
};

inline void trace_end(Tracer* tracer, TraceKind kind, const TraceUnit& unit) {
  if (C10_UNLIKELY(tracer != nullptr)) tracer->end(kind, unit);
}
inline void trace_step_end(Tracer* tracer) {
  if (C10_UNLIKELY(tracer != nullptr)) tracer->step_end();
}

// The file a rank writes for `path` (see FLATSHARD_TRACE above).
std::string trace_file_for_rank(const std::string& path, int rank, int world_size);

}  // namespace flatshard
