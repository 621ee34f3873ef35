// flatshard/planner/trace_summary.h — read flatshard traces (fsdp/trace.h) and say where a step's
// time goes: per unit exposed communication, GPU idle gaps with their cause, top offenders with
// one line of advice each. flatshard-trace (tools/trace_main.cpp) prints it; tests check it on
// planted delays. The file format (names, tracks, categories) is fsdp/trace_format.h's.
//
// What counts as exposed (the compute waiting on communication):
// - GPU traces: the compute stream's "wait all_gather" / "wait reduce" spans (the stream sat at
//   the unit's event wait). An idle gap caused by the host is the time between a compute-stream
//   event and the previous one when the GPU ran that event within `starved_us` of the host
//   recording it (the GPU had no queued work: it was waiting for the host).
// - CPU traces (host events only): collectives are synchronous, so the whole host all_gather /
//   reduce span is exposed, and there are no idle gaps (the host is the compute).
// Per-unit numbers are per step, averaged over the ranks and the steps used (the first step is
// skipped when there are more: it has no forward prefetch and pays one-time allocations).
//
// What a valid trace is (the file is untrusted input; each violation is a one-line c10::Error
// naming the file and the first bad event, "trace event <index in traceEvents> '<name>': ..."):
// - a file read through support/input_file.h: a regular file (a FIFO or device is refused, not
//   waited on) of at most kMaxTraceFileBytes, strict JSON at most json::kMaxDepth deep;
// - every complete ("X") event: pid an integer rank the metadata holds, tid a Track, ts a finite
//   time in [-1e15, 1e15] us (steady_clock since boot: ~31 years; hand-made traces start below
//   0), dur finite in [0, 1e12] us (~11.6 days), args.step an integer in [0, 2^30], args.bytes
//   in [0, 2^62], args.host_ts finite in [-1e15, 1e15]; args.unit (when given) a unit of that
//   rank's otherData.units, args.phase "" or "forward" or "backward";
// - one step event (cat "step") per (rank, step), and every event's step has one;
// - no event twice: one per (rank, track, category, unit, phase, step, begin time, host record
//   time). The recorder's events of one unit and kind in one step differ in their begin times
//   (a unit entered twice per pass has two pre_forward and two fwd spans): equal ones are one
//   event written twice, which would count double;
// - read_trace_files() and summarize(): every rank has at least one step event (a trace without
//   them would summarise to an all-zero table).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace flatshard {

// The largest trace file read (1 GiB): a rank's trace holds at most 2^20 records (fsdp/trace.h),
// about 300-600 MB of JSON; a merged file of more ranks than that fits is summarised from the
// per-rank files instead.
inline constexpr int64_t kMaxTraceFileBytes = int64_t{1} << 30;

struct TraceEvent {
  int rank = 0;
  int tid = 0;  // trace_format::Track: 0 host, 1 compute, 2 all-gather, 3 reduce-scatter stream
  std::string name, cat, unit, phase;
  int step = -1;
  double ts = 0, dur = 0;  // microseconds
  int64_t bytes = 0;
  double host_ts = -1;  // GPU events: host time the event was recorded
  size_t index = 0;     // its place in the document's traceEvents (error messages)
};

struct TraceUnitMeta {
  std::string name, strategy;
  bool reshard_after_forward = false;
  int64_t padded_numel = 0, all_gather_bytes = 0, reduce_bytes = 0;
  std::string kind;  // the unit's module type ("" in traces that do not record it)
};

struct RankTrace {
  int rank = 0, world_size = 1;
  std::string device;
  int forward_prefetch = 1, backward_prefetch = 1;
  std::vector<TraceUnitMeta> units;  // plan order (as far as the trace saw them)
  std::vector<TraceEvent> events;    // complete ("X") events only
};

// One rank per flatshard trace document; a merged document (flatshard-trace --merge) yields one
// per rank it holds. Throws c10::Error on JSON that is not a flatshard trace of
// trace_format::kVersion (the marker), whose rank is not an integer in [0, world_size), that
// (merged) holds a rank twice or ranks of different world sizes, or whose events are not valid
// (above; a trace without events is valid here).
std::vector<RankTrace> read_traces(const nlohmann::json& doc);
// One file's JSON, read through support/input_file.h (above); throws c10::Error naming the file
// if it cannot be read, is not a regular file, is larger than kMaxTraceFileBytes or is not
// strict JSON.
nlohmann::json read_trace_json(const std::string& path);
// read_traces of every file, and across them: the same file twice (by name or through another
// name of it), a rank in two files (naming both), or files of different world sizes are errors
// — each would be counted as more ranks than the run had — and so is a rank without step
// events. Errors start with the file's path.
std::vector<RankTrace> read_trace_files(const std::vector<std::string>& paths);
// Several per-rank documents as one Chrome trace (events concatenated, otherData of each rank
// kept under "flatshard_ranks").
nlohmann::json merge_traces(const std::vector<nlohmann::json>& docs);

struct UnitCost {
  std::string unit;
  double forward_us = 0, backward_us = 0;   // compute (self time, per step)
  double all_gather_forward_us = 0;         // exposed, per step
  double all_gather_backward_us = 0;
  double reduce_us = 0;                     // exposed, per step
  double host_gap_us = 0;                   // GPU idle waiting for the host before this unit
  double all_gathers = 0, reduces = 0;      // per step
  double all_gather_call_us = 0;            // mean duration of one all-gather
  int64_t gathered_bytes = 0;               // one all-gather's total payload (all ranks)
  double exposed() const {
    return all_gather_forward_us + all_gather_backward_us + reduce_us + host_gap_us;
  }
  std::string advice;  // one line, for offenders
  // Host time of flatshard's own hooks for this unit, per step (mean over ranks): the top-level
  // host spans pre_forward, all_gather, reshard, pre_backward and reduce it is named in (a span
  // nested in another — a prefetch inside a pre-forward — counts for the enclosing one's unit).
  // On CPU the collectives run inside all_gather / reduce: it is not issue time there.
  double host_us = 0;
  std::map<std::string, double> host_by_phase;  // by span category, per step
  // The CPU optimizer track (offload_step backward / delayed), per step: the stepper's wait
  // for this unit's gradient on the host, and its CPU step of the unit.
  double offload_wait_us = 0, offload_step_us = 0;
};

// Host time per unit per step, by unit kind (TraceUnitMeta::kind): what one unit of each kind
// costs the host, the median over the kind's units, and its mean split by hook.
struct KindHostCost {
  std::string kind;
  int units = 0;
  double median_us = 0, max_us = 0;
  std::map<std::string, double> by_phase_us;  // mean per unit
};

struct IdleGap {
  int rank = 0, step = 0;
  std::string unit, phase;
  std::string cause;  // "all-gather", "reduce", "host"
  double us = 0;
};

struct TraceSummary {
  bool gpu = false;  // GPU stream events present
  int ranks = 0;
  std::string device;
  std::vector<int> steps_used;
  int steps_total = 0;
  double step_us = 0;  // mean step duration (host "step" spans; on the GPU only its issue)
  double compute_us = 0, all_gather_us = 0, reduce_us = 0, host_gap_us = 0;  // per step
  // GPU only, per step: how long the host took to issue the step's unit work (first to last host
  // record call) and how long the GPU streams took to run it (first to last GPU event). Issue
  // well below GPU span: the host runs ahead and cannot starve the GPU.
  double host_issue_us = 0, gpu_span_us = 0;
  // Sums of UnitCost::offload_wait_us / offload_step_us (0: no CPU optimizer track).
  double offload_wait_us = 0, offload_step_us = 0;
  std::vector<UnitCost> units;     // plan order
  std::vector<size_t> offenders;   // indices into units, most exposed first (exposed > 0)
  std::vector<IdleGap> largest_gaps;  // GPU only, largest first
  std::vector<KindHostCost> host_by_kind;  // kinds in plan order of their first unit
  std::string to_string() const;
};

struct SummaryOptions {
  bool skip_first_step = true;
  double starved_us = 50;  // GPU ran an event this soon after the host recorded it: starved
  int top = 5;             // offenders and gaps listed
};

// Throws c10::Error for no ranks, or a rank without step events.
TraceSummary summarize(const std::vector<RankTrace>& ranks, const SummaryOptions& options = {});

}  // namespace flatshard
