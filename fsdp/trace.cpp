// flatshard/fsdp/trace.cpp — see trace.h. The JSON is streamed, not built as a document (a trace
// holds up to 2^20 records); nlohmann-json escapes its strings, and every name and key comes from
// fsdp/trace_format.h, which the reader (planner/trace_summary.cpp) uses too.
#include "fsdp/trace.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <ostream>
#include <sstream>
#include <string>

#include <sys/stat.h>

#include <nlohmann/json.hpp>

#include "collectives/communicator.h"
#include "collectives/env.h"
#include "fsdp/trace_format.h"
#include "support/output_file.h"
#if FLATSHARD_WITH_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace flatshard {

namespace {

namespace tf = trace_format;
using tf::kAllGatherTrack;
using tf::kComputeTrack;
using tf::kHostTrack;
using tf::kReduceTrack;
using tf::kTrackNames;
using tf::Track;

double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Waits are stream operations: they exist on the GPU only.
bool has_host_part(TraceKind k) {
  return k != TraceKind::kWaitAllGather && k != TraceKind::kWaitReduce;
}
bool has_gpu_part(TraceKind k) {
  return k != TraceKind::kPreForward && k != TraceKind::kReshard && k != TraceKind::kPreBackward;
}

Track track_for(TraceKind k) {
  switch (k) {
    case TraceKind::kAllGather:
      return kAllGatherTrack;
    case TraceKind::kReduce:
      return kReduceTrack;
    default:
      return kComputeTrack;
  }
}

// `s` as a JSON string. Bytes that are not UTF-8 (a module name may hold any) become U+FFFD
// instead of an exception: the file stays valid JSON, which is UTF-8.
void write_string(std::ostream& os, const std::string& s) {
  os << nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// A member name ("key":) or a constant string value ("value") from trace_format.h: plain
// identifiers, nothing to escape.
struct Key {
  const char* name;
};
std::ostream& operator<<(std::ostream& os, Key k) { return os << '"' << k.name << "\":"; }
struct Lit {
  const char* value;
};
std::ostream& operator<<(std::ostream& os, Lit v) { return os << '"' << v.value << '"'; }

std::string fixed3(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3f", v);
  return buf;
}

void nvtx_push(const std::string& name) {
#if FLATSHARD_WITH_CUDA
  nvtxRangePushA(name.c_str());
#endif
}
void nvtx_pop() {
#if FLATSHARD_WITH_CUDA
  nvtxRangePop();
#endif
}
uint64_t nvtx_start(const std::string& name) {
#if FLATSHARD_WITH_CUDA
  return nvtxRangeStartA(name.c_str());
#else
  return 0;
#endif
}
void nvtx_end(uint64_t id) {
#if FLATSHARD_WITH_CUDA
  nvtxRangeEnd(id);
#endif
}

}  // namespace

const char* to_string(TraceKind kind) {
  switch (kind) {
    case TraceKind::kPreForward:
      return tf::cat::kPreForward;
    case TraceKind::kForward:
      return tf::cat::kForward;
    case TraceKind::kAllGather:
      return tf::cat::kAllGather;
    case TraceKind::kWaitAllGather:
      return tf::cat::kWaitAllGather;
    case TraceKind::kReshard:
      return tf::cat::kReshard;
    case TraceKind::kPreBackward:
      return tf::cat::kPreBackward;
    case TraceKind::kBackward:
      return tf::cat::kBackward;
    case TraceKind::kReduce:
      return tf::cat::kReduce;
    case TraceKind::kWaitReduce:
      return tf::cat::kWaitReduce;
    case TraceKind::kOptimizer:
      return tf::cat::kOptimizer;
    case TraceKind::kOffloadWait:
      return tf::cat::kOffloadWait;
    case TraceKind::kOffloadStep:
      return tf::cat::kOffloadStep;
  }
  return "?";
}

std::string trace_file_for_rank(const std::string& path, int rank, int world_size) {
  const std::string key = "{rank}";
  const auto at = path.find(key);
  if (at != std::string::npos)
    return path.substr(0, at) + std::to_string(rank) + path.substr(at + key.size());
  if (world_size <= 1) return path;
  const std::string ext = ".json";
  const bool has_ext =
      path.size() > ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0;
  const std::string stem = has_ext ? path.substr(0, path.size() - ext.size()) : path;
  return stem + ".rank" + std::to_string(rank) + (has_ext ? ext : "");
}

std::unique_ptr<Tracer> Tracer::create(const ShardingOptions& options, Communicator& comm,
                                       c10::Stream all_gather_stream,
                                       c10::Stream reduce_scatter_stream) {
  std::string path = options.trace.path;
  int max_steps = options.trace.max_steps;
  if (path.empty()) {
    // Both knobs are declared and validated in collectives/env.h.
    path = env::trace_path();
    if (path.empty()) return nullptr;
    if (!env::get(env::kTraceSteps).empty()) max_steps = env::trace_steps();
  }
  TORCH_CHECK(max_steps >= 0, "TraceOptions::max_steps must be >= 0, got ", max_steps);
  if (path != "nvtx") {
    // A directory is refused here, at setup (trace.h): its rank file would land beside it.
    const std::string file = trace_file_for_rank(path, comm.rank(), comm.world_size());
    for (const std::string& p : {path, file}) {
      struct stat st {};
      TORCH_CHECK(p.back() != '/' && !(::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode)),
                  "flatshard trace: '", path, "' (FLATSHARD_TRACE or TraceOptions::path) ",
                  p == path ? std::string("is")
                            : "names the directory '" + file + "' for this rank: it is",
                  " a directory, not a file path: give a file inside it, e.g. '",
                  path.back() == '/' ? path : path + "/", "trace.json' (world sizes > 1 write "
                  "trace.rank<R>.json there)");
    }
    path = file;
  } else {
    path = "";
  }
  return std::make_unique<Tracer>(path, max_steps, options, comm, all_gather_stream,
                                  reduce_scatter_stream);
}

Tracer::Tracer(std::string path, int max_steps, const ShardingOptions& options,
               Communicator& comm, c10::Stream all_gather_stream,
               c10::Stream reduce_scatter_stream)
    : path_(std::move(path)),
      record_(!path_.empty()),
      max_steps_(max_steps),
      forward_prefetch_(options.forward_prefetch),
      backward_prefetch_(options.backward_prefetch),
      comm_(comm),
      all_gather_stream_(all_gather_stream),
      reduce_scatter_stream_(reduce_scatter_stream) {
  gpu_ = comm.device().type() == c10::DeviceType::CUDA;
  nvtx_ = gpu_ && FLATSHARD_WITH_CUDA;
}

Tracer::~Tracer() {
  try {
    if (record_ && !records_.empty()) write();
  } catch (const std::exception& e) {
    try {
      TORCH_WARN("flatshard: could not write the trace '", path_, "': ", e.what());
    } catch (...) {
    }
  } catch (...) {
  }
}

void Tracer::note_unit(const TraceUnit& unit) {
  const size_t i = static_cast<size_t>(unit.index);
  if (i < units_.size() && !units_[i].name.empty()) return;
  if (i >= units_.size()) {
    units_.resize(i + 1);
    open_.resize(i + 1);
  }
  UnitInfo& u = units_[i];
  u.name = unit.name;
  u.strategy = to_string(unit.strategy);
  u.reshard_after_forward = unit.reshard_after_forward;
  u.padded_numel = unit.padded_numel;
  u.all_gather_bytes = unit.all_gather_bytes;
  u.reduce_bytes = unit.reduce_bytes;
  u.kind = unit.kind;
}

std::string Tracer::event_name(TraceKind kind, int unit) const {
  std::string n;
  switch (kind) {
    case TraceKind::kForward:
      n = tf::event::kForward;
      break;
    case TraceKind::kBackward:
      n = tf::event::kBackward;
      break;
    case TraceKind::kWaitAllGather:
      n = tf::event::kWaitAllGather;
      break;
    case TraceKind::kWaitReduce:
      n = tf::event::kWaitReduce;
      break;
    case TraceKind::kReduce:
      n = unit >= 0 && units_[unit].strategy == to_string(ShardingStrategy::kNoShard)
              ? tf::event::kAllReduce
              : tf::event::kReduceScatter;
      break;
    default:
      n = to_string(kind);
  }
  if (unit >= 0 && static_cast<size_t>(unit) < units_.size()) n += " " + units_[unit].name;
  return n;
}

c10::Stream Tracer::stream_for(TraceKind kind) const {
  switch (track_for(kind)) {
    case kAllGatherTrack:
      return all_gather_stream_;
    case kReduceTrack:
      return reduce_scatter_stream_;
    default:
      return comm_.current_stream();
  }
}

int Tracer::record_event(const c10::Stream& stream) {
  int id;
  if (!free_events_.empty()) {
    id = free_events_.back();
    free_events_.pop_back();
  } else {
    events_.emplace_back(stream.device_type(), c10::EventFlag::BACKEND_DEFAULT);  // timed
    id = static_cast<int>(events_.size()) - 1;
  }
  events_[id].record(stream);
  return id;
}

void Tracer::release_event(int id) { free_events_.push_back(id); }

bool Tracer::ensure_step(TraceKind kind) {
  if (records_.size() >= kMaxRecords) {  // e.g. an endless evaluation loop: no step ever ends
    if (!full_warned_) TORCH_WARN("flatshard trace: ", kMaxRecords, " events recorded; stopping");
    full_warned_ = true;
    return false;
  }
  if (kind == TraceKind::kOptimizer) return !steps_.empty();  // belongs to the last step
  if (step_open_) return true;
  if (static_cast<int>(steps_.size()) >= max_steps_) return false;
  resolve(/*wait=*/false);
  Step s;
  s.host_begin = now_us();
  if (gpu_) s.ref_event = record_event(comm_.current_stream());
  steps_.push_back(s);
  step_open_ = true;
  backward_ = false;
  return true;
}

Tracer::Open Tracer::open(TraceKind kind, const TraceUnit* unit) {
  Open o;
  o.kind = kind;
  if (unit != nullptr) {
    // A replicated unit's "all-gather" is a local cast, not a collective.
    if ((kind == TraceKind::kAllGather || kind == TraceKind::kWaitAllGather) &&
        (unit->strategy == ShardingStrategy::kNoShard || unit->padded_numel == 0))
      return o;
    note_unit(*unit);
    o.unit = unit->index;
  }
  if (!gpu_ && !has_host_part(kind)) return o;
  if (kind == TraceKind::kWaitReduce) o.unit = last_reduce_unit_;
  if (kind == TraceKind::kPreBackward) backward_ = true;
  o.active = true;
  if (nvtx_ && has_host_part(kind)) {
    nvtx_push(event_name(kind, o.unit));
    o.nvtx = true;
  }
  if (!record_ || !ensure_step(kind)) return o;
  TraceRecord r;
  r.kind = kind;
  r.unit = o.unit;
  r.step = static_cast<int>(steps_.size()) - 1;
  r.backward = backward_;
  if (kind == TraceKind::kAllGather) r.bytes = unit->all_gather_bytes;
  if (kind == TraceKind::kReduce) {
    r.bytes = unit->reduce_bytes;
    last_reduce_unit_ = o.unit;
  }
  r.host_begin = now_us();
  if (gpu_ && has_gpu_part(kind)) r.gpu_begin_event = record_event(stream_for(kind));
  o.record = static_cast<int>(records_.size());
  records_.push_back(r);
  return o;
}

void Tracer::close(const Open& o) {
  if (!o.active) return;
  if (o.nvtx) nvtx_pop();
  if (o.record >= 0) {
    TraceRecord& r = records_[o.record];
    r.host_end = now_us();  // before the end event is recorded: the GPU cannot run it earlier
    if (r.gpu_begin_event >= 0) r.gpu_end_event = record_event(stream_for(r.kind));
  }
  // The unit's parameters are ready: its forward / backward compute starts here.
  if (o.kind == TraceKind::kPreForward) begin_span(TraceKind::kForward, o.unit);
  if (o.kind == TraceKind::kPreBackward) begin_span(TraceKind::kBackward, o.unit);
}

void Tracer::begin_span(TraceKind kind, int unit) {
  if (unit < 0) return;
  // A unit entered several times per forward gets several pre-backward hooks but reduces once:
  // its backward is one span, from the first hook to the post-backward one.
  if (kind == TraceKind::kBackward)
    for (const auto& s : open_[unit])
      if (s.kind == TraceKind::kBackward) return;
  OpenSpan span{kind, -1, 0};
  if (nvtx_) span.nvtx_range = nvtx_start(event_name(kind, unit));
  if (record_ && ensure_step(kind)) {
    TraceRecord r;
    r.kind = kind;
    r.unit = unit;
    r.step = static_cast<int>(steps_.size()) - 1;
    r.backward = backward_;
    r.host_begin = now_us();
    if (gpu_) r.gpu_begin_event = record_event(stream_for(kind));
    span.record = static_cast<int>(records_.size());
    records_.push_back(r);
  }
  open_[unit].push_back(span);
}

void Tracer::end(TraceKind kind, const TraceUnit& unit) {
  const size_t u = static_cast<size_t>(unit.index);
  if (u >= open_.size()) return;
  auto& spans = open_[u];
  // The innermost open span of this kind (a unit called recursively nests its spans).
  for (size_t i = spans.size(); i-- > 0;) {
    if (spans[i].kind != kind) continue;
    if (nvtx_) nvtx_end(spans[i].nvtx_range);
    if (spans[i].record >= 0) {
      TraceRecord& r = records_[spans[i].record];
      r.host_end = now_us();
      if (r.gpu_begin_event >= 0) r.gpu_end_event = record_event(stream_for(kind));
    }
    spans.erase(spans.begin() + static_cast<std::ptrdiff_t>(i));
    return;
  }
}

void Tracer::step_end() {
  if (record_ && step_open_) steps_.back().host_end = now_us();
  step_open_ = false;
  backward_ = false;
}

void Tracer::resolve(bool wait) {
  if (!gpu_) return;
  auto done = [&](int id) {
    if (wait) events_[id].synchronize();
    return wait || events_[id].query();
  };
  // Step references, in order: each is timed against the previous one (short intervals keep
  // the float milliseconds of cudaEventElapsedTime precise over long runs).
  for (size_t s = 0; s < steps_.size(); ++s) {
    Step& st = steps_[s];
    if (st.ref >= 0) continue;
    if (!done(st.ref_event)) break;
    if (s == 0) {
      st.ref = 0;
    } else {
      const Step& prev = steps_[s - 1];
      st.ref = prev.ref + events_[prev.ref_event].elapsedTime(events_[st.ref_event]) * 1000.0;
    }
  }
  bool all_before_resolved = true;
  for (size_t i = first_pending_; i < records_.size(); ++i) {
    TraceRecord& r = records_[i];
    const bool pending = r.gpu_begin_event >= 0 || r.gpu_end_event >= 0;
    if (pending) {
      const Step& st = steps_[r.step];
      const bool closed = r.gpu_end_event >= 0;
      if (st.ref >= 0 && closed && done(r.gpu_begin_event) && done(r.gpu_end_event)) {
        const c10::Event& ref = events_[st.ref_event];
        r.gpu_begin = st.ref + ref.elapsedTime(events_[r.gpu_begin_event]) * 1000.0;
        r.gpu_end = st.ref + ref.elapsedTime(events_[r.gpu_end_event]) * 1000.0;
        release_event(r.gpu_begin_event);
        release_event(r.gpu_end_event);
        r.gpu_begin_event = r.gpu_end_event = -1;
      } else {
        all_before_resolved = false;
      }
    }
    if (all_before_resolved) first_pending_ = i + 1;
  }
}

double Tracer::now_us() { return flatshard::now_us(); }

int Tracer::recording_step() const {
  return record_ && step_open_ ? static_cast<int>(steps_.size()) - 1 : -1;
}

void Tracer::record_worker(TraceKind kind, int unit, int step, double begin_us, double end_us) {
  if (!record_ || step < 0) return;
  std::lock_guard<std::mutex> lock(worker_mu_);
  if (worker_records_.size() >= kMaxRecords) return;
  TraceRecord r;
  r.kind = kind;
  r.unit = unit;
  r.step = step;
  r.backward = true;
  r.host_begin = begin_us;
  r.host_end = end_us;
  worker_records_.push_back(r);
}

const std::vector<TraceRecord>& Tracer::records() {
  resolve(/*wait=*/false);
  return records_;
}

std::string Tracer::write() {
  if (!record_) return "";
  resolve(/*wait=*/true);
  // Whole or not at all (support/output_file.h): a failed write, a full disk, leaves an earlier
  // trace at this path as it was, never a truncated one.
  std::ostringstream os;
  write_json(os);
  write_file(path_, os.str(), "flatshard trace (rank " + std::to_string(comm_.rank()) + ")");
  return path_;
}

void Tracer::write_json(std::ostream& os) const {
  const int rank = comm_.rank();
  // GPU -> host clock: the smallest offset that puts no GPU event before its host record call.
  double offset = -std::numeric_limits<double>::infinity();
  for (const auto& r : records_) {
    if (r.gpu_begin < 0 && r.gpu_end < 0) continue;
    offset = std::max({offset, r.host_begin - r.gpu_begin, r.host_end - r.gpu_end});
  }
  for (const auto& s : steps_)
    if (s.ref >= 0) offset = std::max(offset, s.host_begin - s.ref);
  const bool have_gpu = offset > -std::numeric_limits<double>::infinity();

  namespace k = tf::key;
  os << '{' << Key{k::kDisplayTimeUnit} << Lit{k::kDisplayTimeUnitValue} << ','
     << Key{k::kOtherData} << '{' << Key{tf::kMarker} << tf::kVersion << ',' << Key{k::kRank}
     << rank << ',' << Key{k::kWorldSize} << comm_.world_size() << ',' << Key{k::kDevice};
  write_string(os, comm_.device().str());
  os << ',' << Key{k::kForwardPrefetch} << forward_prefetch_ << ',' << Key{k::kBackwardPrefetch}
     << backward_prefetch_ << ',' << Key{k::kUnits} << '[';
  bool first = true;
  for (size_t i = 0; i < units_.size(); ++i) {
    const UnitInfo& u = units_[i];
    if (u.name.empty()) continue;
    os << (first ? "" : ",") << '{' << Key{k::kIndex} << i << ',' << Key{k::kName};
    write_string(os, u.name);
    os << ',' << Key{k::kStrategy};
    write_string(os, u.strategy);
    os << ',' << Key{k::kReshardAfterForward} << (u.reshard_after_forward ? "true" : "false")
       << ',' << Key{k::kPaddedNumel} << u.padded_numel << ',' << Key{k::kAllGatherBytes}
       << u.all_gather_bytes << ',' << Key{k::kReduceBytes} << u.reduce_bytes << ','
       << Key{k::kKind};
    write_string(os, u.kind);
    os << '}';
    first = false;
  }
  os << "]},\n" << Key{k::kTraceEvents} << "[\n";
  // Metadata events ("ph": "M"): Chrome's names for processes and threads and their order.
  os << '{' << Key{k::kPh} << "\"M\"," << Key{k::kPid} << rank << ',' << Key{k::kName}
     << "\"process_name\"," << Key{k::kArgs} << '{' << Key{k::kName} << "\"rank " << rank
     << "\"}},\n{" << Key{k::kPh} << "\"M\"," << Key{k::kPid} << rank << ',' << Key{k::kName}
     << "\"process_sort_index\"," << Key{k::kArgs} << "{\"sort_index\":" << rank << "}}";
  std::vector<TraceRecord> worker;
  {
    std::lock_guard<std::mutex> lock(worker_mu_);
    worker = worker_records_;
  }
  for (int t = 0; t < tf::kTrackCount; ++t) {
    const bool shown = t == kHostTrack || (gpu_ && t != tf::kOffloadStepTrack) ||
                       (t == tf::kOffloadStepTrack && !worker.empty());
    if (!shown) continue;
    os << ",\n{" << Key{k::kPh} << "\"M\"," << Key{k::kPid} << rank << ',' << Key{k::kTid} << t
       << ',' << Key{k::kName} << "\"thread_name\"," << Key{k::kArgs} << '{' << Key{k::kName}
       << Lit{kTrackNames[t]} << "}},\n{" << Key{k::kPh} << "\"M\"," << Key{k::kPid} << rank
       << ',' << Key{k::kTid} << t << ',' << Key{k::kName} << "\"thread_sort_index\","
       << Key{k::kArgs} << "{\"sort_index\":" << t << "}}";
  }
  auto event = [&](const std::string& name, const char* cat, double ts, double dur, int tid,
                   const TraceRecord* r, int step) {
    os << ",\n{" << Key{k::kPh} << Lit{k::kPhComplete} << ',' << Key{k::kName};
    write_string(os, name);
    os << ',' << Key{k::kCat} << Lit{cat} << ',' << Key{k::kTs} << fixed3(ts) << ','
       << Key{k::kDur} << fixed3(std::max(dur, 0.0)) << ',' << Key{k::kPid} << rank << ','
       << Key{k::kTid} << tid << ',' << Key{k::kArgs} << '{' << Key{k::kStep} << step;
    if (r != nullptr) {
      if (r->unit >= 0 && static_cast<size_t>(r->unit) < units_.size()) {
        os << ',' << Key{k::kUnit};
        write_string(os, units_[r->unit].name);
        os << ',' << Key{k::kPhase}
           << Lit{r->backward ? tf::phase::kBackward : tf::phase::kForward};
      }
      if (r->bytes) os << ',' << Key{k::kBytes} << r->bytes;
      if (tid != kHostTrack && tid != tf::kOffloadStepTrack)
        os << ',' << Key{k::kHostTs} << fixed3(r->host_begin) << ',' << Key{k::kHostEnd}
           << fixed3(r->host_end);
    }
    os << "}}";
  };
  double last_host = 0;
  for (const auto& r : records_) last_host = std::max(last_host, r.host_end);
  for (size_t s = 0; s < steps_.size(); ++s) {
    const Step& st = steps_[s];
    const double end = st.host_end >= st.host_begin ? st.host_end : last_host;
    event(tf::event::kStepPrefix + std::to_string(s), tf::cat::kStep, st.host_begin,
          end - st.host_begin, kHostTrack, nullptr, static_cast<int>(s));
  }
  for (const auto& r : records_) {
    if (r.host_end < r.host_begin) continue;  // never closed (the step was cut short)
    const std::string name = event_name(r.kind, r.unit);
    if (has_host_part(r.kind))
      event(name, to_string(r.kind), r.host_begin, r.host_end - r.host_begin, kHostTrack, &r,
            r.step);
    if (have_gpu && r.gpu_begin >= 0 && r.gpu_end >= 0)
      event(name, to_string(r.kind), r.gpu_begin + offset, r.gpu_end - r.gpu_begin,
            track_for(r.kind), &r, r.step);
  }
  // The stepper's spans, in the step their work was queued in (they may run after it ended:
  // the host runs ahead of the device, and a delayed step runs in the next step's forward).
  for (const auto& r : worker)
    event(event_name(r.kind, r.unit), to_string(r.kind), r.host_begin, r.host_end - r.host_begin,
          tf::kOffloadStepTrack, &r, r.step);
  os << "\n]}\n";
}

}  // namespace flatshard
