// flatshard/fsdp/trace_format.h — the flatshard trace file format, written once: the recorder
// (fsdp/trace.cpp) writes these names and the summary (planner/trace_summary.cpp) reads them, so a
// rename here changes both and neither can drift from the other.
//
// A trace file is a Chrome Trace Event Format document (ui.perfetto.dev and chrome://tracing
// open it):
//   {"displayTimeUnit": "ns",
//    "otherData": {"flatshard_trace": <kVersion>, "rank", "world_size", "device",
//                  "forward_prefetch", "backward_prefetch",
//                  "units": [{"index", "name", "strategy", "reshard_after_forward",
//                             "padded_numel", "all_gather_bytes", "reduce_bytes", "kind"}, ...]},
//    "traceEvents": [metadata ("ph": "M": process and thread names and sort order),
//                    complete events ("ph": "X": "name", "cat", "ts", "dur" in microseconds,
//                    "pid" = rank, "tid" = Track, "args": {"step", "unit", "phase", "bytes",
//                    "host_ts", "host_end"})]}
// A merged document (flatshard-trace --merge) holds the events of several ranks and their
// otherData objects as a list under otherData.flatshard_ranks.
#pragma once

namespace flatshard::trace_format {

// otherData's marker of a flatshard trace; its value is the format version. Readers reject other
// versions: bump it when a field changes meaning or goes away (adding a field needs no bump).
inline constexpr char kMarker[] = "flatshard_trace";
inline constexpr int kVersion = 1;
// otherData key of a merged document: the list of its ranks' otherData objects.
inline constexpr char kMergedRanks[] = "flatshard_ranks";

// Thread tracks (tid) of one rank's process (pid = rank). CPU traces have the host track only.
enum Track : int {
  kHostTrack = 0,       // host calls of the state machine and runtime
  kComputeTrack = 1,    // the compute (current) stream
  kAllGatherTrack = 2,  // the all-gather stream
  kReduceTrack = 3,     // the reduce-scatter stream (reduce_scatter / all_reduce)
  // The thread that steps offloaded units (offload_step backward / delayed, fsdp/offload_step.h):
  // host spans, in GPU and CPU traces alike, present only when such steps ran.
  kOffloadStepTrack = 4,
};
inline constexpr int kTrackCount = 5;
inline constexpr const char* kTrackNames[kTrackCount] = {
    "host", "compute stream", "all-gather stream", "reduce-scatter stream", "CPU optimizer"};

// Event categories ("cat"): one per TraceKind (fsdp/trace.h; to_string(TraceKind) returns them),
// plus the step span.
namespace cat {
inline constexpr char kStep[] = "step";
inline constexpr char kPreForward[] = "pre_forward";
inline constexpr char kForward[] = "forward";
inline constexpr char kAllGather[] = "all_gather";
inline constexpr char kWaitAllGather[] = "wait_all_gather";
inline constexpr char kReshard[] = "reshard";
inline constexpr char kPreBackward[] = "pre_backward";
inline constexpr char kBackward[] = "backward";
inline constexpr char kReduce[] = "reduce";
inline constexpr char kWaitReduce[] = "wait_reduce";
inline constexpr char kOptimizer[] = "optimizer";
inline constexpr char kOffloadWait[] = "offload_wait";  // the stepper waiting for the gradient
inline constexpr char kOffloadStep[] = "offload_step";  // its CPU step of the unit (+ upload issue)
}  // namespace cat

// Event names ("name") where they differ from the category; a unit's events append " <unit>".
// Readers go by category and args; names are for people looking at the timeline.
namespace event {
inline constexpr char kForward[] = "fwd";
inline constexpr char kBackward[] = "bwd";
inline constexpr char kWaitAllGather[] = "wait all_gather";
inline constexpr char kWaitReduce[] = "wait reduce";
inline constexpr char kReduceScatter[] = "reduce_scatter";  // kReduce of a sharded unit
inline constexpr char kAllReduce[] = "all_reduce";          // kReduce of a NO_SHARD unit
inline constexpr char kStepPrefix[] = "step ";              // + the step number
}  // namespace event

// args.phase: the pass the event was recorded in.
namespace phase {
inline constexpr char kForward[] = "forward";
inline constexpr char kBackward[] = "backward";
}  // namespace phase

// Member names. The Chrome ones are that format's; the rest are flatshard's.
namespace key {
// Chrome Trace Event Format.
inline constexpr char kDisplayTimeUnit[] = "displayTimeUnit";
inline constexpr char kDisplayTimeUnitValue[] = "ns";
inline constexpr char kOtherData[] = "otherData";
inline constexpr char kTraceEvents[] = "traceEvents";
inline constexpr char kPh[] = "ph";
inline constexpr char kPhComplete[] = "X";  // the value of "ph" of a complete (timed) event
inline constexpr char kName[] = "name";     // also a unit's name in otherData.units
inline constexpr char kCat[] = "cat";
inline constexpr char kTs[] = "ts";
inline constexpr char kDur[] = "dur";
inline constexpr char kPid[] = "pid";
inline constexpr char kTid[] = "tid";
inline constexpr char kArgs[] = "args";
// otherData.
inline constexpr char kRank[] = "rank";
inline constexpr char kWorldSize[] = "world_size";
inline constexpr char kDevice[] = "device";
inline constexpr char kForwardPrefetch[] = "forward_prefetch";
inline constexpr char kBackwardPrefetch[] = "backward_prefetch";
inline constexpr char kUnits[] = "units";
// otherData.units[i].
inline constexpr char kIndex[] = "index";
inline constexpr char kStrategy[] = "strategy";
inline constexpr char kReshardAfterForward[] = "reshard_after_forward";
inline constexpr char kPaddedNumel[] = "padded_numel";
inline constexpr char kAllGatherBytes[] = "all_gather_bytes";
inline constexpr char kReduceBytes[] = "reduce_bytes";
inline constexpr char kKind[] = "kind";  // the unit's module type (TraceUnit::kind); optional
// traceEvents[i].args.
inline constexpr char kStep[] = "step";
inline constexpr char kUnit[] = "unit";
inline constexpr char kPhase[] = "phase";
inline constexpr char kBytes[] = "bytes";
inline constexpr char kHostTs[] = "host_ts";    // GPU events: host time of the record call
inline constexpr char kHostEnd[] = "host_end";  // GPU events: host time of the end's record call
}  // namespace key

}  // namespace flatshard::trace_format
