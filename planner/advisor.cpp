// flatshard/planner/advisor.cpp — see advisor.h.
#include "planner/advisor.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>

#include "flat_param/flat_param_config.h"
#include "support/format.h"
#include "support/input_file.h"
#include "wrap_policies/plan.h"
#include "wrap_policies/spec.h"

namespace flatshard {

namespace {

struct Shape {  // one granularity before the prefetch / offload product
  std::string label, spec;
  bool recompute = false;
};

std::vector<Shape> granularities(const AdvisorOptions& a) {
  const std::string layer = "type=" + a.shape.layer_type;
  std::vector<Shape> out;
  if (a.include_leaf && !a.shape.leaf_types.empty())
    out.push_back({"leaf", "type=" + a.shape.leaf_types, false});
  out.push_back({"layer", layer, false});
  out.push_back({"layer+recompute", "recompute:" + layer, true});
  for (int64_t k : a.every_k) {
    if (k < 2 || 2 * k > a.shape.n_layers) continue;
    const std::string every = "every=" + std::to_string(k) + "," + layer;
    out.push_back({"every-" + std::to_string(k), every, false});
    out.push_back({"every-" + std::to_string(k) + "+recompute", "recompute:" + every, true});
  }
  if (a.include_grad_op) {
    out.push_back({"grad_op", "grad_op:" + layer, false});
    out.push_back({"grad_op+recompute", "grad_op+recompute:" + layer, true});
  }
  if (a.include_noshard) {
    out.push_back({"noshard", "noshard:" + layer + ";root:noshard", false});
    out.push_back({"noshard+recompute", "noshard+recompute:" + layer + ";root:noshard", true});
  }
  if (a.include_model) out.push_back({"model", "none", false});
  for (const auto& s : a.extra_specs) out.push_back({s, s, false});  // labelled by their spec
  return out;
}

// `p`'s times scaled by `f` (tensor parallelism: a candidate's step per token, in units of
// the best's tokens).
CostPrediction scaled(CostPrediction p, double f) {
  for (double* t : {&p.compute_ms, &p.passes_ms, &p.optimizer_ms, &p.comm_ms, &p.exposed_comm_ms,
                    &p.exposed_all_gather_ms, &p.host_ms, &p.offload_ms, &p.recompute_ms,
                    &p.gpu_ms, &p.step_ms, &p.cpu_optimizer_ms, &p.tp_comm_ms})
    *t *= f;
  return p;
}

// The decisive reason `c` loses against `best` (both fit), with its numbers. Candidates at
// another tp size run other tokens per step: `c` is compared at the best's tokens.
void assign_reason(Candidate& c, const Candidate& best, double tie_share, double noise_share) {
  const double f =
      c.cost.tokens > 0 && best.cost.tokens > 0 ? best.cost.tokens / c.cost.tokens : 1.0;
  const CostPrediction x = scaled(c.cost, f), &b = best.cost;
  const double slower = x.step_ms - b.step_ms;
  std::ostringstream why;
  why << format_fixed(x.step_ms, 2) << " ms vs " << format_fixed(b.step_ms, 2) << " ms";
  if (f != 1.0) why << " (at the best's " << format_fixed(b.tokens, 0) << " tokens per GPU)";
  if (slower <= tie_share * b.step_ms) {
    c.reason = LossReason::kNotFaster;
    why << ": no faster (within " << format_fixed(100 * tie_share, 1) << "%); the best peaks at "
        << format_bytes(b.peak_bytes) << " against " << format_bytes(x.peak_bytes);
    c.why = why.str();
    return;
  }
  // What host time adds to the step beyond the GPU's (cost_model.h: the overlap norm; all of
  // host - gpu when host-bound).
  const double host_x = x.step_ms - x.gpu_ms, host_b = b.step_ms - b.gpu_ms;
  struct Term {
    LossReason reason;
    double excess;
    const char* what;
  };
  const double other = (x.compute_ms - x.recompute_ms + x.passes_ms + x.optimizer_ms) -
                       (b.compute_ms - b.recompute_ms + b.passes_ms + b.optimizer_ms);
  std::vector<Term> terms = {
      {LossReason::kExposedAllGather, x.exposed_comm_ms - b.exposed_comm_ms,
       "exposed communication"},
      {LossReason::kHostBound, host_x - host_b, "host time beyond the GPU's"},
      {LossReason::kRecompute, x.recompute_ms - b.recompute_ms, "recompute forward"},
      {LossReason::kOffloadTraffic, x.offload_ms - b.offload_ms, "offload copies + CPU optimizer"},
      {LossReason::kParameterPasses, other, "per-parameter passes (casts, upcasts, optimizer)"},
  };
  const Term* top = &terms.front();
  for (const auto& t : terms)
    if (t.excess > top->excess) top = &t;
  c.reason = top->reason;
  if (x.replicated_bytes > b.replicated_bytes &&
      (top->reason == LossReason::kExposedAllGather || top->reason == LossReason::kParameterPasses))
    c.reason = LossReason::kReplication;
  why << ": +" << format_fixed(top->excess, 2) << " ms " << top->what;
  if (c.reason == LossReason::kReplication)
    why << " (NO_SHARD units replicate " << format_bytes(x.replicated_bytes) << " per rank)";
  // Host-bound only when its host time is above its GPU time; below, the same excess is the
  // overlap's imperfection, and the verdict must not contradict the numbers beside it.
  if (c.reason == LossReason::kHostBound && !x.host_bound) c.reason = LossReason::kHostOverhead;
  if (c.reason == LossReason::kHostBound)
    why << " (host " << format_fixed(x.host_ms, 2) << " ms > GPU " << format_fixed(x.gpu_ms, 2)
        << " ms)";
  if (c.reason == LossReason::kHostOverhead)
    why << " (host " << format_fixed(x.host_ms, 2) << " ms < GPU " << format_fixed(x.gpu_ms, 2)
        << " ms: not host-bound; its host work is hidden less well than the best's)";
  if (slower < noise_share * b.step_ms)
    why << "; a " << format_fixed(100 * slower / b.step_ms, 1)
        << "% margin, within the prediction's error: measure both";
  c.why = why.str();
}

// Tensor parallelism (issue 51): every mesh (shard, replicas) at tp 1 and at each size of
// a.tp_sizes the model can split; the sizes left out, with why, into `skipped`.
struct Mesh3 {
  int shard, replicas, tp;
};
std::vector<Mesh3> tp_grid(const torch::nn::Module& model,
                           const std::vector<std::pair<int, int>>& meshes, bool searched,
                           int world_size, int replicate_size, const AdvisorOptions& a,
                           std::vector<std::string>* skipped) {
  std::vector<Mesh3> grid;
  for (const auto& [shard, replicas] : meshes) grid.push_back({shard, replicas, 1});
  TORCH_CHECK(a.tp_sizes.empty() || !a.tp_plan.empty(),
              "suggest: tp_sizes given without a tp_plan (a family's FamilyModules::tp_plan)");
  const int64_t gpus = static_cast<int64_t>(world_size) * replicate_size;
  for (int t : a.tp_sizes) {
    TORCH_CHECK(t >= 2, "suggest: tp size ", t, " must be >= 2 (tp 1 is always tried)");
    if (gpus % t != 0) {
      skipped->push_back("tp " + std::to_string(t) + ": does not divide the " +
                         std::to_string(gpus) + " ranks");
      continue;
    }
    try {  // parallelize()'s own check (heads, kv heads, sizes): one home for the rule
      match_tp_plan(model, a.tp_plan, t, "tp " + std::to_string(t));
    } catch (const c10::Error& err) {
      const std::string msg = err.what_without_backtrace();
      skipped->push_back(msg.substr(0, msg.find('\n')));
      continue;
    }
    const int64_t dp = gpus / t;
    if (searched) {
      for (const auto& [shard, replicas] : meshes)
        if (dp % shard == 0) grid.push_back({shard, static_cast<int>(dp / shard), t});
    } else if (world_size % t == 0) {
      grid.push_back({world_size / t, replicate_size, t});
    } else {
      skipped->push_back("tp " + std::to_string(t) + ": does not divide world " +
                         std::to_string(world_size));
    }
  }
  return grid;
}

}  // namespace

const char* to_string(LossReason r) {
  switch (r) {
    case LossReason::kNone:
      return "best";
    case LossReason::kDoesNotFit:
      return "does not fit";
    case LossReason::kExposedAllGather:
      return "exposed all-gather";
    case LossReason::kHostBound:
      return "host-bound";
    case LossReason::kHostOverhead:
      return "host overhead";
    case LossReason::kReplication:
      return "replication";
    case LossReason::kRecompute:
      return "slower compute (recompute)";
    case LossReason::kOffloadTraffic:
      return "offload traffic";
    case LossReason::kParameterPasses:
      return "per-parameter passes";
    case LossReason::kNotFaster:
      return "not faster";
  }
  return "?";
}

std::string Candidate::command_line() const {
  std::string s = "--policy '" + spec + "' --prefetch " + std::to_string(prefetch);
  if (offload) s += " --offload " + std::to_string(offload);
  if (mesh_searched)
    s += " --world " + std::to_string(shard) + " --replicate " + std::to_string(replicate);
  if (tp > 1) s += " --tp " + std::to_string(tp);
  return s;
}

std::vector<int> cluster_shard_sizes(int64_t gpus, int64_t gpus_per_node) {
  TORCH_CHECK(gpus >= 1 && gpus <= std::numeric_limits<int>::max() && gpus_per_node >= 0,
              "cluster_shard_sizes: ", gpus, " GPUs and ", gpus_per_node,
              " per node: expected at least 1 GPU (at most int's max) and >= 0 per node");
  std::vector<int> out;
  for (int64_t s = 1; s * s <= gpus; ++s) {
    if (gpus % s) continue;
    for (int64_t d : {s, gpus / s}) {
      const bool aligned =
          gpus_per_node == 0 || gpus_per_node % d == 0 || d % gpus_per_node == 0;
      if (aligned && std::find(out.begin(), out.end(), d) == out.end())
        out.push_back(static_cast<int>(d));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

const Candidate& Advice::best() const {
  TORCH_CHECK(fits(), "no candidate plan fits the memory limit of ",
              format_bytes(memory_limit_bytes), " per rank",
              candidates.empty()
                  ? std::string()
                  : "; the smallest needs " + format_bytes(candidates.back().cost.peak_bytes));
  return candidates.front();
}

Advice suggest(const torch::nn::Module& model, int world_size, int replicate_size,
               const ShardingOptions& options, const AdvisorOptions& a) {
  TORCH_CHECK(a.memory_limit_bytes > 0, "suggest: memory_limit_bytes must be > 0, got ",
              a.memory_limit_bytes);
  TORCH_CHECK(world_size >= 1 && replicate_size >= 1, "suggest: world ", world_size,
              " and replicate ", replicate_size, " must be >= 1");
  TORCH_CHECK(!a.prefetch_depths.empty() && !a.offload_levels.empty(),
              "suggest: prefetch_depths and offload_levels must not be empty");
  for (int d : a.prefetch_depths)
    TORCH_CHECK(d >= 0 && d <= 64, "suggest: prefetch depth must be in [0, 64], got ", d);
  for (int l : a.offload_levels)
    check_offload_level(l, "suggest");
  TORCH_CHECK(a.memory_margin >= 0 && a.memory_margin < 1,
              "suggest: memory_margin must be in [0, 1), got ", a.memory_margin);
  const double usable = static_cast<double>(a.memory_limit_bytes) * (1 - a.memory_margin);
  Advice advice;
  advice.memory_margin = a.memory_margin;
  advice.memory_limit_bytes = a.memory_limit_bytes;
  advice.world_size = world_size;
  advice.replicate_size = replicate_size;
  advice.workload = a.workload;
  advice.profile = a.profile;
  // The meshes: the given one, or every shard size asked for (issue 52).
  const int64_t gpus = static_cast<int64_t>(world_size) * replicate_size;
  std::vector<std::pair<int, int>> meshes;
  for (int s : a.shard_sizes) {
    TORCH_CHECK(s >= 1 && gpus % s == 0, "suggest: shard size ", s, " does not divide the ",
                gpus, " ranks (world ", world_size, " x replicate ", replicate_size, ")");
    meshes.emplace_back(s, static_cast<int>(gpus / s));
  }
  const bool searched = !meshes.empty();
  if (!searched) meshes.emplace_back(world_size, replicate_size);
  advice.mesh_searched = searched;
  advice.tp_searched = !a.tp_sizes.empty();
  const std::vector<Mesh3> grid =
      tp_grid(model, meshes, searched, world_size, replicate_size, a, &advice.tp_skipped);
  for (const Shape& g : granularities(a)) {
    Plan plan;
    try {
      plan = make_plan(model, parse_policy(g.spec));
    } catch (const c10::Error& err) {
      const std::string msg = err.what_without_backtrace();
      TORCH_CHECK(false, "suggest: candidate '", g.label, "' spec '", g.spec,
                  "': ", msg.substr(0, msg.find('\n')));
    }
    const bool extra =
        std::find(a.extra_specs.begin(), a.extra_specs.end(), g.spec) != a.extra_specs.end();
    if (g.label != "model" && !extra && plan.matched_modules == 0) continue;
    for (const auto& [shard, replicas, tp] : grid) {
    std::map<int, Explanation> explained;  // per offload level
    for (int depth : a.prefetch_depths) {
      for (int level : a.offload_levels) {
        // The level as ShardingOptions::offload: explain resolves it per unit as fully_shard
        // would (NO_SHARD units at most 1: fsdp/resolve.h). The depth changes only the memory
        // estimate (explain: per-unit rows and warnings do not depend on it), so one explain
        // per level serves every depth — at 8192 layers explain is most of --suggest's time.
        Explanation& base = explained[level];
        if (base.units.empty()) {
          ShardingOptions o = options;
          o.forward_prefetch = o.backward_prefetch = depth;
          o.offload = level;
          base = explain(model, plan, MeshShape(shard, replicas, tp), o, std::nullopt, {},
                         tp > 1 ? a.tp_plan : TpPlan{});
        }
        Explanation e = base;
        e.options.forward_prefetch = e.options.backward_prefetch = depth;
        e.memory = estimate_memory(e.units, depth, depth);
        Candidate c;
        c.label = g.label;
        c.spec = g.spec;
        c.prefetch = depth;
        c.offload = level;
        c.recompute = g.recompute;
        c.units = static_cast<int64_t>(e.units.size());
        c.cost = predict_cost(e, a.shape, a.workload, a.profile);
        c.fits = static_cast<double>(c.cost.peak_bytes) <= usable;
        c.shard = shard;
        c.replicate = replicas;
        c.tp = tp;
        c.mesh_searched = searched;
        advice.candidates.push_back(std::move(c));
      }
    }
    }  // meshes
  }
  auto& cs = advice.candidates;
  // Time per token per GPU: the step itself when every candidate has the same tokens (tp 1).
  auto per_token = [](const Candidate& c) {
    return c.cost.tokens > 0 ? c.cost.step_ms / c.cost.tokens : c.cost.step_ms;
  };
  std::stable_sort(cs.begin(), cs.end(), [&](const Candidate& x, const Candidate& y) {
    if (x.fits != y.fits) return x.fits;
    if (x.fits) return per_token(x) < per_token(y);
    return x.cost.peak_bytes < y.cost.peak_bytes;
  });
  if (!cs.empty() && cs.front().fits) {
    // Ties: among the candidates within tie_share of the fastest, the smallest peak.
    const double limit = per_token(cs.front()) * (1 + a.tie_share);
    size_t pick = 0;
    for (size_t i = 1; i < cs.size() && cs[i].fits && per_token(cs[i]) <= limit; ++i)
      if (cs[i].cost.peak_bytes < cs[pick].cost.peak_bytes) pick = i;
    std::rotate(cs.begin(), cs.begin() + pick, cs.begin() + pick + 1);
    cs.front().reason = LossReason::kNone;
    cs.front().why = "fits and is predicted fastest";
    for (size_t i = 1; i < cs.size(); ++i) {
      if (!cs[i].fits) continue;
      assign_reason(cs[i], cs.front(), a.tie_share, a.noise_share);
    }
  }
  for (auto& c : cs)
    if (!c.fits) {
      c.reason = LossReason::kDoesNotFit;
      c.why = "peak " + format_bytes(c.cost.peak_bytes) + " > " +
              format_bytes(static_cast<int64_t>(usable)) + " (limit " +
              format_bytes(a.memory_limit_bytes) + " less a " +
              std::to_string(static_cast<int>(std::lround(100 * a.memory_margin))) +
              "% margin), at " + c.cost.peak_at;
    }
  return advice;
}

std::string Advice::to_string() const {
  std::ostringstream os;
  os << "advisor: world " << world_size;
  if (replicate_size > 1) os << " x " << replicate_size << " replicas";
  if (mesh_searched)
    os << " (" << static_cast<int64_t>(world_size) * replicate_size
       << " GPUs; mesh = shard group x replicas, each searched)";
  os << ", batch " << workload.batch << " x seq " << workload.seq << ", memory limit "
     << format_bytes(memory_limit_bytes) << " per rank (" << std::lround(100 * memory_margin)
     << "% kept free), held against the predicted peak with activations\nprofile: "
     << printable_escape(profile.source) << "\n";
  if (tp_searched) {
    os << "tensor parallelism: each tp group trains on one batch of the size above; candidates "
          "ranked by time per token per GPU\n";
    for (const auto& s : tp_skipped) os << "  skipped " << printable_escape(s) << "\n";
  }
  if (fits()) {
    const Candidate& b = candidates.front();
    // A spec holds module paths, which may come from a file (flatshard-explain --weights).
    os << "suggested: " << b.label << " " << printable_escape(b.command_line()) << "\n"
       << "  spec: " << printable_escape(b.spec) << "\n"
       << "  " << b.cost.to_string();
    if (mesh_searched || tp_searched || profile.peak_tflops > 0)
      os << "  " << b.cost.throughput(profile) << "\n";
  } else {
    os << "no candidate fits";
    if (!candidates.empty())
      os << "; the smallest (" << candidates.front().label << ", prefetch "
         << candidates.front().prefetch << ") needs "
         << format_bytes(candidates.front().cost.peak_bytes);
    os << "\n";
  }
  std::vector<std::string> heads = {"plan",    "prefetch",   "offload", "units", "peak",
                                    "step ms", "exposed ms", "host ms", "verdict"};
  std::vector<TextTable::Align> aligns = {
      TextTable::Align::kLeft,  TextTable::Align::kRight, TextTable::Align::kRight,
      TextTable::Align::kRight, TextTable::Align::kRight, TextTable::Align::kRight,
      TextTable::Align::kRight, TextTable::Align::kRight, TextTable::Align::kLeft};
  const bool wide = mesh_searched || tp_searched;
  if (wide) {  // shard group x replicas; tokens/s per GPU and MFU beside the step
    heads.insert(heads.begin() + 1, "mesh");
    aligns.insert(aligns.begin() + 1, TextTable::Align::kRight);
    heads.insert(heads.end() - 1, {"tok/s/GPU", "MFU"});
    aligns.insert(aligns.end() - 1, {TextTable::Align::kRight, TextTable::Align::kRight});
  }
  if (tp_searched) {  // after the mesh
    heads.insert(heads.begin() + 2, "tp");
    aligns.insert(aligns.begin() + 2, TextTable::Align::kRight);
  }
  TextTable t(heads, aligns);
  // One row per distinct prediction: candidates that differ only in the prefetch depth and
  // predict the same peak and times share the first one's row and verdict, their depths
  // joined ("1,2"): the depth made no difference there (the best's twin is the best too).
  struct Row {
    std::vector<std::string> cells;  // plan, offload, units, peak, step, exposed, host, verdict
    int64_t peak_bytes = 0;
    std::string prefetch;
    std::string tokens, mfu, mesh;  // with a mesh search
    int tp = 1;
  };
  std::vector<Row> rows;
  for (const auto& c : candidates) {
    Row row{{c.label, std::to_string(c.offload), std::to_string(c.units),
             format_bytes(c.cost.peak_bytes), format_fixed(c.cost.step_ms, 2),
             format_fixed(c.cost.exposed_comm_ms, 2), format_fixed(c.cost.host_ms, 2),
             std::string(flatshard::to_string(c.reason)) + (c.why.empty() ? "" : ": " + c.why)},
            c.cost.peak_bytes,
            std::to_string(c.prefetch),
            format_fixed(c.cost.tokens_per_s(), 0),
            profile.peak_tflops > 0 ? format_fixed(100 * c.cost.mfu(profile.peak_tflops), 1) + "%"
                                    : "-",
            std::to_string(c.shard) + "x" + std::to_string(c.replicate),
            c.tp};
    // Times as printed (10 us), the peak to the byte.
    auto same = std::find_if(rows.begin(), rows.end(), [&](const Row& r) {
      return r.peak_bytes == row.peak_bytes && r.mesh == row.mesh && r.tp == row.tp &&
             std::equal(r.cells.begin(), r.cells.begin() + 7, row.cells.begin());
    });
    if (same != rows.end()) {
      same->prefetch += "," + row.prefetch;
    } else {
      rows.push_back(std::move(row));
    }
  }
  for (const auto& r : rows) {
    if (!wide) {
      t.add_row({r.cells[0], r.prefetch, r.cells[1], r.cells[2], r.cells[3], r.cells[4],
                 r.cells[5], r.cells[6], r.cells[7]});
      continue;
    }
    std::vector<std::string> cells = {r.cells[0], r.mesh, r.prefetch, r.cells[1],
                                      r.cells[2], r.cells[3], r.cells[4], r.cells[5], r.cells[6],
                                      r.tokens, r.mfu, r.cells[7]};
    if (tp_searched) cells.insert(cells.begin() + 2, std::to_string(r.tp));
    t.add_row(cells);
  }
  os << t;
  return os.str();
}

}  // namespace flatshard
