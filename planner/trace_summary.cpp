// flatshard/planner/trace_summary.cpp — see trace_summary.h.
#include "planner/trace_summary.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include <sys/stat.h>

#include "fsdp/trace_format.h"
#include "support/format.h"
#include "support/input_file.h"
#include "wrap_policies/policy.h"

namespace flatshard {

namespace {

using nlohmann::json;
namespace tf = trace_format;
namespace k = trace_format::key;
using tf::kAllGatherTrack;
using tf::kComputeTrack;
using tf::kHostTrack;
using tf::kReduceTrack;

// Below this, one all-gather is dominated by latency (docs/design.md: 1 MiB ~ 16 MiB in time).
constexpr int64_t kLatencyBoundBytes = int64_t{1} << 20;
// An all-gather this many times slower than the median unit's is an outlier.
constexpr double kOutlierFactor = 5.0;
// ... or this many times slower than the slowest unit gathering 4x+ more bytes.
constexpr double kLargerFactor = 1.5;

std::string ms(double us) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", us / 1000.0);
  return buf;
}

// --- reading: members with the reader's tolerance ---------------------------------------------
// Optional fields may be missing or of another type (hand-made and older traces leave some out):
// the fallback. Required ones are checked, and the error says which and what was there.

const json* member(const json& o, const char* key) {
  if (!o.is_object()) return nullptr;
  const auto it = o.find(key);
  return it == o.end() ? nullptr : &*it;
}

double number_or(const json& o, const char* key, double fallback) {
  const json* v = member(o, key);
  return v && v->is_number() ? v->get<double>() : fallback;
}

std::string string_or(const json& o, const char* key, const std::string& fallback) {
  const json* v = member(o, key);
  return v && v->is_string() ? v->get<std::string>() : fallback;
}

const char* type_of(const json* v) { return v ? v->type_name() : "nothing"; }

double number_at(const json& o, const char* key, const char* where) {
  const json* v = member(o, key);
  TORCH_CHECK(v && v->is_number(), where, ": expected a number '", key, "', got ", type_of(v));
  return v->get<double>();
}

const json& array_at(const json& o, const char* key, const char* where) {
  const json* v = member(o, key);
  TORCH_CHECK(v && v->is_array(), where, ": expected an array '", key, "', got ", type_of(v));
  return *v;
}

// Bounds of what a trace may say (trace_summary.h): integers the reader casts, and times.
constexpr int64_t kMaxWorld = int64_t{1} << 24;     // ranks (as otherData.world_size's bound)
constexpr int64_t kMaxStep = int64_t{1} << 30;
constexpr int64_t kMaxBytes = int64_t{1} << 62;
constexpr int64_t kMaxPrefetch = int64_t{1} << 20;
constexpr double kMaxTimeUs = 1e15;      // ~31.7 years of steady_clock (time since boot)
constexpr double kMaxDurationUs = 1e12;  // ~11.6 days for one event

// An optional integer member: absent or not a number, the fallback (as number_or); a number
// must be an integer in [lo, hi] (it is cast: 1e30 would be undefined behaviour).
int64_t integer_or(const json& o, const char* key, int64_t fallback, int64_t lo, int64_t hi,
                   const std::string& where) {
  const json* v = member(o, key);
  if (!v || !v->is_number()) return fallback;
  const double d = v->get<double>();
  TORCH_CHECK(d >= static_cast<double>(lo) && d <= static_cast<double>(hi) && d == std::floor(d),
              where, ": '", key, "' must be an integer in [", lo, ", ", hi, "], got ", v->dump());
  return v->is_number_float() ? static_cast<int64_t>(d) : v->get<int64_t>();
}

int64_t integer_at(const json& o, const char* key, int64_t lo, int64_t hi,
                   const std::string& where) {
  const json* v = member(o, key);
  TORCH_CHECK(v && v->is_number(), where, ": expected a number '", key, "', got ", type_of(v));
  return integer_or(o, key, 0, lo, hi, where);
}

TraceUnitMeta unit_meta(const json& u) {
  TraceUnitMeta m;
  const json* name = member(u, k::kName);
  TORCH_CHECK(name && name->is_string(), "otherData.", k::kUnits, ": expected a string '",
              k::kName, "', got ", type_of(name));
  m.name = name->get<std::string>();
  m.strategy = string_or(u, k::kStrategy, "");
  const json* r = member(u, k::kReshardAfterForward);
  m.reshard_after_forward = r && r->is_boolean() && r->get<bool>();
  const std::string where = "otherData.units: unit '" + printable_escape(m.name) + "'";
  m.padded_numel = integer_or(u, k::kPaddedNumel, 0, 0, kMaxBytes, where);
  m.all_gather_bytes = integer_or(u, k::kAllGatherBytes, 0, 0, kMaxBytes, where);
  m.reduce_bytes = integer_or(u, k::kReduceBytes, 0, 0, kMaxBytes, where);
  // Traces written before kinds were policy names carry "torch::nn::LinearImpl".
  m.kind = policy_type_name(string_or(u, k::kKind, ""));
  return m;
}

// One rank's otherData: the format version first (a reader of another version would misread).
RankTrace rank_meta(const json& other) {
  const json* version = member(other, tf::kMarker);
  TORCH_CHECK(version, "not a flatshard trace: no otherData.", tf::kMarker,
              " (written by fsdp/trace.h)");
  TORCH_CHECK(version->is_number() && version->get<double>() == tf::kVersion,
              "flatshard trace format version ", version->dump(), ": this reader reads version ",
              tf::kVersion);
  RankTrace t;
  // Both bound the casts and the per-rank maps below: a rank must be an integer in
  // [0, world_size) (a hand-edited 1e30 or -1 would otherwise be undefined behaviour or a
  // phantom rank).
  const double world = number_or(other, k::kWorldSize, 1);
  TORCH_CHECK(world >= 1 && world <= (1 << 24) && world == std::floor(world),
              "otherData: world_size must be an integer in [1, ", 1 << 24, "], got ",
              member(other, k::kWorldSize)->dump());
  t.world_size = static_cast<int>(world);
  const double rank = number_at(other, k::kRank, "otherData");
  TORCH_CHECK(rank >= 0 && rank < world && rank == std::floor(rank),
              "otherData: rank must be an integer in [0, world_size - 1] = [0, ", t.world_size - 1,
              "], got ", member(other, k::kRank)->dump());
  t.rank = static_cast<int>(rank);
  t.device = string_or(other, k::kDevice, "?");
  t.forward_prefetch =
      static_cast<int>(integer_or(other, k::kForwardPrefetch, 1, 0, kMaxPrefetch, "otherData"));
  t.backward_prefetch =
      static_cast<int>(integer_or(other, k::kBackwardPrefetch, 1, 0, kMaxPrefetch, "otherData"));
  if (member(other, k::kUnits))
    for (const auto& u : array_at(other, k::kUnits, "otherData")) t.units.push_back(unit_meta(u));
  return t;
}

// "trace event <index> '<name>'": how an event's errors start (the index into traceEvents).
std::string event_where(size_t index, const std::string& name) {
  return "trace event " + std::to_string(index) + " '" + printable_escape(name) + "'";
}

// A time in microseconds: finite, within [lo, hi].
double time_at(const json& o, const char* key, double fallback, bool required, double lo,
               double hi, const std::string& where) {
  const json* v = member(o, key);
  if (!v || !v->is_number()) {
    TORCH_CHECK(!required, where, ": expected a number '", key, "', got ", type_of(v));
    return fallback;
  }
  const double d = v->get<double>();
  TORCH_CHECK(std::isfinite(d) && d >= lo && d <= hi, where, ": '", key, "' ", v->dump(),
              " is outside [", lo, ", ", hi, "] us (", key == std::string(k::kDur)
                  ? "durations are never negative; 1e12 us is ~11.6 days"
                  : "steady_clock time in microseconds; 1e15 us is ~31 years",
              ")");
  return d;
}

// Checks one complete event's fields (trace_summary.h: what a valid event is); `index` is its
// place in traceEvents.
TraceEvent trace_event(const json& e, size_t index) {
  TraceEvent ev;
  ev.index = index;
  ev.name = string_or(e, k::kName, "");
  const std::string where = event_where(index, ev.name);
  ev.rank = static_cast<int>(integer_at(e, k::kPid, 0, kMaxWorld, where));
  ev.tid = static_cast<int>(integer_or(e, k::kTid, 0, 0, tf::kTrackCount - 1, where));
  ev.cat = string_or(e, k::kCat, "");
  ev.ts = time_at(e, k::kTs, 0, /*required=*/true, -kMaxTimeUs, kMaxTimeUs, where);
  ev.dur = time_at(e, k::kDur, 0, /*required=*/false, 0, kMaxDurationUs, where);
  if (const json* a = member(e, k::kArgs)) {
    ev.unit = string_or(*a, k::kUnit, "");
    ev.phase = string_or(*a, k::kPhase, "");
    ev.step = static_cast<int>(integer_or(*a, k::kStep, -1, 0, kMaxStep, where + ": args"));
    ev.bytes = integer_or(*a, k::kBytes, 0, 0, kMaxBytes, where + ": args");
    ev.host_ts = time_at(*a, k::kHostTs, -1, /*required=*/false, -kMaxTimeUs, kMaxTimeUs,
                         where + ": args");
  }
  return ev;
}

// The rest of an event's validity (trace_summary.h), once its rank is known: on failure the
// error of the first bad event in document order, "" when the rank's events are consistent.
struct BadEvent {
  size_t index = std::numeric_limits<size_t>::max();
  std::string why;
  void note(size_t i, std::string w) {
    if (i < index) {
      index = i;
      why = std::move(w);
    }
  }
};

void check_rank_events(const RankTrace& r, BadEvent& bad) {
  std::set<std::string> units;
  for (const auto& u : r.units) units.insert(u.name);
  std::map<int, size_t> step_event;  // step -> the index of its step event
  for (const auto& e : r.events) {
    const std::string where = event_where(e.index, e.name);
    if (e.step < 0) {
      bad.note(e.index, where + ": no args.step (every event belongs to a step)");
      continue;
    }
    if (!e.phase.empty() && e.phase != tf::phase::kForward && e.phase != tf::phase::kBackward)
      bad.note(e.index, where + ": phase '" + printable_escape(e.phase) + "' is neither '" +
                            tf::phase::kForward + "' nor '" + tf::phase::kBackward + "'");
    if (!e.unit.empty() && !units.count(e.unit))
      bad.note(e.index, where + ": unit '" + printable_escape(e.unit) +
                            "' is not in rank " + std::to_string(r.rank) + "'s otherData." +
                            k::kUnits + " (" + std::to_string(units.size()) + " units)");
    if (e.cat == tf::cat::kStep) {
      const auto [it, fresh] = step_event.emplace(e.step, e.index);
      if (!fresh)
        bad.note(e.index, where + ": a second step event for step " + std::to_string(e.step) +
                              " of rank " + std::to_string(r.rank) + " (the first is trace event " +
                              std::to_string(it->second) + ")");
    }
  }
  if (step_event.empty() && !r.events.empty()) {
    const TraceEvent& e = r.events.front();
    bad.note(e.index, event_where(e.index, e.name) + ": rank " + std::to_string(r.rank) +
                          " has no step events (" + std::to_string(r.events.size()) +
                          " other events): nothing to summarise; fsdp/trace.h writes one per "
                          "recorded step");
  }
  for (const auto& e : r.events)
    if (e.step >= 0 && !step_event.empty() && !step_event.count(e.step))
      bad.note(e.index, event_where(e.index, e.name) + ": step " + std::to_string(e.step) +
                            " of rank " + std::to_string(r.rank) + " has no step event");
  // One event per (track, category, unit, phase, step, begin, host record time): two with all of
  // them equal are one event written twice (the recorder's events of one unit and kind differ in
  // their begin times; a unit called twice in one pass has two of each).
  auto key = [&](const TraceEvent& e) {
    return std::tie(e.tid, e.cat, e.unit, e.phase, e.step, e.ts, e.host_ts);
  };
  std::vector<const TraceEvent*> order;
  order.reserve(r.events.size());
  for (const auto& e : r.events) order.push_back(&e);
  std::sort(order.begin(), order.end(), [&](const TraceEvent* a, const TraceEvent* b) {
    return key(*a) < key(*b) || (key(*a) == key(*b) && a->index < b->index);
  });
  for (size_t i = 1; i < order.size(); ++i)
    if (key(*order[i]) == key(*order[i - 1]))
      bad.note(order[i]->index,
               event_where(order[i]->index, order[i]->name) + ": the same event as trace event " +
                   std::to_string(order[i - 1]->index) +
                   " (track, category, unit, phase, step and begin time all equal): a trace "
                   "holds each event once");
}

// --- summarize, step by step -------------------------------------------------------------------

// Self time of each event on one track: its duration minus that of the events directly nested
// in it (events sorted by begin, longer first on ties).
std::vector<double> self_times(const std::vector<const TraceEvent*>& evs) {
  std::vector<double> self(evs.size());
  std::vector<size_t> stack;
  for (size_t i = 0; i < evs.size(); ++i) {
    self[i] = evs[i]->dur;
    while (!stack.empty() && evs[stack.back()]->ts + evs[stack.back()]->dur <= evs[i]->ts)
      stack.pop_back();
    if (!stack.empty()) self[stack.back()] -= evs[i]->dur;
    stack.push_back(i);
  }
  return self;
}

struct Acc {  // sums over the used steps of one rank
  double fwd = 0, bwd = 0, ag_fwd = 0, ag_bwd = 0, rs = 0, gap = 0, ags = 0, rss = 0, ag_time = 0;
  double host = 0;
  std::map<std::string, double> host_by_phase;
  double cpu_wait = 0, cpu_step = 0;  // the CPU optimizer track
};

// The host spans of flatshard's hooks (not the model's forward / backward spans around them).
bool is_hook_span(const std::string& cat) {
  return cat == tf::cat::kPreForward || cat == tf::cat::kAllGather || cat == tf::cat::kReshard ||
         cat == tf::cat::kPreBackward || cat == tf::cat::kReduce;
}

std::string advice_for(const UnitCost& u, const TraceSummary& s, const RankTrace& meta,
                       double median_ag_call_us) {
  const double ag = u.all_gather_forward_us + u.all_gather_backward_us;
  if (u.host_gap_us >= ag && u.host_gap_us >= u.reduce_us)
    return "host-bound: the GPU waited for the host before this unit; fewer, larger units "
           "(e.g. every=2) and less host work per unit";
  if (!s.gpu) {
    // Slower than units gathering 4x+ more bytes: the size cannot explain it.
    double larger_max = 0;
    for (const auto& o : s.units)
      if (o.all_gathers > 0 && o.gathered_bytes >= 4 * std::max<int64_t>(u.gathered_bytes, 1))
        larger_max = std::max(larger_max, o.all_gather_call_us);
    if (larger_max > 0 && u.all_gather_call_us > kLargerFactor * larger_max &&
        !(median_ag_call_us > 0 && u.all_gather_call_us > kOutlierFactor * median_ag_call_us)) {
      return "its all-gathers (" + format_bytes(u.gathered_bytes) + ") take " +
             ms(u.all_gather_call_us) + " ms each, longer than those of units 4x its size or "
             "more (at most " + ms(larger_max) + " ms): a delayed rank or slow link, not the "
             "plan (synchronous CPU collectives cannot be hidden by prefetch)";
    }
    if (median_ag_call_us > 0 && u.all_gather_call_us > kOutlierFactor * median_ag_call_us) {
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "its all-gathers take %s ms each, %.0fx the median unit's %s ms: a delayed "
                    "rank or slow link, not the plan (synchronous CPU collectives cannot be "
                    "hidden by prefetch)",
                    ms(u.all_gather_call_us).c_str(), u.all_gather_call_us / median_ag_call_us,
                    ms(median_ag_call_us).c_str());
      return buf;
    }
    return "CPU collectives are synchronous: fewer, larger units (e.g. every=2) issue fewer";
  }
  if (u.reduce_us > ag)
    return "its reduction is not hidden by the next unit's backward: group layers (every=2) "
           "or reduce in bf16 (MixedPrecision::reduce_dtype)";
  if (u.gathered_bytes > 0 && u.gathered_bytes < kLatencyBoundBytes)
    return "its all-gather (" + format_bytes(u.gathered_bytes) +
           ") is latency-bound: group layers: every=2";
  const bool forward = u.all_gather_forward_us >= u.all_gather_backward_us;
  const int depth = forward ? meta.forward_prefetch : meta.backward_prefetch;
  if (depth < 2)
    return std::string("raise ") + (forward ? "forward_prefetch" : "backward_prefetch") +
           " (now " + std::to_string(depth) + ")";
  return "its all-gather (" + format_bytes(u.gathered_bytes) +
         ") outlasts the compute it overlaps: group layers (every=2) or gather in bf16";
}

// Unit order: plan order from the ranks' metadata (the first rank's first), then any unit only
// events name, as they show up.
struct UnitOrder {
  std::vector<std::string> names;
  std::map<std::string, TraceUnitMeta> meta;
  void add(const TraceUnitMeta& u) {
    if (meta.emplace(u.name, u).second) names.push_back(u.name);
  }
};

UnitOrder plan_order(const std::vector<RankTrace>& ranks) {
  UnitOrder order;
  for (const auto& r : ranks)
    for (const auto& u : r.units) order.add(u);
  return order;
}

// The steps of one rank that count (the first is warm-up when there are more) and the durations
// of their host "step" spans.
struct RankSteps {
  std::set<int> used;
  std::map<int, double> dur;
  int seen = 0;  // steps in the trace
};

RankSteps rank_steps(const RankTrace& r, bool skip_first) {
  RankSteps s;
  for (const auto& e : r.events)
    if (e.cat == tf::cat::kStep) {
      s.used.insert(e.step);
      s.dur[e.step] = e.dur;
    }
  s.seen = static_cast<int>(s.used.size());
  if (skip_first && s.used.size() > 1) s.used.erase(s.used.begin());
  return s;
}

// GPU: per used step, the host's issue span (first to last host event) and the GPU's (first to
// last stream event), summed over the steps of all ranks.
struct SpanSums {
  double issue = 0, gpu = 0;
  size_t issue_n = 0, gpu_n = 0;
};

void add_step_spans(const RankTrace& r, const std::set<int>& steps, SpanSums& sums) {
  std::map<int, std::pair<double, double>> host_span, gpu_span;
  for (const auto& e : r.events) {
    if (!steps.count(e.step) || e.cat == tf::cat::kStep || e.tid == tf::kOffloadStepTrack)
      continue;  // the CPU optimizer's thread is neither the issuing host nor a stream
    auto [it, fresh] =
        (e.tid == kHostTrack ? host_span : gpu_span).try_emplace(e.step, e.ts, e.ts + e.dur);
    if (fresh) continue;
    it->second.first = std::min(it->second.first, e.ts);
    it->second.second = std::max(it->second.second, e.ts + e.dur);
  }
  for (const auto& [st, sp] : host_span) sums.issue += sp.second - sp.first;
  for (const auto& [st, sp] : gpu_span) sums.gpu += sp.second - sp.first;
  sums.issue_n += host_span.size();
  sums.gpu_n += gpu_span.size();
}

// Each track's unit events of the used steps, by begin time, longer first on ties (an enclosing
// event before the ones nested in it: self_times() relies on it).
using Tracks = std::array<std::vector<const TraceEvent*>, tf::kTrackCount>;

Tracks step_tracks(const RankTrace& r, const std::set<int>& steps) {
  Tracks tracks;
  for (const auto& e : r.events)
    if (steps.count(e.step) && e.tid >= 0 && e.tid < tf::kTrackCount && e.cat != tf::cat::kStep)
      tracks[e.tid].push_back(&e);
  for (auto& t : tracks)
    std::stable_sort(t.begin(), t.end(), [](const TraceEvent* a, const TraceEvent* b) {
      return a->ts < b->ts || (a->ts == b->ts && a->dur > b->dur);
    });
  return tracks;
}

// One rank's per-unit sums over its used steps: the self time of the forward / backward spans on
// the compute stream (GPU) or the host (CPU), and the collectives' counts and durations. On CPU
// the host collectives are the exposed time (trace_summary.h).
std::map<std::string, Acc> unit_times(const Tracks& tracks, bool gpu) {
  std::map<std::string, Acc> acc;
  const auto& compute = tracks[gpu ? kComputeTrack : kHostTrack];
  const std::vector<double> self = self_times(compute);
  for (size_t i = 0; i < compute.size(); ++i) {
    if (compute[i]->cat == tf::cat::kForward) acc[compute[i]->unit].fwd += self[i];
    if (compute[i]->cat == tf::cat::kBackward) acc[compute[i]->unit].bwd += self[i];
  }
  for (const auto* e : tracks[gpu ? kAllGatherTrack : kHostTrack])
    if (e->cat == tf::cat::kAllGather) {
      Acc& a = acc[e->unit];
      a.ags += 1;
      a.ag_time += e->dur;
      if (!gpu) (e->phase == tf::phase::kBackward ? a.ag_bwd : a.ag_fwd) += e->dur;
    }
  for (const auto* e : tracks[gpu ? kReduceTrack : kHostTrack])
    if (e->cat == tf::cat::kReduce) {
      acc[e->unit].rss += 1;
      if (!gpu) acc[e->unit].rs += e->dur;
    }
  for (const auto* e : tracks[tf::kOffloadStepTrack]) {
    if (e->cat == tf::cat::kOffloadWait) acc[e->unit].cpu_wait += e->dur;
    if (e->cat == tf::cat::kOffloadStep) acc[e->unit].cpu_step += e->dur;
  }
  // UnitCost::host_us: top-level hook spans only (sorted by begin, enclosing first), so a
  // prefetch's all-gather inside another unit's pre-forward is not counted twice.
  double top_end = -1;
  for (const auto* e : tracks[kHostTrack]) {
    if (!is_hook_span(e->cat) || e->unit.empty()) continue;
    if (e->ts < top_end) continue;  // nested in the previous top-level hook span
    top_end = e->ts + e->dur;
    Acc& a = acc[e->unit];
    a.host += e->dur;
    a.host_by_phase[e->cat] += e->dur;
  }
  return acc;
}

// GPU: the compute stream's waits (exposed communication) and the idle gaps the host caused
// (trace_summary.h says when a gap counts), into `acc` and `gaps`.
void add_gpu_exposure(int rank, const std::vector<const TraceEvent*>& compute, double starved_us,
                      std::map<std::string, Acc>& acc, std::vector<IdleGap>& gaps) {
  std::vector<std::pair<double, double>> seen;  // this step's earlier [begin, end)
  int cur_step = -1;
  for (const auto* e : compute) {
    if (e->step != cur_step) {
      cur_step = e->step;
      seen.clear();
    }
    double prev = -1;
    for (const auto& [b, en] : seen) prev = std::max(prev, en <= e->ts ? en : b);
    if (e->cat == tf::cat::kWaitAllGather || e->cat == tf::cat::kWaitReduce) {
      const bool ag = e->cat == tf::cat::kWaitAllGather;
      if (ag) {
        (e->phase == tf::phase::kBackward ? acc[e->unit].ag_bwd : acc[e->unit].ag_fwd) += e->dur;
      } else {
        acc[e->unit].rs += e->dur;
      }
      if (e->dur > 0)
        gaps.push_back({rank, e->step, e->unit, e->phase, ag ? "all-gather" : "reduce", e->dur});
    }
    if (prev >= 0 && e->host_ts >= 0 && e->ts - e->host_ts < starved_us && e->ts > prev &&
        !e->unit.empty()) {
      acc[e->unit].gap += e->ts - prev;
      gaps.push_back({rank, e->step, e->unit, e->phase, "host", e->ts - prev});
    }
    seen.emplace_back(e->ts, e->ts + e->dur);
  }
}

// Adds one rank's per-step means (its sums over `steps` used steps) to the totals over ranks.
void add_rank_means(const std::map<std::string, Acc>& acc, double steps, UnitOrder& order,
                    std::map<std::string, Acc>& total) {
  for (const auto& [name, a] : acc) {
    if (name.empty()) continue;
    if (!order.meta.count(name)) {
      TraceUnitMeta m;
      m.name = name;
      order.add(m);
    }
    Acc& t = total[name];
    t.fwd += a.fwd / steps;
    t.bwd += a.bwd / steps;
    t.ag_fwd += a.ag_fwd / steps;
    t.ag_bwd += a.ag_bwd / steps;
    t.rs += a.rs / steps;
    t.gap += a.gap / steps;
    t.ags += a.ags / steps;
    t.rss += a.rss / steps;
    t.ag_time += a.ag_time / steps;
    t.host += a.host / steps;
    for (const auto& [phase, us] : a.host_by_phase) t.host_by_phase[phase] += us / steps;
    t.cpu_wait += a.cpu_wait / steps;
    t.cpu_step += a.cpu_step / steps;
  }
}

// The table: each unit's per-step numbers, the totals' mean over `ranks` ranks, and the step's
// sums of them.
void fill_units(TraceSummary& s, const UnitOrder& order, const std::map<std::string, Acc>& total,
                double ranks, int world_size) {
  for (const auto& name : order.names) {
    const auto found = total.find(name);
    const Acc t = found == total.end() ? Acc{} : found->second;
    UnitCost u;
    u.unit = name;
    u.forward_us = t.fwd / ranks;
    u.backward_us = t.bwd / ranks;
    u.all_gather_forward_us = t.ag_fwd / ranks;
    u.all_gather_backward_us = t.ag_bwd / ranks;
    u.reduce_us = t.rs / ranks;
    u.host_gap_us = t.gap / ranks;
    u.all_gathers = t.ags / ranks;
    u.reduces = t.rss / ranks;
    u.all_gather_call_us = t.ags > 0 ? t.ag_time / t.ags : 0;
    u.gathered_bytes = order.meta.at(name).all_gather_bytes * world_size;
    u.host_us = t.host / ranks;
    for (const auto& [phase, us] : t.host_by_phase) u.host_by_phase[phase] = us / ranks;
    u.offload_wait_us = t.cpu_wait / ranks;
    u.offload_step_us = t.cpu_step / ranks;
    s.offload_wait_us += u.offload_wait_us;
    s.offload_step_us += u.offload_step_us;
    s.compute_us += u.forward_us + u.backward_us;
    s.all_gather_us += u.all_gather_forward_us + u.all_gather_backward_us;
    s.reduce_us += u.reduce_us;
    s.host_gap_us += u.host_gap_us;
    s.units.push_back(std::move(u));
  }
}

// TraceSummary::host_by_kind: the units grouped by kind (traces without kinds: one group "").
void fill_host_by_kind(TraceSummary& s, const UnitOrder& order) {
  std::vector<std::string> kinds;
  std::map<std::string, std::vector<const UnitCost*>> by_kind;
  for (const auto& u : s.units) {
    const auto m = order.meta.find(u.unit);
    const std::string kind = m == order.meta.end() ? "" : m->second.kind;
    if (!by_kind.count(kind)) kinds.push_back(kind);
    by_kind[kind].push_back(&u);
  }
  for (const auto& kind : kinds) {
    const auto& units = by_kind.at(kind);
    KindHostCost k;
    k.kind = kind;
    k.units = static_cast<int>(units.size());
    std::vector<double> us;
    for (const UnitCost* u : units) {
      us.push_back(u->host_us);
      k.max_us = std::max(k.max_us, u->host_us);
      for (const auto& [phase, v] : u->host_by_phase) k.by_phase_us[phase] += v / units.size();
    }
    std::sort(us.begin(), us.end());
    const size_t n = us.size();
    k.median_us = n % 2 ? us[n / 2] : 0.5 * (us[n / 2 - 1] + us[n / 2]);
    s.host_by_kind.push_back(std::move(k));
  }
}

// The `top` most exposed units, most first, each with its line of advice.
void pick_offenders(TraceSummary& s, int top, const RankTrace& meta) {
  for (size_t i = 0; i < s.units.size(); ++i)
    if (s.units[i].exposed() > 0) s.offenders.push_back(i);
  std::stable_sort(s.offenders.begin(), s.offenders.end(), [&](size_t a, size_t b) {
    return s.units[a].exposed() > s.units[b].exposed();
  });
  if (static_cast<int>(s.offenders.size()) > top) s.offenders.resize(top);
  std::vector<double> calls;
  for (const auto& u : s.units)
    if (u.all_gathers > 0) calls.push_back(u.all_gather_call_us);
  std::sort(calls.begin(), calls.end());
  const double median = calls.empty() ? 0 : calls[calls.size() / 2];
  for (size_t i : s.offenders) s.units[i].advice = advice_for(s.units[i], s, meta, median);
}

std::vector<IdleGap> largest(std::vector<IdleGap> gaps, int top) {
  std::stable_sort(gaps.begin(), gaps.end(),
                   [](const IdleGap& a, const IdleGap& b) { return a.us > b.us; });
  if (static_cast<int>(gaps.size()) > top) gaps.resize(top);
  return gaps;
}

}  // namespace

std::vector<RankTrace> read_traces(const nlohmann::json& doc) {
  const nlohmann::json* events = member(doc, k::kTraceEvents);
  TORCH_CHECK(events && events->is_array(), "not a Chrome trace: expected an object with '",
              k::kTraceEvents, "' (an array), got ",
              doc.is_object() ? type_of(events) : doc.type_name());
  const nlohmann::json* other = member(doc, k::kOtherData);
  std::vector<RankTrace> ranks;
  if (other && member(*other, tf::kMergedRanks)) {
    for (const auto& o : array_at(*other, tf::kMergedRanks, "otherData"))
      ranks.push_back(rank_meta(o));
  } else {
    TORCH_CHECK(other, "not a flatshard trace: no otherData (written by fsdp/trace.h)");
    ranks.push_back(rank_meta(*other));
  }
  std::map<int, size_t> by_rank;
  for (size_t i = 0; i < ranks.size(); ++i) {
    TORCH_CHECK(by_rank.emplace(ranks[i].rank, i).second, "rank ", ranks[i].rank,
                " appears twice in one merged trace");
    TORCH_CHECK(ranks[i].world_size == ranks.front().world_size, "rank ", ranks[i].rank,
                " has world_size ", ranks[i].world_size, ", rank ", ranks.front().rank, " has ",
                ranks.front().world_size, ": not one run");
  }
  BadEvent bad;  // the error names the first bad event in document order, whatever its fault
  for (size_t i = 0; i < events->size() && i < bad.index; ++i) {
    const nlohmann::json& e = (*events)[i];
    if (string_or(e, k::kPh, "") != k::kPhComplete) continue;
    TraceEvent ev;
    try {
      ev = trace_event(e, i);
    } catch (const c10::Error& err) {
      bad.note(i, err.what_without_backtrace());
      break;
    }
    const auto it = by_rank.find(ev.rank);
    if (it == by_rank.end()) {
      bad.note(i, event_where(i, ev.name) + ": pid " + std::to_string(ev.rank) +
                      " without rank metadata (otherData holds " + std::to_string(ranks.size()) +
                      " rank(s))");
      break;
    }
    ranks[it->second].events.push_back(std::move(ev));
  }
  for (const auto& r : ranks) check_rank_events(r, bad);
  TORCH_CHECK(bad.why.empty(), bad.why);
  return ranks;
}

namespace {

// nlohmann's ordered document (support/json.h's) as the plain one this reader works on, moved
// member by member: strings are moved, containers freed as they are copied, so a large trace is
// never held twice.
nlohmann::json plain(flatshard::json::Json&& v) {
  using V = flatshard::json::Json::value_t;
  switch (v.type()) {
    case V::object: {
      nlohmann::json out = nlohmann::json::object();
      for (auto it = v.begin(); it != v.end(); ++it) out[it.key()] = plain(std::move(it.value()));
      v = nullptr;
      return out;
    }
    case V::array: {
      nlohmann::json out = nlohmann::json::array();
      auto& a = v.get_ref<flatshard::json::Json::array_t&>();
      out.get_ref<nlohmann::json::array_t&>().reserve(a.size());
      for (auto& item : a) {
        out.push_back(plain(std::move(item)));
        item = nullptr;
      }
      v = nullptr;
      return out;
    }
    case V::string:
      return nlohmann::json(std::move(v.get_ref<std::string&>()));
    case V::boolean:
      return v.get<bool>();
    case V::number_integer:
      return v.get<int64_t>();
    case V::number_unsigned:
      return v.get<uint64_t>();
    case V::number_float:
      return v.get<double>();
    default:
      return nullptr;
  }
}

}  // namespace

nlohmann::json read_trace_json(const std::string& path) {
  const std::string text =
      read_input_file(path, kMaxTraceFileBytes, "trace", "a trace's limit (kMaxTraceFileBytes)");
  flatshard::json::Json doc;
  try {
    doc = flatshard::json::parse(text);  // strict, depth-limited (support/json.h)
  } catch (const c10::Error& e) {
    // "invalid JSON at byte B (line L, column C): why" -> "<path>: not valid JSON at byte ...".
    const std::string msg = e.what_without_backtrace();
    const std::string lead = "invalid JSON";
    TORCH_CHECK(false, printable_escape(path), ": not valid JSON",
                msg.rfind(lead, 0) == 0 ? msg.substr(lead.size()) : ": " + msg);
  }
  return plain(std::move(doc));
}

namespace {

// A rank without step events has nothing to summarise (the recorder writes one per step).
void check_has_steps(const RankTrace& r) {
  for (const auto& e : r.events)
    if (e.cat == tf::cat::kStep) return;
  TORCH_CHECK(false, "rank ", r.rank, " has no step events (", r.events.size(),
              " other events): nothing to summarise; a trace fsdp/trace.h writes has one per "
              "recorded step");
}

}  // namespace

std::vector<RankTrace> read_trace_files(const std::vector<std::string>& paths) {
  std::vector<RankTrace> out;
  std::map<int, std::string> file_of_rank;            // rank -> the file it came from
  std::map<std::pair<dev_t, ino_t>, std::string> seen;  // the same file under two names
  for (const auto& p : paths) {
    struct stat st {};
    if (::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      const auto [it, fresh] = seen.emplace(std::make_pair(st.st_dev, st.st_ino), p);
      TORCH_CHECK(fresh, "'", p, "' is the same file as '", it->second,
                  "': each trace file may be given once (its ranks would count twice)");
    }
    const nlohmann::json doc = read_trace_json(p);  // its errors name the file
    try {
      for (auto& r : read_traces(doc)) {
        if (!out.empty())
          TORCH_CHECK(r.world_size == out.front().world_size, "rank ", r.rank, " has world_size ",
                      r.world_size, " but '", file_of_rank.at(out.front().rank), "' has ",
                      out.front().world_size, ": the files are not from one run");
        const auto [it, fresh] = file_of_rank.emplace(r.rank, p);
        TORCH_CHECK(fresh, "rank ", r.rank, " is in '", it->second, "' and again in '", p,
                    "': give each rank's trace once (two runs, or a file and its merge?)");
        check_has_steps(r);
        out.push_back(std::move(r));
      }
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, printable_escape(p), ": ", e.what_without_backtrace());
    }
  }
  return out;
}

nlohmann::json merge_traces(const std::vector<nlohmann::json>& docs) {
  nlohmann::json events = nlohmann::json::array(), metas = nlohmann::json::array();
  for (const auto& d : docs) {
    const nlohmann::json* ev = member(d, k::kTraceEvents);
    TORCH_CHECK(ev && ev->is_array(), "merge: not a Chrome trace (no '", k::kTraceEvents, "')");
    events.insert(events.end(), ev->begin(), ev->end());
    const nlohmann::json* other = member(d, k::kOtherData);
    if (other && member(*other, tf::kMergedRanks)) {
      const nlohmann::json& m = array_at(*other, tf::kMergedRanks, "merge: otherData");
      metas.insert(metas.end(), m.begin(), m.end());
    } else if (other) {
      metas.push_back(*other);
    }
  }
  nlohmann::json out = nlohmann::json::object();
  out[k::kDisplayTimeUnit] = k::kDisplayTimeUnitValue;
  out[k::kOtherData][tf::kMergedRanks] = std::move(metas);
  out[k::kTraceEvents] = std::move(events);
  return out;
}

TraceSummary summarize(const std::vector<RankTrace>& ranks, const SummaryOptions& opt) {
  TORCH_CHECK(!ranks.empty(), "summarize: no trace");
  for (const auto& r : ranks) check_has_steps(r);
  TraceSummary s;
  s.ranks = static_cast<int>(ranks.size());
  s.device = ranks.front().device;
  for (const auto& r : ranks)
    for (const auto& e : r.events)
      s.gpu = s.gpu || (e.tid != kHostTrack && e.tid != tf::kOffloadStepTrack);

  UnitOrder order = plan_order(ranks);
  std::map<std::string, Acc> total;  // summed over ranks of per-step means
  std::vector<IdleGap> gaps;
  SpanSums spans;
  double step_sum = 0;
  int step_count = 0;
  for (const auto& r : ranks) {
    const RankSteps steps = rank_steps(r, opt.skip_first_step);
    s.steps_total = std::max(s.steps_total, steps.seen);
    if (&r == &ranks.front()) s.steps_used.assign(steps.used.begin(), steps.used.end());
    for (int st : steps.used) {
      step_sum += steps.dur.at(st);
      ++step_count;
    }
    if (s.gpu) add_step_spans(r, steps.used, spans);
    const Tracks tracks = step_tracks(r, steps.used);
    std::map<std::string, Acc> acc = unit_times(tracks, s.gpu);
    if (s.gpu) add_gpu_exposure(r.rank, tracks[kComputeTrack], opt.starved_us, acc, gaps);
    add_rank_means(acc, std::max<size_t>(steps.used.size(), 1), order, total);
  }
  s.step_us = step_count ? step_sum / step_count : 0;
  s.host_issue_us = spans.issue_n ? spans.issue / spans.issue_n : 0;
  s.gpu_span_us = spans.gpu_n ? spans.gpu / spans.gpu_n : 0;
  fill_units(s, order, total, static_cast<double>(ranks.size()), ranks.front().world_size);
  fill_host_by_kind(s, order);
  pick_offenders(s, opt.top, ranks.front());
  s.largest_gaps = largest(std::move(gaps), opt.top);
  return s;
}

namespace {

// The verdict beside "host issue time per step vs GPU time per step". Within
// kNearlyEqualShare of each other neither side leads: a step's issue and GPU span both vary by
// more than that between steps, and a host only just ahead still starves the GPU at its slower
// units (the per-unit host gaps then say host-bound), so "runs ahead" would contradict them.
constexpr double kNearlyEqualShare = 0.10;
std::string host_vs_gpu(double host_us, double gpu_us) {
  const double hi = std::max(host_us, gpu_us);
  if (hi > 0 && std::abs(host_us - gpu_us) <= kNearlyEqualShare * hi)
    return "nearly equal, within " + std::to_string(static_cast<int>(100 * kNearlyEqualShare)) +
           "%: the host barely keeps up, and the GPU waits for it wherever a unit's host gap "
           "shows";
  return host_us < gpu_us ? "the host runs ahead of the GPU"
                          : "host-bound: the host issues slower than the GPU runs";
}

}  // namespace

std::string TraceSummary::to_string() const {
  std::ostringstream os;
  os << "flatshard-trace: " << ranks << " rank(s), device " << device << ", steps used:";
  for (int st : steps_used) os << ' ' << st;
  os << " (of " << steps_total << (steps_total > static_cast<int>(steps_used.size())
                                        ? "; the first is warm-up)"
                                        : ")")
     << "; timing from "
     << (gpu ? "GPU stream events" : "host events (CPU: collectives are synchronous)") << "\n";
  // The "step" spans are host time: the step on CPU ranks, only its issue on the GPU (the
  // host runs ahead), so it is shown only where it is the step.
  os << "per step (mean over ranks): ";
  if (!gpu) os << ms(step_us) << " ms; ";
  os << "compute " << ms(compute_us)
     << " ms, exposed all-gather " << ms(all_gather_us) << " ms, exposed reduce " << ms(reduce_us)
     << " ms";
  if (gpu) os << ", GPU idle waiting for the host " << ms(host_gap_us) << " ms";
  os << "\n";
  if (gpu)
    os << "host issue time per step " << ms(host_issue_us) << " ms vs GPU time per step "
       << ms(gpu_span_us) << " ms (" << host_vs_gpu(host_issue_us, gpu_span_us) << ")\n";
  const std::vector<std::string> header = {"unit",   "fwd ms", "bwd ms",  "AG fwd ms", "AG bwd ms",
                                           "RS ms",  "host gap ms", "exposed ms", "AG/step", "AG size"};
  TextTable table(header);
  for (const auto& u : units) {
    char n[32];
    std::snprintf(n, sizeof n, "%.1f", u.all_gathers);
    table.add_row({u.unit, ms(u.forward_us), ms(u.backward_us), ms(u.all_gather_forward_us),
                   ms(u.all_gather_backward_us), ms(u.reduce_us), gpu ? ms(u.host_gap_us) : "-",
                   ms(u.exposed()), n, u.gathered_bytes ? format_bytes(u.gathered_bytes) : "-"});
  }
  os << table;
  os << "host time of flatshard's hooks per unit per step, by unit kind (" 
     << (gpu ? "issue time" : "CPU: collectives run inside all_gather / reduce")
     << "; a prefetch counts for the unit whose hook issued it):\n";
  TextTable kinds({"kind", "units", "median us", "max us", "pre_forward", "all_gather",
                   "reshard", "pre_backward", "reduce"});
  auto us = [](double v) {
    char b[32];
    std::snprintf(b, sizeof b, "%.1f", v);
    return std::string(b);
  };
  for (const auto& k : host_by_kind) {
    auto phase = [&](const char* c) {
      const auto it = k.by_phase_us.find(c);
      return us(it == k.by_phase_us.end() ? 0.0 : it->second);
    };
    kinds.add_row({k.kind.empty() ? "-" : k.kind, std::to_string(k.units), us(k.median_us),
                   us(k.max_us), phase(tf::cat::kPreForward), phase(tf::cat::kAllGather),
                   phase(tf::cat::kReshard), phase(tf::cat::kPreBackward),
                   phase(tf::cat::kReduce)});
  }
  os << kinds;
  if (gpu) {
    os << "largest GPU idle gaps:\n";
    if (largest_gaps.empty()) os << "  none\n";
    for (const auto& g : largest_gaps)
      os << "  rank " << g.rank << " step " << g.step << " " << g.unit << " (" << g.phase
         << "): " << ms(g.us) << " ms waiting for "
         << (g.cause == "host" ? "the host" : "its " + g.cause) << "\n";
  }
  if (offload_step_us > 0 || offload_wait_us > 0) {
    // Note [Offload step in backward]: the CPU steps overlap the device work only as far as
    // they keep up with it; per unit, the step against the unit's backward says which side
    // is slower.
    std::vector<double> per_unit;
    double bwd = 0;
    for (const auto& u : units)
      if (u.offload_step_us > 0) {
        per_unit.push_back(u.offload_step_us);
        bwd += u.backward_us;
      }
    std::sort(per_unit.begin(), per_unit.end());
    os << "CPU optimizer track (offloaded units stepped by flatshard), per step: CPU steps "
       << ms(offload_step_us) << " ms over " << per_unit.size() << " units (median "
       << (per_unit.empty() ? 0.0 : per_unit[per_unit.size() / 2]) / 1000.0 << " ms, max "
       << (per_unit.empty() ? 0.0 : per_unit.back()) / 1000.0
       << " ms), waiting for gradients " << ms(offload_wait_us) << " ms; those units' "
       << (gpu ? "backward " : "backward (host) ") << ms(bwd) << " ms\n";
  }
  os << "top offenders (exposed time per step):\n";
  if (offenders.empty()) os << "  none: no exposed communication\n";
  for (size_t k = 0; k < offenders.size(); ++k) {
    const UnitCost& u = units[offenders[k]];
    os << "  " << k + 1 << ". " << u.unit << "  " << ms(u.exposed()) << " ms (AG fwd "
       << ms(u.all_gather_forward_us) << ", AG bwd " << ms(u.all_gather_backward_us) << ", RS "
       << ms(u.reduce_us);
    if (gpu) os << ", host gap " << ms(u.host_gap_us);
    os << "): " << u.advice << "\n";
  }
  return os.str();
}

}  // namespace flatshard
