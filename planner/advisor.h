// flatshard/planner/advisor.h — the plan advisor: the plan that fits a per-rank memory budget at
// the best predicted step time, and why each alternative loses.
//
//   AdvisorOptions a;
//   a.memory_limit_bytes = 40_GiB;  a.workload = {4, 2048};  a.shape = ...;  a.profile = ...;
//   Advice advice = suggest(*model, /*world=*/8, /*replicate=*/1, sharding_options, a);
//   std::cout << advice.to_string();
//   auto plan = make_plan(*model, parse_policy(advice.best().spec));   // ready to use
//
// Contract
// - Candidates (each a spec string parse_policy() accepts, plus the global knobs it needs):
//     leaf      type=<shape.leaf_types>
//     layer     type=<shape.layer_type>               and recompute:type=...
//     every-k   every=k,type=<layer_type>, k in every_k with 2k <= layers, and with recompute
//     grad_op   grad_op:type=<layer_type>             and grad_op+recompute:...
//     noshard   noshard:type=<layer_type>;root:noshard and noshard+recompute:...
//     model     none (the root unit holds everything)
//     extra     AdvisorOptions::extra_specs as given (custom groups), labelled by their spec
//   x every prefetch depth in prefetch_depths (forward and backward alike) x every level in
//   offload_levels (as ShardingOptions::offload; default {0}: offload only when asked).
//   A candidate's spec never carries the prefetch depth or the offload level: Candidate::
//   command_line() shows all three as flags.
// - Each is explained (planner/explain.h) with the caller's ShardingOptions (strategy, dtypes,
//   align) and costed by predict_cost() (planner/cost_model.h). It fits when its predicted peak
//   is <= memory_limit_bytes. The best: the fitting candidate with the least predicted step;
//   candidates within tie_share of it are tied and the smallest peak among them wins.
// - Every other candidate gets one LossReason, the decisive one:
//     kDoesNotFit        predicted peak above the budget
//     kExposedAllGather  more exposed communication than the best (the largest extra term)
//     kHostBound         host time adds more to its step than to the best's and its host time
//                        exceeds its GPU time (host-bound: the step is host - GPU longer)
//     kHostOverhead      the same excess with host time below GPU time: not host-bound, the
//                        host's work is hidden imperfectly (cost_model.h: the overlap norm)
//     kReplication       NO_SHARD units: the extra time comes from their all-reduces and
//                        replicated optimizer/parameter passes
//     kRecompute         the second forward of its recompute units is the largest extra term
//     kOffloadTraffic    host<->device copies and the CPU optimizer are the largest extra term
//     kParameterPasses   casts, gradient upcasts and the optimizer step are (e.g. a unit that
//                        reshards after forward casts its master twice per step)
//     kNotFaster         a tie: within tie_share of the best, which has the smaller peak
//   The reason is the term (exposed communication, host, recompute, offload, parameter passes)
//   with the largest excess over the best; NO_SHARD candidates whose largest excess is
//   communication or parameter passes report kReplication. A loser slower by less than
//   noise_share of the best's step says that its margin is within the prediction's error.
// - With AdvisorOptions::shard_sizes, the product above is taken at every HSDP mesh too (shard
//   group S, replicas world x replicate / S), each costed on its groups' links (the profile's
//   topology); the table gains a mesh column and the losers' reasons compare across meshes.
// - With AdvisorOptions::tp_sizes (issue 51), each mesh is tried at tp 1 and at every tp size T
//   given: the world's ranks form tp groups of T consecutive ranks and the shard group is S / T
//   of them (with shard_sizes: each S that divides the world's ranks / T). A T the model cannot
//   split (parallelize()'s own check, match_tp_plan: heads, kv heads, sizes) or whose groups
//   do not divide the mesh is skipped and named in Advice::tp_skipped. A tp group trains on one
//   batch: AdvisorOptions::workload is per data-parallel rank, so tp T runs 1 / T of the global
//   batch per step; candidates are therefore ranked by time per token per GPU (step /
//   CostPrediction::tokens; the step itself when every candidate has the same tokens, as
//   without TP) and a loser's terms are compared per token. The table gains a tp column.
// - Throws c10::Error for a budget <= 0, world or replicate < 1, a shard size that does not
//   divide world x replicate, an empty prefetch_depths, a
//   prefetch depth or offload level out of range, or an extra spec parse_policy() rejects
//   (naming it). No fitting candidate is not an error: Advice::fits() is false and to_string()
//   says what the smallest candidate needs.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "planner/cost_model.h"
#include "planner/explain.h"
#include "planner/machine_profile.h"
#include "fsdp/options.h"

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

enum class LossReason {
  kNone,  // the best candidate
  kDoesNotFit,
  kExposedAllGather,
  kHostBound,
  kHostOverhead,
  kReplication,
  kRecompute,
  kOffloadTraffic,
  kParameterPasses,
  kNotFaster,
};
const char* to_string(LossReason r);

struct AdvisorOptions {
  int64_t memory_limit_bytes = 0;  // per rank; required (> 0)
  Workload workload;
  TransformerShape shape;
  MachineProfile profile;
  std::vector<int> prefetch_depths = {1, 2};
  std::vector<int> offload_levels = {0};
  std::vector<int64_t> every_k = {2, 4};
  bool include_leaf = true, include_grad_op = true, include_noshard = true, include_model = true;
  std::vector<std::string> extra_specs;
  // HSDP shard sizes to search (issue 52): each S must divide world x replicate, and every
  // candidate is tried at each mesh (S ranks per shard group, world x replicate / S replicas).
  // Empty: only the world and replicate suggest() is given. cluster_shard_sizes() lists the
  // ones that fit a cluster's nodes.
  std::vector<int> shard_sizes;
  // Tensor-parallel sizes to try beside tp 1 (issue 51), each > 1, with tp_plan (the plan
  // parallelize() would get: a family's FamilyModules::tp_plan). Empty: tp 1 only.
  std::vector<int> tp_sizes;
  TpPlan tp_plan;
  double tie_share = 0.005;  // steps within 0.5% are a tie; the smaller peak wins
  // Margins below this share of the best's step are within the cost model's error: its steps
  // are held within 10% of measured runs (tools/advisor_check.py, benchmarks/RESULTS.md), so
  // a 5% difference between two plans may be the model's, not the plans'. The verdict says so.
  double noise_share = 0.05;
  // Share of the budget kept free: a candidate fits when its predicted peak is at most
  // memory_limit_bytes x (1 - memory_margin). 0.05: the cost model's largest under-prediction
  // against the counting allocator on CPU ranks is 3.0% (tests/advisor_test.cpp), against the
  // 1x H200 1B-GPT runs of benchmarks/RESULTS.md 1.8%.
  double memory_margin = 0.05;
};

struct Candidate {
  std::string label;  // "layer+recompute", "every-2", "leaf", ...
  std::string spec;   // for --policy / parse_policy
  int prefetch = 1;
  int offload = 0;
  bool recompute = false;
  int64_t units = 0;
  CostPrediction cost;
  bool fits = false;
  LossReason reason = LossReason::kNone;
  std::string why;  // the reason with its numbers
  // The mesh it was costed at: ranks per shard group and replicas (AdvisorOptions::
  // shard_sizes; otherwise suggest()'s world and replicate).
  int shard = 1, replicate = 1;
  int tp = 1;                  // tensor-parallel ranks per group (AdvisorOptions::tp_sizes)
  bool mesh_searched = false;  // command_line() then gives --world and --replicate too
  // "--policy '<spec>' --prefetch N [--offload L] [--world S --replicate R] [--tp T]"
  // (flatshard-explain; the mesh when shard sizes were searched, --tp when tp > 1)
  std::string command_line() const;
};

struct Advice {
  int64_t memory_limit_bytes = 0;
  double memory_margin = 0;
  int world_size = 1, replicate_size = 1;
  bool mesh_searched = false;  // AdvisorOptions::shard_sizes was given
  bool tp_searched = false;    // AdvisorOptions::tp_sizes was given
  // tp sizes left out, each with why ("tp 3: ... n_heads = 4 ..."), first line of the error.
  std::vector<std::string> tp_skipped;
  Workload workload;
  MachineProfile profile;
  // Sorted: the best first, then fitting ones by predicted step, then the ones that do not fit
  // by peak.
  std::vector<Candidate> candidates;
  bool fits() const { return !candidates.empty() && candidates.front().fits; }
  const Candidate& best() const;  // throws c10::Error when nothing fits
  // The table lists candidates whose predictions are identical but for the prefetch depth once,
  // with the depths joined ("1,2"): the depth made no difference there.
  std::string to_string() const;
};

Advice suggest(const torch::nn::Module& model, int world_size, int replicate_size,
               const ShardingOptions& options, const AdvisorOptions& advisor);

// The shard sizes of `gpus` ranks that keep every group aligned with nodes of `gpus_per_node`
// (planner/topology.h): each S divides `gpus` and either divides gpus_per_node (a shard group
// inside one node) or is a whole number of nodes. gpus_per_node 0: every divisor. Ascending.
std::vector<int> cluster_shard_sizes(int64_t gpus, int64_t gpus_per_node);

}  // namespace flatshard
