// flatshard/planner/explain.h — what a plan will cost, before anything runs.
//
//   auto plan = make_plan(*model, parse_policy("type=Block"));
//   Explanation e = explain(*model, plan, MeshShape(/*shard=*/8, /*replicate=*/1), options,
//                           /*memory_limit=*/40_GiB);
//   std::cout << e.to_string();   // per-unit table, totals, predicted peak, warnings
//
// The model is only read (names, shapes, tensor identities): it may live on the meta device
// (fsdp/meta_init.h), so a 1B-parameter model is explained without allocating it.
//
// Contract — exact numbers (they are what the runtime does, and tests hold them to it):
// - Layouts come from FlatLayout::make with the real world size (1 for NO_SHARD units, which are
//   replicated) and ShardingOptions::align, as FlatParam builds them.
// - Strategy, reshard-after-forward, dtypes and the layout's world size come from
//   resolve_unit() (fsdp/resolve.h), the function fully_shard() builds its units with: the
//   plan's unit options, else ShardingOptions; the root keeps its parameters from forward to
//   backward unless its options say otherwise; only FULL_SHARD units reshard after forward.
// - UnitExplanation::per_step equals Unit::counters() (ShardedModel::counters().per_unit) after
//   one training step that enters every unit once in forward and reduces every unit once:
//     FULL_SHARD, resharding   1 forward all-gather + 1 backward all-gather + 1 reduce-scatter
//     FULL_SHARD keep (root)   1 forward all-gather                        + 1 reduce-scatter
//     SHARD_GRAD_OP            1 forward all-gather                        + 1 reduce-scatter
//     NO_SHARD                 1 all-reduce
//   bytes: an all-gather sends shard_numel * sizeof(param_dtype) (a quantized gather dtype:
//   quantized_gather_bytes(), flat_param/quantized_gather.h, fp8's amax all-reduce included
//   and counted in gather_all_reduces), a reduction sends
//   padded_numel * sizeof(reduce_dtype). HSDP (mesh.replicate() R > 1; mesh.shard() S is the
//   shard group's size): each reduction is followed by an all-reduce across the R replicas of
//   the reduced gradient — shard_numel (NO_SHARD: padded_numel) * sizeof(reduce_dtype) bytes,
//   counted in bytes and replicate_bytes; sharded units also count it in replicate_all_reduces
//   (NO_SHARD units count their two-hop all-reduce once, in all_reduces). A unit with no elements
//   issues nothing. A unit entered twice per forward, or run without grad, differs; explain()
//   cannot know that. A recompute unit (Note [Recompute]) issues the same collectives: its
//   recompute reuses the backward all-gather. The table's strategy column shows "recompute";
//   activations are not predicted.
// Tensor parallelism (mesh.tp() T > 1, docs/tensor-parallel.md): the model is explained as
//   parallelize() leaves it, with the TP-local parameters (colwise: out / T rows, rowwise:
//   in / T columns; a model already parallelized is read as it is, otherwise `tp_plan` is
//   matched as parallelize() matches it, errors included), so layouts, bytes and memory are
//   per rank. TpCollectives (per unit and in total) equal TensorParallel::counters() after one
//   step that enters every split module once with an input that requires grad: a forward
//   all-reduce of each rowwise module's output, a backward one of each colwise module's input
//   gradient (a recompute unit's forward runs twice: two forward all-reduces per rowwise module);
//   with sequence parallelism the all-gathers and reduce-scatters that replace them, and the
//   all-reduces of the gradients of parameters that saw sequence shards; with loss parallelism
//   the loss's three all-reduces.
//   Their size is per token: bytes = numel_per_token x tokens x the compute dtype's size
//   (TpCollectives::counters()).
// Estimates (a model of the runtime, stated in MemoryEstimate's comment):
// - the predicted peak of unsharded memory, with the configured prefetch depths; the plan's
//   unit order stands for the execution order (it is registration order; the runtime records the
//   real one on the first step).
// - collective latency per step: collectives_per_step x ExplainOptions::collective_latency_us,
//   compared with a stated reference step time (explain has no compute model).
// Warnings (Explanation::warnings), each saying what to change: a policy that matched nothing;
// fragmentation (latency above ExplainOptions::latency_share of the reference step, or any unit
// below 1 MiB); replication (NO_SHARD units whose master + gradient + AdamW state, held on every
// rank, exceed ExplainOptions::replicated_share of per-rank memory: names them and the bytes
// sharding would save); one unit holding most of the model; parameters left to the root;
// padding; empty matched modules; a prefetch depth that does not fit the memory limit (last).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "collectives/mesh.h"
#include "fsdp/options.h"
#include "fsdp/tensor_parallel.h"
#include "fsdp/unit.h"
#include "wrap_policies/plan.h"

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

// The TP collectives of one step (see the contract above): counts, and the elements per token
// of the reduced tensors (a rowwise module's out_features, a colwise module's in_features).
struct TpCollectives {
  int64_t forward_all_reduces = 0, backward_all_reduces = 0;
  // Sequence parallelism: a colwise module's input gathered (forward) and its gradient
  // reduce-scattered (backward); a rowwise module's output reduce-scattered, its gradient gathered.
  int64_t forward_all_gathers = 0, forward_reduce_scatters = 0;
  int64_t backward_all_gathers = 0, backward_reduce_scatters = 0;
  int64_t forward_numel_per_token = 0, backward_numel_per_token = 0;  // all of the above
  // Sequence parallelism: the gradients all-reduced over tp (Note [Sequence-parallel
  // gradients], fsdp/tensor_parallel.cpp): one per trainable parameter, numel per step.
  int64_t grad_all_reduces = 0, grad_numel = 0;
  // Loss parallelism (total only): 3 all-reduces of one fp32 value per token.
  int64_t loss_all_reduces = 0, loss_numel_per_token = 0;
  TpCollectives& operator+=(const TpCollectives& o);
  bool empty() const {
    return forward_all_reduces == 0 && backward_all_reduces == 0 && forward_all_gathers == 0 &&
           forward_reduce_scatters == 0 && backward_all_gathers == 0 &&
           backward_reduce_scatters == 0 && grad_all_reduces == 0 && loss_all_reduces == 0;
  }
  // What TensorParallel::counters() shows after one step of `tokens` tokens per rank (batch x
  // seq) computed in `dtype` (the param dtype); its boundary_* (the model's sequence edges) are
  // not predicted and stay 0.
  TpCounters counters(int64_t tokens, c10::ScalarType dtype) const;
};

struct UnitExplanation {
  int index = 0;
  std::string name;
  bool is_root = false;
  // Member module paths; for the root, the modules that own its parameters.
  std::vector<std::string> modules;
  int64_t num_params = 0;
  int64_t numel = 0;         // real elements
  int64_t padded_numel = 0;  // flat buffer elements, FlatLayout::make
  int64_t shard_numel = 0;   // this rank's master shard (padded_numel for NO_SHARD)
  int64_t padding() const { return padded_numel - numel; }
  ShardingStrategy strategy = ShardingStrategy::kFullShard;
  bool reshard_after_forward = false;
  // Forward recomputed in backward (Note [Recompute]). explain predicts no activations, so this
  // is shown, not costed: collectives and model-state memory are the same either way.
  bool recompute = false;
  // Note [CPU offload] (flat_param/offload.h): the unit's level (fsdp/resolve.h). Offloaded,
  // master_bytes, its gradient and AdamW's state are host memory (MemoryEstimate::host_bytes),
  // and level 1 keeps resident_bytes (shard_numel * param dtype) on the device, as does a unit
  // with keep_compute_shard (Note [Kept compute shard]; flat_param/collective_plan.h's
  // kept_shard_bytes()).
  int offload = 0;
  int64_t resident_bytes = 0;

  int64_t all_gather_bytes = 0;  // one all-gather: bytes this rank sends (0 for NO_SHARD)
  // A quantized gather's wire buffer while it runs (quantized_wire_buffer_bytes(),
  // flat_param/quantized_gather.h); 0 for a gather in the param dtype.
  int64_t wire_buffer_bytes = 0;
  int64_t gather_all_reduces = 0;  // all-reduces per gather besides it (fp8's amax: 1)
  int64_t reduce_bytes = 0;      // one reduce-scatter / all-reduce: bytes this rank sends
  // Bytes of the unsharded buffer while gathered (padded_numel * param dtype). For NO_SHARD it is
  // the compute copy, held always (0 when it aliases the fp32 master).
  int64_t gathered_bytes = 0;
  // Bytes of the flat gradient during the unit's backward (padded_numel * param dtype), plus the
  // cast copy sent to the reduction when reduce dtype != param dtype.
  int64_t grad_buffer_bytes = 0;
  int64_t master_bytes = 0;  // fp32 master: shard_numel * 4
  // Its gradient: shard_numel * 4, or * the reduce dtype's size with keep_low_precision_grads
  // (Note [Low-precision master gradient], flat_param/collective_plan.h); 0 when frozen.
  int64_t master_grad_bytes = 0;
  // Note [Frozen parameters]: a unit whose parameters all have requires_grad false (no
  // gradient, no reduction, no optimizer state), and the fp32 bytes of the trainable part of
  // the largest rank's shard (what AdamW keeps state for; -1: all of master_bytes).
  bool frozen = false;
  int64_t trainable_master_bytes = -1;
  // A frozen unit gathers in backward only when its inputs require grad; explain assumes they
  // do when a unit before it in plan order (the root included) trains.
  bool backward_reads_params = true;
  UnitCounters per_step;     // collectives and bytes of one step, as Unit::counters() shows
  TpCollectives tp;          // the TP collectives of its split modules (mesh.tp() > 1)
};

// The cost model behind the fragmentation and replication warnings: stated constants, each
// overridable (flatshard-explain: --collective-latency-us, --reference-step-ms).
struct ExplainOptions {
  // Fixed cost of one collective whatever its size: ~50 us for an NCCL collective on NVLink
  // (docs/design.md: an all-gather of 1 MiB takes about as long as one of 16 MiB).
  double collective_latency_us = 50;
  // explain() has no model of compute time (it does not know the batch), so the latency of a
  // step's collectives is compared with this reference step, not a predicted one: 100 ms is
  // the 1B GPT's measured step at 4 sequences per GPU on 2 H200s (benchmarks/RESULTS.md).
  double reference_step_ms = 100;
  // Fragmentation warning: latency per step above this share of the reference step (or any
  // unit below 1 MiB, whatever this says).
  double latency_share = 0.05;
  // Replication warning: NO_SHARD units' replicated state above this share of per-rank memory
  // (MemoryEstimate::total() + AdamW state).
  double replicated_share = 0.10;
  // How the warnings' advice writes a policy, always in the model's own type names: kCpp, the
  // builders of wrap_policies/policy.h (by_type("MixerBlock"), every(4, rule)), for C++
  // callers; kSpec, the --policy text of wrap_policies/spec.h (--policy type=MixerBlock,
  // every=4), which flatshard-explain sets.
  enum class Advice { kCpp, kSpec };
  Advice advice = Advice::kCpp;
};

// Model-state memory per rank (activations and optimizer state are not included).
//  persistent: fp32 master shards + their fp32 gradients + NO_SHARD compute copies.
//  peak transient: the most unsharded memory alive at once, simulated unit by unit:
//   forward, unit k computing: units kept gathered so far (root, keep, SHARD_GRAD_OP), k's
//     enclosing units, k, and the next forward_prefetch units;
//   backward, unit k computing: the root, kept units not yet reduced, k's enclosing units, k,
//     the next backward_prefetch units in reverse order; plus the flat gradients of the root,
//     the enclosing units and k, and the previous unit's reduction buffers (held until the next
//     reduction is issued: Note [Reduce buffer lifetime] in reduce_buffers.h).
//  Allocator caching and fragmentation are not modelled.
//  offloaded units (Note [CPU offload]): master, gradient and AdamW state count in host_bytes
//   instead; level 1's compute-dtype shard is persistent device memory.
//  wire: a quantized gather's wire buffer (fp8 / int8 bytes of every rank's part), one at a
//   time (the gathers run in order on one stream): the largest unit's, added to the total.
struct MemoryEstimate {
  int64_t persistent_bytes = 0;
  int64_t peak_transient_bytes = 0;
  std::string peak_at;  // e.g. "backward of blocks.15"
  int64_t wire_bytes = 0;  // the largest UnitExplanation::wire_buffer_bytes
  std::string wire_unit;   // its unit (the first in plan order among equals); "" when none
  int64_t total() const { return persistent_bytes + peak_transient_bytes + wire_bytes; }
  // AdamW's two fp32 moments per master element on the device, for reference (not in total()).
  int64_t adamw_state_bytes = 0;
  // Offloaded units' fp32 master + gradient + AdamW state, in (pinned) host memory per rank.
  int64_t host_bytes = 0;
};

struct Explanation {
  // shard: ranks of a shard group (all data-parallel ranks without HSDP); replicate: HSDP
  // replicas (1: plain sharding); tp: tensor-parallel ranks.
  MeshShape mesh;
  ShardingOptions options;
  std::vector<UnitExplanation> units;  // plan order
  UnitCounters per_step;               // sum over units
  TpCollectives tp;                    // sum over units (mesh.tp() > 1)
  int tp_modules = 0;                  // colwise and rowwise modules
  int64_t total_numel = 0;
  int64_t total_padding = 0;
  int64_t matched_modules = 0;
  std::vector<std::string> empty_units;
  std::vector<std::pair<std::string, std::vector<std::string>>> tied;
  MemoryEstimate memory;
  std::optional<int64_t> memory_limit_bytes;
  // The largest prefetch depth (applied to forward and backward, capped by the configured ones)
  // whose estimate fits the limit; -1 if none, unset without a limit.
  std::optional<int> fitting_prefetch;
  ExplainOptions cost;                // the constants the latency line and warnings used
  // Collectives one rank issues per step (HSDP: replica all-reduces and hops included).
  int64_t collectives_per_step = 0;
  double collective_latency_ms() const {
    return static_cast<double>(collectives_per_step) * cost.collective_latency_us / 1000.0;
  }
  std::vector<std::string> warnings;  // likely mistakes, one sentence each, with what to do

  // Header line, per-unit table, totals, memory, warnings. Columns are described in the output.
  std::string to_string() const;
};

// Throws c10::Error if the plan names parameters the model does not have, or a mesh size is
// < 1. `mesh`: the shard group's size, the HSDP replicas and the tp size (collectives/mesh.h),
// as fully_shard gets them. With mesh.tp() > 1, `tp_plan` is the plan parallelize() will get
// (unused when the model is already parallelized; then its tp size must be mesh.tp()).
Explanation explain(const torch::nn::Module& model, const Plan& plan, const MeshShape& mesh,
                    const ShardingOptions& options,
                    std::optional<int64_t> memory_limit_bytes = std::nullopt,
                    const ExplainOptions& cost = {}, const TpPlan& tp_plan = {});

// The simulation behind MemoryEstimate, exposed so callers can try other prefetch depths.
MemoryEstimate estimate_memory(const std::vector<UnitExplanation>& units,
                               int forward_prefetch, int backward_prefetch);

}  // namespace flatshard
