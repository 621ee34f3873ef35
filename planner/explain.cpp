// flatshard/planner/explain.cpp — see explain.h. A unit's settings come from resolve_unit()
// (fsdp/resolve.h), the one resolver fully_shard() builds units with; the byte and collective
// rules here mirror the collective plans (flat_param/plans.cpp) and Unit (unit.cpp),
// and tests/explain_test.cpp (diagnostics_test) compares the result with the runtime's counters
// so they cannot drift apart silently.
#include "planner/explain.h"

#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iomanip>
#include <map>
#include <numeric>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "flat_param/collective_plan.h"
#include "flat_param/layout.h"
#include "flat_param/quantized_gather.h"  // quantized_wire_buffer_bytes
#include "fsdp/resolve.h"
#include "support/dtype_name.h"
#include "support/format.h"
#include "support/input_file.h"
#include "wrap_policies/policy.h"

namespace flatshard {

namespace {

// Thresholds of the warnings. docs/design.md's measurements: an all-gather of 1 MiB takes about
// as long as one of 16 MiB (~50 us of latency), so units below 1 MiB pay latency, not bandwidth.
constexpr int64_t kTinyUnitBytes = int64_t{1} << 20;
constexpr double kDominantUnitShare = 0.5;  // one unit holding more than this of the model
constexpr double kRootShare = 0.10;         // the root unit holding more than this
constexpr double kPaddingShare = 0.05;      // padding above this share of all elements

int64_t elem_size(c10::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

std::string parent_path(const std::string& param_name) {
  const auto dot = param_name.rfind('.');
  return dot == std::string::npos ? std::string("<model>") : param_name.substr(0, dot);
}

std::string percent(double share) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(share < 0.1 ? 1 : 0) << share * 100 << "%";
  return os.str();
}

std::string join(const std::vector<std::string>& v, size_t max_items) {
  std::string s;
  for (size_t i = 0; i < v.size() && i < max_items; ++i) s += (i ? "," : "") + v[i];
  if (v.size() > max_items) s += ",+" + std::to_string(v.size() - max_items);
  return s;
}

std::string strategy_text(const UnitExplanation& u) {
  std::string s = to_string(u.strategy);
  if (u.strategy == ShardingStrategy::kFullShard && !u.reshard_after_forward) s += " keep";
  if (u.recompute) s += " recompute";
  if (u.frozen) s += " frozen";  // Note [Frozen parameters]: no reduction
  if (u.offload > 0) s += " offload" + std::to_string(u.offload);  // Note [CPU offload]
  return s;
}

std::string collectives_text(const UnitCounters& c) {
  if (c.all_reduces) return "AR " + std::to_string(c.all_reduces) + (c.replicate_bytes ? "x2" : "");
  if (!c.forward_all_gathers && !c.reduce_scatters) return "-";
  return "AG " + std::to_string(c.forward_all_gathers) + "+" +
         std::to_string(c.backward_all_gathers) + ", RS " + std::to_string(c.reduce_scatters) +
         (c.replicate_all_reduces ? ", rAR " + std::to_string(c.replicate_all_reduces) : "") +
         (c.gather_all_reduces ? ", amax AR " + std::to_string(c.gather_all_reduces) : "");
}

// The most trainable elements one rank's shard holds (shard r is [r*S, (r+1)*S)), in
// O(params log params) whatever the world size: looping over the ranks made explain linear in
// --world (51 s at 10^9 ranks). The parameters' ranges are disjoint and sorted, so a shard
// that contains no end of a trainable range lies inside one range (S trainable elements) or
// in a gap (none); only the shards holding an end need counting, by prefix sums.
int64_t max_trainable_in_shard(const FlatLayout& layout, const std::vector<bool>& trainable,
                               bool sharded) {
  const int64_t S = sharded ? layout.shard_numel : layout.padded_numel;
  if (S <= 0) return 0;
  std::vector<int64_t> begins, ends, before;  // trainable ranges; before[i]: numel of [0, i)
  for (size_t k = 0; k < trainable.size(); ++k) {
    if (!trainable[k] || layout.numels[k] == 0) continue;
    before.push_back((before.empty() ? 0 : before.back()) +
                     (ends.empty() ? 0 : ends.back() - begins.back()));
    begins.push_back(layout.offsets[k]);
    ends.push_back(layout.offsets[k] + layout.numels[k]);
  }
  if (begins.empty()) return 0;
  // Trainable elements in [0, x).
  auto upto = [&](int64_t x) {
    const size_t i = static_cast<size_t>(
        std::upper_bound(begins.begin(), begins.end(), x) - begins.begin());
    if (i == 0) return int64_t{0};
    return before[i - 1] + std::min(x, ends[i - 1]) - begins[i - 1];
  };
  int64_t best = 0;
  auto shard_at = [&](int64_t element) {  // the shard holding `element`
    const int64_t lo = (element / S) * S;
    best = std::max(best, upto(lo + S) - upto(lo));
  };
  for (size_t i = 0; i < begins.size() && best < S; ++i) {
    shard_at(begins[i]);
    shard_at(ends[i] - 1);
    // A whole shard inside the range: the first shard starting at or after its begin.
    const int64_t first = (begins[i] + S - 1) / S * S;
    if (first + S <= ends[i]) best = S;
  }
  return best;
}

// `replicate_bytes`: what one reduction sends across the replicas (0 without HSDP).
UnitCounters expected_counters(const UnitExplanation& u, int64_t replicate_bytes) {
  UnitCounters c;
  if (u.padded_numel == 0) return c;  // Unit::has_collectives() is false
  c.replicate_bytes = replicate_bytes;
  if (u.strategy == ShardingStrategy::kNoShard && u.frozen) {
    c.replicate_bytes = 0;
    return c;
  }
  if (u.strategy == ShardingStrategy::kNoShard) {
    c.all_reduces = 1;
    c.bytes = u.reduce_bytes + replicate_bytes;
    return c;
  }
  c.forward_all_gathers = 1;
  c.backward_all_gathers = u.reshard_after_forward && u.backward_reads_params ? 1 : 0;
  c.gather_all_reduces = (c.forward_all_gathers + c.backward_all_gathers) * u.gather_all_reduces;
  if (u.frozen) {  // Note [Frozen parameters]: no gradient, no reduction
    c.replicate_bytes = 0;
    c.bytes = (c.forward_all_gathers + c.backward_all_gathers) * u.all_gather_bytes;
    return c;
  }
  c.reduce_scatters = 1;
  c.replicate_all_reduces = replicate_bytes > 0 ? 1 : 0;
  c.bytes = (c.forward_all_gathers + c.backward_all_gathers) * u.all_gather_bytes + u.reduce_bytes +
            replicate_bytes;
  return c;
}

// Collectives one rank issues per step for these counters: HSDP's two-hop all-reduce of a
// NO_SHARD unit is two collectives.
int64_t collective_count(const UnitCounters& c) {
  return c.forward_all_gathers + c.backward_all_gathers + c.gather_all_reduces + c.reduce_scatters +
         c.all_reduces * (c.replicate_bytes > 0 ? 2 : 1) + c.replicate_all_reduces;
}

// Each module's type as a policy writes it (policy_type_name): by path for the modules with
// children (the only ones that enclose a unit), and how many modules, leaves included, have each
// type. Iterative, so the tree's depth cannot overflow the stack; leaves get no path string (a
// map of every path was most of the fragmentation advice on 655,000 modules, issue 49).
struct ModuleTypes {
  std::unordered_map<std::string, std::string> of_parent;  // path -> type
  std::unordered_map<std::string, int64_t> count;          // type -> modules of it
};
ModuleTypes module_types(const torch::nn::Module& model) {
  ModuleTypes types;
  std::unordered_set<std::string> seen;  // paths, as a guard (each path is counted once)
  std::vector<std::pair<const torch::nn::Module*, std::string>> stack{{&model, ""}};
  while (!stack.empty()) {
    auto [m, path] = std::move(stack.back());
    stack.pop_back();
    const auto children = m->named_children();
    if (!children.is_empty() && !seen.insert(path).second) continue;
    std::string type = policy_type_name(m->name());
    ++types.count[type];
    if (children.is_empty()) continue;
    for (const auto& kv : children)
      stack.emplace_back(kv.value().get(), path.empty() ? kv.key() : path + "." + kv.key());
    types.of_parent.emplace(std::move(path), std::move(type));
  }
  return types;
}

std::string parent_of(const std::string& path) {
  const auto dot = path.rfind('.');
  return dot == std::string::npos ? std::string() : path.substr(0, dot);
}

// What to do about units below 1 MiB (`tiny`: gathered bytes, unit), in the model's own names
// and the caller's language (ExplainOptions::advice): one unit per the type that encloses the
// most tiny units (not the root, not a container; on a tie the one with fewer modules, the
// outer), and every=k with k the units needed to reach 1 MiB but never more than the most tiny
// units under one parent (every groups siblings: a larger k groups nothing more).
std::string advice_for_fragmentation(
    const Explanation& e, const torch::nn::Module& model,
    const std::vector<std::pair<int64_t, const UnitExplanation*>>& tiny) {
  const bool cpp = e.cost.advice == ExplainOptions::Advice::kCpp;
  const auto types = module_types(model);
  std::map<std::string, int64_t> encloses;     // type -> tiny units inside a module of it
  std::map<std::string, int64_t> per_parent;   // parent path -> tiny units directly under it
  for (const auto& t : tiny) {
    const UnitExplanation& u = *t.second;
    if (u.is_root || u.modules.empty()) continue;
    const std::string& first = u.modules.front();
    ++per_parent[parent_of(first)];
    std::set<std::string> seen;
    for (std::string p = parent_of(first); !p.empty(); p = parent_of(p)) {
      auto it = types.of_parent.find(p);
      if (it == types.of_parent.end()) continue;
      const std::string& type = it->second;
      if (type == "ModuleList" || type == "Sequential" || type == "ModuleDict") continue;
      if (seen.insert(type).second) ++encloses[type];
    }
  }
  std::map<std::string, int64_t> instances;
  for (const auto& [type, n] : encloses) instances[type] = types.count.at(type);
  std::string layer;
  for (const auto& [type, n] : encloses) {
    if (n < 2) continue;  // one tiny unit per module of it: no grouping gained
    if (layer.empty() || n > encloses[layer] ||
        (n == encloses[layer] && instances[type] < instances[layer]))
      layer = type;
  }
  int64_t siblings = 0;
  for (const auto& [parent, n] : per_parent) siblings = std::max(siblings, n);

  const int64_t median = tiny[tiny.size() / 2].first;
  const int64_t needed = std::max<int64_t>(
      2, (kTinyUnitBytes + median - 1) / std::max<int64_t>(median, 1));
  std::vector<std::string> ways;
  if (!layer.empty()) {
    const std::string name = printable_escape(layer);
    ways.push_back("one unit per " + name + " (" +
                   (cpp ? "by_type(\"" + name + "\")" : "--policy type=" + name) + ")");
  }
  if (siblings >= 2) {
    const int64_t k = std::min(needed, siblings);
    const std::string form = cpp ? "every(" + std::to_string(k) + ", rule)"
                                 : "every=" + std::to_string(k) + ",<terms>";
    ways.push_back("group the matches " + std::to_string(k) + " at a time (" + form + ")" +
                   (k == needed ? ", which reaches 1 MiB"
                                : ": all " + std::to_string(siblings) +
                                      " tiny siblings under one parent; 1 MiB would need " +
                                      std::to_string(needed)));
  }
  if (ways.empty()) {
    const int64_t numel =
        kTinyUnitBytes / elem_size(e.options.mixed_precision.param_dtype);
    ways.push_back("match larger modules (" +
                   (cpp ? "by_size(" + std::to_string(numel) + ")"
                        : "--policy size>=" + std::to_string(numel)) +
                   ")");
  }
  std::string out = "; use fewer, larger units: " + ways[0];
  for (size_t i = 1; i < ways.size(); ++i) out += ", or " + ways[i];
  return out;
}

// The plan pays collective latency instead of bandwidth: many collectives per step against the
// reference step, or units below 1 MiB (each collective costs ~latency whatever its size).
void warn_fragmentation(Explanation& e, const torch::nn::Module& model) {
  const ExplainOptions& c = e.cost;
  const double latency_ms = e.collective_latency_ms();
  const double share = latency_ms / std::max(c.reference_step_ms, 1e-9);
  std::vector<std::pair<int64_t, const UnitExplanation*>> tiny;  // gathered bytes, unit
  int64_t communicating = 0;  // units that issue collectives at all
  for (const auto& u : e.units) {
    if (u.padded_numel == 0) continue;
    ++communicating;
    const int64_t bytes = u.padded_numel * elem_size(e.options.mixed_precision.param_dtype);
    if (bytes < kTinyUnitBytes) tiny.emplace_back(bytes, &u);
  }
  const bool latency_bound = share > c.latency_share;
  if (!latency_bound && tiny.empty()) return;
  std::string msg = "fragmented plan: ";
  if (latency_bound) {
    msg += std::to_string(e.collectives_per_step) + " collectives per step x ~" +
           format_fixed(c.collective_latency_us, 1) + " us latency = " +
           format_fixed(latency_ms, 1) + " ms, " + percent(share) + " of a " +
           format_fixed(c.reference_step_ms, 1) +
           " ms reference step (explain has no compute model; set your step time with "
           "--reference-step-ms / ExplainOptions::reference_step_ms)";
  }
  if (!tiny.empty()) {
    std::stable_sort(tiny.begin(), tiny.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    const int64_t median = tiny[tiny.size() / 2].first;
    std::vector<std::string> names;
    for (const auto& t : tiny) names.push_back(t.second->name);
    msg += std::string(latency_bound ? "; " : "") + std::to_string(tiny.size()) + " of " +
           std::to_string(communicating) + " units hold less than 1 MiB each (median " +
           format_bytes(median) + ": " + join(names, 3) +
           "), and a collective costs ~" + format_fixed(c.collective_latency_us, 1) +
           " us whatever its size, so they pay latency, not bandwidth";
  }
  if (!tiny.empty()) {
    msg += advice_for_fragmentation(e, model, tiny);
  } else {
    const bool cpp = e.cost.advice == ExplainOptions::Advice::kCpp;
    msg += std::string("; use fewer units: group matches with ") +
           (cpp ? "every(2, rule)" : "every=2") +
           " (it halves the collectives), or give explain your measured step time";
  }
  e.warnings.push_back(msg);
}

// NO_SHARD units whose replicated state (fp32 master + gradient + AdamW's two moments, on every
// rank) is a noticeable share of per-rank memory. `shard_numel_if_sharded[i]`: unit i's master
// shard were it sharded over the shard group (its own shard_numel for sharded units).
void warn_replication(Explanation& e, const std::vector<int64_t>& shard_numel_if_sharded) {
  constexpr int64_t kStateCopies = 3;  // master, exp_avg, exp_avg_sq (fp32); and the gradient
  std::vector<std::pair<int64_t, const UnitExplanation*>> replicated;  // state bytes, unit
  int64_t total = 0, saved = 0;
  for (size_t i = 0; i < e.units.size(); ++i) {
    const auto& u = e.units[i];
    if (u.strategy != ShardingStrategy::kNoShard || u.padded_numel == 0) continue;
    const int64_t state = kStateCopies * u.master_bytes + u.master_grad_bytes;
    const int64_t numel = u.master_bytes / elem_size(c10::kFloat);
    const int64_t if_sharded = (numel > 0 ? state / numel : 0) * shard_numel_if_sharded[i];
    if (state <= if_sharded) continue;  // one rank per shard group: sharding saves nothing
    replicated.emplace_back(state, &u);
    total += state;
    saved += state - if_sharded;
  }
  const int64_t per_rank = e.memory.total() + e.memory.adamw_state_bytes;
  if (replicated.empty() || per_rank <= 0) return;
  const double share = static_cast<double>(total) / static_cast<double>(per_rank);
  if (share <= e.cost.replicated_share) return;
  std::stable_sort(replicated.begin(), replicated.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::string> named;
  for (const auto& r : replicated) named.push_back(r.second->name + " " + format_bytes(r.first));
  e.warnings.push_back(
      std::to_string(replicated.size()) + " NO_SHARD unit(s) replicate " + format_bytes(total) +
      " of fp32 master + gradient + AdamW state on every rank (" + join(named, 3) + "), " +
      percent(share) + " of the predicted " + format_bytes(per_rank) +
      " per rank (model state + AdamW state, activations not included); sharding them over " +
      std::to_string(e.mesh.shard()) + " ranks saves " + format_bytes(saved) +
      " per rank: shard these units (drop their noshard: rule, or use grad_op: to keep them "
      "gathered through the step)");
}

// `root_owners`: the modules owning the root unit's parameters, with their numel;
// `shard_numel_if_sharded`: see warn_replication.
void add_warnings(Explanation& e, const torch::nn::Module& model, const Plan& plan,
                  const std::vector<std::pair<std::string, int64_t>>& root_owners,
                  const std::vector<int64_t>& shard_numel_if_sharded) {
  const auto& units = e.units;
  const double total = static_cast<double>(std::max<int64_t>(e.total_numel, 1));

  const std::string unmatched = plan.unmatched_warning();
  if (!unmatched.empty()) e.warnings.push_back(unmatched);
  e.warnings.insert(e.warnings.end(), plan.warnings.begin(), plan.warnings.end());
  warn_fragmentation(e, model);
  warn_replication(e, shard_numel_if_sharded);
  // One unit holding most of the model.
  for (const auto& u : units) {
    const double share = u.numel / total;
    if (units.size() > 1 && share > kDominantUnitShare) {
      e.warnings.push_back("unit '" + u.name + "' holds " + percent(share) +
                           " of the parameters: its all-gather cannot hide behind other units' "
                           "compute and it alone sets the memory peak; split it into smaller "
                           "units");
    }
  }
  // Parameters left to the root.
  if (!units.empty() && units[0].is_root && units.size() > 1) {
    const auto& r = units[0];
    const double share = r.numel / total;
    if (share > kRootShare && share <= kDominantUnitShare) {
      std::vector<std::pair<std::string, int64_t>> owners = root_owners;
      std::stable_sort(owners.begin(), owners.end(),
                       [](const auto& a, const auto& b) { return a.second > b.second; });
      std::string biggest, globs;
      for (size_t i = 0; i < owners.size() && i < 2; ++i) {
        biggest += (i ? ", " : "") + owners[i].first + " " +
                   percent(owners[i].second / total);
        globs += (i ? "|" : "") + owners[i].first;
      }
      const std::string what =
          r.reshard_after_forward
              ? "are gathered for the whole forward (the root encloses every unit)"
              : "stay gathered from the start of forward to the end of backward (the root keeps "
                "its parameters by default), and its flat gradient lives through all of backward";
      e.warnings.push_back("the root unit owns " + percent(share) + " of the parameters (" +
                           biggest + "); they " + what +
                           "; give the largest modules units of their own, e.g. add "
                           "\"path=" + globs + "\" to the policy");
    }
  }
  // Padding.
  if (static_cast<double>(e.total_padding) > kPaddingShare * total) {
    e.warnings.push_back("padding is " + percent(e.total_padding / total) +
                         " of the parameters (each unit pads to a multiple of world_size * align "
                         "= " +
                         std::to_string(e.mesh.shard() * e.options.align) +
                         " elements): many small units at this world size; use larger units");
  }
  if (!e.empty_units.empty()) {
    e.warnings.push_back("the policy matched " + std::to_string(e.empty_units.size()) +
                         " module(s) that own no parameter of their own (" +
                         join(e.empty_units, 3) + "); they form no unit");
  }
  // Prefetch depth against a memory limit.
  if (e.memory_limit_bytes && e.memory.total() > *e.memory_limit_bytes) {
    const int fwd = e.options.forward_prefetch, bwd = e.options.backward_prefetch;
    std::string msg = "predicted model-state memory " + format_bytes(e.memory.total()) +
                      " exceeds the limit " + format_bytes(*e.memory_limit_bytes) +
                      " with forward_prefetch=" + std::to_string(fwd) +
                      ", backward_prefetch=" + std::to_string(bwd) + "; ";
    if (e.fitting_prefetch && *e.fitting_prefetch >= 0) {
      msg += "prefetch depth " + std::to_string(*e.fitting_prefetch) + " fits";
    } else {
      msg += "no prefetch depth fits (persistent state alone is " +
             format_bytes(e.memory.persistent_bytes) + "): shard over more ranks, use smaller units" +
             (e.options.mixed_precision.param_dtype == c10::kFloat ? " or bf16 param_dtype" : "");
    }
    e.warnings.push_back(msg);
  }
}

}  // namespace

MemoryEstimate estimate_memory(const std::vector<UnitExplanation>& units, int forward_prefetch,
                               int backward_prefetch) {
  // The rules are the header's, evaluated in O(n + nesting) rather than by testing every pair
  // of units for every unit (which took 39 s at 32k layers): prefix sums over plan order give
  // "every kept unit before k" and "the prefetch window", and each unit's enclosing units are
  // found by looking up the dotted prefixes of its module paths. Each enclosing unit not already
  // in a summed range is added on its own.
  MemoryEstimate m;
  const int n = static_cast<int>(units.size());
  for (const auto& u : units) {
    // master + its gradient (a frozen unit has none); AdamW state for the trainable part only
    const int64_t state = u.master_bytes + u.master_grad_bytes;
    const int64_t adamw =
        2 * (u.trainable_master_bytes < 0 ? u.master_bytes : u.trainable_master_bytes);
    if (u.offload > 0) {  // Note [CPU offload]: on the host; level 1 keeps a compute shard
      m.host_bytes += state + adamw;
      m.persistent_bytes += u.resident_bytes;
    } else {
      m.persistent_bytes += state + u.resident_bytes;  // Note [Kept compute shard]
      m.adamw_state_bytes += adamw;
    }
    if (u.strategy == ShardingStrategy::kNoShard) m.persistent_bytes += u.gathered_bytes;
    if (u.wire_buffer_bytes > m.wire_bytes) {
      m.wire_bytes = u.wire_buffer_bytes;
      m.wire_unit = u.name;
    }
  }
  if (n == 0) return m;
  auto transient = [&](int j) {
    return units[j].strategy == ShardingStrategy::kNoShard ? int64_t{0} : units[j].gathered_bytes;
  };
  auto kept = [&](int j) {
    return units[j].strategy != ShardingStrategy::kNoShard && !units[j].reshard_after_forward;
  };
  int root = -1;
  for (int j = 0; j < n; ++j)
    if (units[j].is_root) root = j;
  // all[k] / kept_sum[k]: transient bytes of units [0, k) / of the kept ones among them.
  std::vector<int64_t> all(n + 1, 0), kept_sum(n + 1, 0);
  for (int j = 0; j < n; ++j) {
    all[j + 1] = all[j] + transient(j);
    kept_sum[j + 1] = kept_sum[j] + (kept(j) ? transient(j) : 0);
  }
  // enclosing[k]: the non-root units j with encloses(j, k) (the root encloses every other unit
  // and is handled apart). A module path of j is a dotted prefix of one of k's.
  std::unordered_map<std::string, std::vector<int>> owners;
  for (int j = 0; j < n; ++j)
    if (!units[j].is_root)
      for (const auto& p : units[j].modules) owners[p].push_back(j);
  std::vector<std::vector<int>> enclosing(n);
  for (int k = 0; k < n; ++k) {
    if (units[k].is_root) continue;
    auto& out = enclosing[k];
    for (const auto& inner : units[k].modules)
      for (size_t dot = inner.find('.'); dot != std::string::npos; dot = inner.find('.', dot + 1))
        if (auto it = owners.find(inner.substr(0, dot)); it != owners.end())
          out.insert(out.end(), it->second.begin(), it->second.end());
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    out.erase(std::remove(out.begin(), out.end(), k), out.end());
  }
  auto consider = [&](int64_t bytes, const char* pass, int k) {
    if (bytes > m.peak_transient_bytes) {
      m.peak_transient_bytes = bytes;
      m.peak_at = std::string(pass) + units[k].name;
    }
  };
  // Forward: unit k computing. Gathered: k, every kept unit before k, the units enclosing k
  // that come before it, and the next forward_prefetch units.
  for (int k = 0; k < n; ++k) {
    const int last = static_cast<int>(std::min<int64_t>(n - 1, int64_t{k} + forward_prefetch));
    int64_t b = transient(k) + kept_sum[k] + (all[last + 1] - all[k + 1]);
    if (!units[k].is_root) {
      if (root >= 0 && root < k && !kept(root)) b += transient(root);
      for (int j : enclosing[k])
        if (j < k && !kept(j)) b += transient(j);
    }
    consider(b, "forward of ", k);
  }
  // Backward, reverse order, root last (its backward ends when the last gradient is in).
  // Gathered: k, the root, every kept unit before k, every unit enclosing k, and the
  // backward_prefetch non-root units just before k ([lo, k) without the root).
  int previous = -1;  // the unit reduced just before k: its buffers are still held
  for (int k = n - 1; k >= 0; --k) {
    if (k == root) continue;
    int lo = static_cast<int>(std::max<int64_t>(0, int64_t{k} - backward_prefetch));
    if (root >= lo && root < k) lo = std::max(0, lo - 1);
    auto in_range = [&](int j) { return j < k && j != root && (j >= lo || kept(j)); };
    int64_t b = transient(k) + kept_sum[lo] + (all[k] - all[lo]);
    int64_t grads = units[k].grad_buffer_bytes;
    if (root >= 0) {
      // The sums above counted the root where it is in range; count it exactly once.
      if (root < k && (root >= lo || kept(root))) b -= transient(root);
      b += transient(root);
      grads += units[root].grad_buffer_bytes;
    }
    for (int j : enclosing[k]) {
      if (!in_range(j)) b += transient(j);
      grads += units[j].grad_buffer_bytes;
    }
    b += grads;
    if (previous >= 0) b += units[previous].grad_buffer_bytes;
    consider(b, "backward of ", k);
    previous = k;
  }
  if (root >= 0) {  // every other unit is reduced and resharded by now
    int64_t b = transient(root) + units[root].grad_buffer_bytes;
    if (previous >= 0) b += units[previous].grad_buffer_bytes;
    consider(b, "backward of ", root);
  }
  return m;
}

TpCollectives& TpCollectives::operator+=(const TpCollectives& o) {
  forward_all_reduces += o.forward_all_reduces;
  backward_all_reduces += o.backward_all_reduces;
  forward_all_gathers += o.forward_all_gathers;
  forward_reduce_scatters += o.forward_reduce_scatters;
  backward_all_gathers += o.backward_all_gathers;
  backward_reduce_scatters += o.backward_reduce_scatters;
  grad_all_reduces += o.grad_all_reduces;
  grad_numel += o.grad_numel;
  loss_all_reduces += o.loss_all_reduces;
  loss_numel_per_token += o.loss_numel_per_token;
  forward_numel_per_token += o.forward_numel_per_token;
  backward_numel_per_token += o.backward_numel_per_token;
  return *this;
}

TpCounters TpCollectives::counters(int64_t tokens, c10::ScalarType dtype) const {
  TpCounters c;
  c.forward_all_reduces = forward_all_reduces;
  c.backward_all_reduces = backward_all_reduces;
  c.forward_all_gathers = forward_all_gathers;
  c.forward_reduce_scatters = forward_reduce_scatters;
  c.backward_all_gathers = backward_all_gathers;
  c.backward_reduce_scatters = backward_reduce_scatters;
  c.forward_bytes = forward_numel_per_token * tokens * elem_size(dtype);
  c.backward_bytes = backward_numel_per_token * tokens * elem_size(dtype);
  c.grad_all_reduces = grad_all_reduces;
  c.grad_bytes = grad_numel * elem_size(dtype);
  c.loss_all_reduces = loss_all_reduces;
  c.loss_bytes = loss_numel_per_token * tokens * elem_size(c10::kFloat);
  return c;
}

namespace {

// Tensor parallelism (mesh.tp() > 1): the TP-local shapes of split parameters, and each split
// module's collectives by its weight's name, from the model's TensorParallel or from `tp_plan`.
struct TpLocal {
  std::unordered_map<std::string, std::vector<int64_t>> shapes;
  std::unordered_map<std::string, TpCollectives> by_weight;  // and SP's gradient all-reduces
  int modules = 0;
  bool loss_parallel = false;
};

TpLocal tp_local(const torch::nn::Module& model, const MeshShape& mesh, const TpPlan& tp_plan,
                 const torch::OrderedDict<std::string, at::Tensor>& params) {
  TpLocal out;
  if (mesh.tp() <= 1) return out;
  const TensorParallel* done = find_tensor_parallel(&model);
  std::vector<TpModule> modules, sequence;
  const TpPlan& plan = done != nullptr ? done->plan() : tp_plan;
  if (done != nullptr) {
    TORCH_CHECK(done->tp_size() == mesh.tp(), "explain: the model was parallelized at tp ",
                done->tp_size(), " but the mesh has tp ", mesh.tp());
    modules = done->modules();
  } else {
    TORCH_CHECK(!tp_plan.empty(), "explain: mesh ", mesh.to_string(),
                " has tp > 1 but no tp plan was given; pass the plan parallelize() will get "
                "(a family's: Family::modules().tp_plan)");
    modules = match_tp_plan(model, tp_plan, mesh.tp(),
                            "explain (tp " + std::to_string(mesh.tp()) + ")", &sequence);
  }
  const bool sp = plan.sequence_parallel;
  out.loss_parallel = plan.loss_parallel;
  // Note [Sequence-parallel gradients]: the names parallelize() hooks (or will).
  std::vector<std::string> sp_grads;
  if (sp && done != nullptr) sp_grads = done->sequence_grads();
  if (sp && done == nullptr) {
    std::unordered_set<const void*> seen;
    auto add = [&](const std::string& name) {
      const at::Tensor* p = params.find(name);
      if (p != nullptr && p->defined() && seen.insert(p->unsafeGetTensorImpl()).second)
        sp_grads.push_back(name);
    };
    for (const TpModule& m : sequence)
      for (const auto& kv : params)
        if (kv.key().rfind(m.path + ".", 0) == 0) add(kv.key());
    for (const TpModule& m : modules)
      if (m.style == TpStyle::kRowwise) add(m.path + ".bias");
  }
  for (const std::string& name : sp_grads) {
    const at::Tensor* p = params.find(name);
    if (p == nullptr || !p->requires_grad()) continue;  // frozen: no gradient, no hook call
    out.by_weight[name].grad_all_reduces += 1;
    out.by_weight[name].grad_numel += p->numel();
  }
  for (const TpModule& m : modules) {
    const std::string wname = m.path + ".weight", bname = m.path + ".bias";
    const at::Tensor* wp = params.find(wname);
    TORCH_INTERNAL_ASSERT(wp != nullptr, "explain: tp module '", m.path, "' has no weight");
    const at::Tensor& w = *wp;
    TpCollectives& c = out.by_weight[wname];
    if (m.style == TpStyle::kVocab) {
      // A vocabulary-parallel embedding all-reduces its output [tokens, d] (parallelize refuses
      // it under sequence parallelism); its backward is local.
      c.forward_all_reduces = 1;
      c.forward_numel_per_token = w.size(1);
    } else if (m.style == TpStyle::kRowwise) {
      (sp ? c.forward_reduce_scatters : c.forward_all_reduces) = 1;
      c.forward_numel_per_token = w.size(0);
      if (sp) c.backward_all_gathers = 1, c.backward_numel_per_token = w.size(0);
    } else {
      if (m.replicated_groups > 0) {
        // A module kept whole (Note [Replicated kv heads]) all-reduces its output's gradient
        // (parallelize refuses it under sequence parallelism).
        c.backward_all_reduces = 1;
        c.backward_numel_per_token = w.size(0);
      } else {
        (sp ? c.backward_reduce_scatters : c.backward_all_reduces) = 1;
        c.backward_numel_per_token = w.size(1);
        if (sp) c.forward_all_gathers = 1, c.forward_numel_per_token = w.size(1);
      }
    }
    ++out.modules;
    if (done != nullptr) continue;  // its shapes are the local ones already
    out.shapes[wname] = tp_local_shape(m, false, w.sizes().vec(), mesh.tp());
    const at::Tensor* b = params.find(bname);
    if (b != nullptr && b->defined())
      out.shapes[bname] = tp_local_shape(m, true, b->sizes().vec(), mesh.tp());
  }
  return out;
}

// The largest prefetch depth d <= the configured one whose memory fits `limit`, or -1. Memory
// never falls as d grows (each point's gathered set only gains units), so a binary search finds
// it in O(n log depth); trying every depth downwards was O(n * depth).
int fitting_prefetch(const std::vector<UnitExplanation>& units, const ShardingOptions& options,
                     int64_t limit) {
  auto fits = [&](int d) {
    return estimate_memory(units, std::min(d, options.forward_prefetch),
                           std::min(d, options.backward_prefetch))
               .total() <= limit;
  };
  const int max_depth = std::max(options.forward_prefetch, options.backward_prefetch);
  if (fits(max_depth)) return max_depth;
  if (!fits(0)) return -1;
  int lo = 0, hi = max_depth;  // fits(lo), !fits(hi)
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

}  // namespace

Explanation explain(const torch::nn::Module& model, const Plan& plan, const MeshShape& mesh,
                    const ShardingOptions& options, std::optional<int64_t> memory_limit_bytes,
                    const ExplainOptions& cost, const TpPlan& tp_plan) {
  const int world_size = mesh.shard(), replicate_size = mesh.replicate();
  TORCH_CHECK(world_size >= 1 && replicate_size >= 1 && mesh.tp() >= 1,
              "explain: mesh sizes must be >= 1, got shard ", world_size, ", replicate ",
              replicate_size, ", tp ", mesh.tp());
  TORCH_CHECK(options.forward_prefetch >= 0 && options.backward_prefetch >= 0,
              "explain: prefetch depths must be >= 0 (forward_prefetch=", options.forward_prefetch,
              ", backward_prefetch=", options.backward_prefetch, ")");
  TORCH_CHECK(cost.collective_latency_us >= 0 && cost.reference_step_ms > 0,
              "explain: collective_latency_us must be >= 0 and reference_step_ms > 0, got ",
              cost.collective_latency_us, " and ", cost.reference_step_ms);
  check_recompute_plan(plan);  // the same rejection fully_shard makes (fsdp/resolve.h)
  Explanation e;
  e.cost = cost;
  e.mesh = mesh;
  e.options = options;
  e.memory_limit_bytes = memory_limit_bytes;
  e.matched_modules = plan.matched_modules;
  e.empty_units = plan.empty_units;
  e.tied = plan.tied;

  // Looked up in torch's own dict (its index is a hash map): a second map of every name was
  // ~10% of explaining 524,288 parameters (issue 49).
  const auto params = model.named_parameters(/*recurse=*/true);
  const TpLocal tp = tp_local(model, mesh, tp_plan, params);
  e.tp_modules += tp.modules;
  const auto& tp_shapes = tp.shapes;
  const auto& tp_by_weight = tp.by_weight;
  std::vector<std::pair<std::string, int64_t>> root_owners;
  std::unordered_map<std::string, size_t> root_owner_index;  // owner -> its root_owners entry
  std::vector<int64_t> shard_numel_if_sharded;  // for the replication warning
  bool any_trainable_before = false;            // a unit before this one trains

  for (size_t i = 0; i < plan.units.size(); ++i) {
    const UnitSpec& spec = plan.units[i];
    UnitExplanation u;
    u.index = static_cast<int>(i);
    u.name = spec.name;
    u.is_root = spec.is_root;
    // The settings fully_shard() builds this unit with (fsdp/resolve.h).
    const ResolvedUnit settings = resolve_unit(spec, options, world_size);
    u.strategy = settings.strategy;
    u.reshard_after_forward = settings.reshard_after_forward;
    u.recompute = settings.recompute;
    u.offload = settings.flat.offload;
    const c10::ScalarType param_dtype = settings.flat.param_dtype;
    const c10::ScalarType reduce_dtype = settings.flat.reduce_dtype;
    std::vector<std::vector<int64_t>> shapes;
    std::vector<bool> trainable;
    shapes.reserve(spec.param_names.size());
    trainable.reserve(spec.param_names.size());
    for (const auto& name : spec.param_names) {
      const at::Tensor* param = params.find(name);
      TORCH_CHECK(param != nullptr, "explain: unit '", spec.name, "' names parameter '", name,
                  "', which the model does not have; was the plan made for another model?");
      auto local = tp_shapes.find(name);
      shapes.push_back(local != tp_shapes.end() ? local->second : param->sizes().vec());
      const int64_t numel = std::accumulate(shapes.back().begin(), shapes.back().end(), int64_t{1},
                                            std::multiplies<int64_t>());
      trainable.push_back(param->requires_grad());
      auto split = tp_by_weight.find(name);
      if (split != tp_by_weight.end()) u.tp += split->second;
      if (spec.is_root) {
        const std::string owner = parent_path(name);
        // A map, not a scan of the owners so far: the root of `--policy none` owns every module.
        auto [o, fresh] = root_owner_index.emplace(owner, root_owners.size());
        if (fresh) {
          u.modules.push_back(owner);
          root_owners.emplace_back(owner, numel);
        } else {
          root_owners[o->second].second += numel;
        }
      }
    }
    if (!spec.is_root) u.modules = spec.module_paths;
    const bool sharded = settings.flat.sharded;
    const FlatLayout layout =
        FlatLayout::make(shapes, settings.layout_world_size, settings.flat.align);
    u.num_params = static_cast<int64_t>(shapes.size());
    u.numel = layout.used_numel;
    u.padded_numel = layout.padded_numel;
    u.shard_numel = layout.shard_numel;
    // The plans' own closed forms (flat_param/collective_plan.h): equal to the runtime's bytes.
    u.all_gather_bytes = all_gather_bytes(settings.flat, layout);
    u.gather_all_reduces = gather_all_reduces(settings.flat);
    u.reduce_bytes = reduce_bytes(settings.flat, layout);
    // A replicated fp32 unit computes on its master directly, unless the master is offloaded.
    u.gathered_bytes =
        full_aliases_master(settings.flat) ? 0 : layout.padded_numel * elem_size(param_dtype);
    u.grad_buffer_bytes = layout.padded_numel * elem_size(param_dtype) +
                          (reduce_dtype != param_dtype ? u.reduce_bytes : 0);
    u.master_bytes = layout.shard_numel * elem_size(c10::kFloat);
    u.resident_bytes = kept_shard_bytes(settings.flat, layout);
    u.wire_buffer_bytes = quantized_wire_buffer_bytes(settings.flat, layout);
    int64_t trainable_numel = 0, trainable_shard_numel = 0;
    for (size_t k = 0; k < shapes.size(); ++k)
      if (trainable[k]) trainable_numel += layout.numels[k];
    if (trainable_numel > 0)
      trainable_shard_numel = max_trainable_in_shard(layout, trainable, sharded);
    u.frozen = !shapes.empty() && trainable_numel == 0;
    u.trainable_master_bytes = trainable_shard_numel * elem_size(c10::kFloat);
    u.master_grad_bytes =
        u.frozen ? 0 : layout.shard_numel * elem_size(settings.flat.grad_dtype());
    if (u.frozen) u.grad_buffer_bytes = 0;
    u.backward_reads_params = !u.frozen || any_trainable_before;
    any_trainable_before = any_trainable_before || !u.frozen;
    u.per_step = expected_counters(u, replicate_bytes(settings.flat, layout, replicate_size > 1));
    shard_numel_if_sharded.push_back(
        sharded ? layout.shard_numel
                : FlatLayout::make(shapes, world_size, settings.flat.align).shard_numel);
    e.collectives_per_step += collective_count(u.per_step);
    if (u.recompute) {  // the recomputed forward all-reduces again
      u.tp.forward_all_reduces *= 2;
      u.tp.forward_all_gathers *= 2;
      u.tp.forward_reduce_scatters *= 2;
      u.tp.forward_numel_per_token *= 2;
    }
    e.per_step += u.per_step;
    e.tp += u.tp;
    e.total_numel += u.numel;
    e.total_padding += u.padding();
    e.units.push_back(std::move(u));
  }
  if (tp.loss_parallel) {  // vocab_parallel_cross_entropy: max, sum of exp, target logit
    e.tp.loss_all_reduces += 3;
    e.tp.loss_numel_per_token += 3;
  }

  e.memory = estimate_memory(e.units, options.forward_prefetch, options.backward_prefetch);
  if (memory_limit_bytes)
    e.fitting_prefetch = fitting_prefetch(e.units, options, *memory_limit_bytes);
  add_warnings(e, model, plan, root_owners, shard_numel_if_sharded);
  return e;
}

std::string Explanation::to_string() const {
  const int world_size = mesh.shard(), replicate_size = mesh.replicate();
  const auto& mp = options.mixed_precision;
  std::ostringstream os;
  os << "world " << world_size;
  if (replicate_size > 1)
    os << " per shard group x " << replicate_size << " replicas (HSDP: " << world_size * replicate_size
       << " ranks)";
  os << ", default strategy " << flatshard::to_string(options.strategy)
     << ", param " << dtype_name(mp.param_dtype) << ", reduce "
     << dtype_name(mp.reduce_dtype.value_or(mp.param_dtype));
  if (mp.gather_dtype != GatherDtype::kParam)
    os << ", gather " << gather_dtype_name(mp.gather_dtype);
  os << ", align " << options.align
     << ", prefetch fwd " << options.forward_prefetch << " / bwd " << options.backward_prefetch
     << "\n";

  using Align = TextTable::Align;
  const Align l = Align::kLeft, r = Align::kRight;
  TextTable table({"#", "unit", "strategy", "modules", "params", "numel", "padding", "gathered",
                   "shard", "collectives/step", "sent/step"},
                  {r, l, l, l, r, r, r, r, r, l, r});
  for (const auto& u : units) {
    table.add_row({std::to_string(u.index), u.name, strategy_text(u), join(u.modules, 3),
                   std::to_string(u.num_params), std::to_string(u.numel),
                   std::to_string(u.padding()),
                   format_bytes(u.padded_numel * elem_size(mp.param_dtype)),
                   format_bytes(u.master_bytes), collectives_text(u.per_step),
                   format_bytes(u.per_step.bytes)});
  }
  os << table;
  os << "gathered = unsharded flat buffer (" << dtype_name(mp.param_dtype)
     << "); shard = fp32 master per rank; AG f+b = forward + backward all-gathers; sent/step = "
        "bytes this rank sends (Unit counters)";
  if (replicate_size > 1)
    os << "; rAR = all-reduce of the reduced shard across the replicas; AR x2 = over the shard "
          "group, then across the replicas";
  os << "\n";
  os << "units: " << units.size() << ", params numel: " << total_numel
     << ", padding: " << total_padding << ", tied: " << tied.size() << "\n";
  os << "per step and rank: " << per_step.forward_all_gathers + per_step.backward_all_gathers
     << " all-gathers (" << per_step.forward_all_gathers << " forward, "
     << per_step.backward_all_gathers << " backward), " << per_step.reduce_scatters
     << " reduce-scatters, " << per_step.all_reduces << " all-reduces, ";
  if (per_step.gather_all_reduces)
    os << per_step.gather_all_reduces << " fp8 amax all-reduces, ";
  os << format_bytes(per_step.bytes) << " sent (" << per_step.bytes << " B)";
  if (replicate_size > 1)
    os << ", of which " << format_bytes(per_step.replicate_bytes) << " across replicas ("
       << per_step.replicate_all_reduces << " replicate all-reduces"
       << (per_step.all_reduces ? ", plus the replica hop of each all-reduce" : "") << ")";
  os << "\n";
  if (mesh.tp() > 1) {
    const int64_t e_size = elem_size(mp.param_dtype);
    os << "tensor parallel: tp " << mesh.tp() << " (" << mesh.global_size() << " ranks, "
       << mesh.to_string() << "), " << tp_modules
       << " split modules; numel and bytes above are the TP-local slices. Per step and rank: "
       << tp.forward_all_reduces << " forward + " << tp.backward_all_reduces
       << " backward all-reduces over the tp group, ";
    if (tp.forward_all_gathers + tp.backward_all_gathers > 0)
      os << "sequence parallel: " << tp.forward_all_gathers << " forward + "
         << tp.backward_all_gathers << " backward all-gathers and " << tp.forward_reduce_scatters
         << " + " << tp.backward_reduce_scatters << " reduce-scatters, ";
    os
       << format_bytes(tp.forward_numel_per_token * e_size) << " + "
       << format_bytes(tp.backward_numel_per_token * e_size) << " per token ("
       << dtype_name(mp.param_dtype) << ")";
    if (tp.grad_all_reduces > 0)
      os << ", " << tp.grad_all_reduces << " gradient all-reduces of "
         << format_bytes(tp.grad_numel * e_size);
    if (tp.loss_all_reduces > 0)
      os << ", " << tp.loss_all_reduces << " loss all-reduces of 4 B per token";
    os << "\n";
    for (const auto& u : units) {
      if (u.tp.empty()) continue;
      os << "  tp " << u.name << ": AR f" << u.tp.forward_all_reduces << " b"
         << u.tp.backward_all_reduces << ", " << format_bytes(u.tp.forward_numel_per_token * e_size)
         << " + " << format_bytes(u.tp.backward_numel_per_token * e_size) << " per token\n";
    }
  }
  os << "collective latency: " << collectives_per_step << " collectives per step x "
     << format_fixed(cost.collective_latency_us, 1) << " us = "
     << format_fixed(collective_latency_ms(), 1) << " ms, "
     << percent(collective_latency_ms() / cost.reference_step_ms) << " of a "
     << format_fixed(cost.reference_step_ms, 1)
     << " ms reference step (a stated constant, not a prediction)\n";
  os << "memory per rank: persistent " << format_bytes(memory.persistent_bytes)
     << " (fp32 master shards + "
     << (options.mixed_precision.keep_low_precision_grads
             ? dtype_name(options.mixed_precision.reduce_dtype.value_or(
                   options.mixed_precision.param_dtype))
             : std::string("fp32"))
     << " grads), peak unsharded " << format_bytes(memory.peak_transient_bytes) << " at "
     << (memory.peak_at.empty() ? "-" : printable_escape(memory.peak_at));
  if (memory.wire_bytes > 0)
    os << ", + wire buffer " << format_bytes(memory.wire_bytes) << " (quantized gather of "
       << printable_escape(memory.wire_unit) << ")";
  os << ", total " << format_bytes(memory.total()) << " (+ AdamW state "
     << format_bytes(memory.adamw_state_bytes) << ", + activations)";
  if (memory.host_bytes > 0)
    os << "; offloaded to host " << format_bytes(memory.host_bytes)
       << " (fp32 master shards + grads + AdamW state)";
  // Which peak the limit was held against: this total, without activations (the cost model's
  // full peak is what the advisor holds the same limit against).
  if (memory_limit_bytes)
    os << "; limit " << format_bytes(*memory_limit_bytes)
       << " checked against this total (no activations; the full peak needs the batch)";
  os << "\n";
  // Unit and module names may come from a file (flatshard-explain --weights): escaped, as the
  // table's cells are.
  for (const auto& w : warnings) os << "warning: " << printable_escape(w) << "\n";
  return os.str();
}

}  // namespace flatshard
