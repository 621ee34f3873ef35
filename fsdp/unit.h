// flatshard/fsdp/unit.h — one sharding unit: a flat parameter, its state machine and its hooks.
//
// Life of a unit in one training step (FULL_SHARD):
//   pre_forward   : kSharded -> unshard (one all-gather, or the prefetched one) -> kUnsharded
//   post_forward  : outputs get the pre-backward hook; after the last member call, reshard
//   pre_backward  : unshard again (one all-gather, or the prefetched one); flat grad prepared
//                   (with sync on, gradients are copied into it by the reduction, off the
//                   compute stream)
//   post_backward : when every parameter's AccumulateGrad has run (or at the end of backward for
//                   parameters that got no gradient): one reduce-scatter into the master
//                   shard's grad, then reshard.
// SHARD_GRAD_OP keeps the unit unsharded from forward to the end of its backward. NO_SHARD keeps
// it unsharded always and all-reduces gradients instead.
// Units are created by fully_shard() and driven by flatshard::call() and autograd; users only
// read their info and counters.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "flat_param/flat_param.h"
#include "fsdp/options.h"
#include "fsdp/stream_event.h"
#include "wrap_policies/plan.h"

namespace torch {
namespace nn {
class Module;
}
namespace autograd {
struct Node;
}
}  // namespace torch

namespace flatshard {

class Runtime;

enum class UnitState { kSharded, kUnsharded };

// Collectives issued by one unit since the last reset.
struct UnitCounters {
  int64_t forward_all_gathers = 0;
  int64_t backward_all_gathers = 0;
  int64_t reduce_scatters = 0;
  int64_t all_reduces = 0;     // NO_SHARD units (with HSDP: over the shard, then replicate group)
  // HSDP: all-reduces of sharded units' gradient shards across the replicate group (one per
  // reduce-scatter when there are replicas; 0 without HSDP).
  int64_t replicate_all_reduces = 0;
  int64_t bytes = 0;  // bytes this rank sent into those collectives (replicate ones included)
  int64_t replicate_bytes = 0;  // of which across the replicate group (inter-node with HSDP)
  UnitCounters& operator+=(const UnitCounters& o);
};

class Unit {
 public:
  Unit(int index, UnitSpec spec, ShardingStrategy strategy, bool reshard_after_forward,
       std::vector<const torch::nn::Module*> members, std::vector<ParamRef> params,
       Runtime& runtime, const FlatParamConfig& flat_config);
  ~Unit();
  Unit(const Unit&) = delete;
  Unit& operator=(const Unit&) = delete;

  int index() const { return index_; }
  const std::string& name() const { return spec_.name; }
  const UnitSpec& spec() const { return spec_; }
  ShardingStrategy strategy() const { return strategy_; }
  bool reshard_after_forward() const { return reshard_after_forward_; }
  bool is_root() const { return spec_.is_root; }
  UnitState state() const { return state_; }
  FlatParam& flat() { return *flat_; }
  const FlatParam& flat() const { return *flat_; }
  const std::vector<const torch::nn::Module*>& members() const { return members_; }
  const UnitCounters& counters() const { return counters_; }
  void reset_counters() { counters_ = UnitCounters{}; }

  // --- driven by flatshard::call --------------------------------------------------------
  void pre_forward(const torch::nn::Module* member);
  void post_forward(const torch::nn::Module* member, std::vector<at::Tensor>& outputs);

  // --- driven by autograd and the runtime -----------------------------------------------
  void pre_backward();
  void on_grad_accumulated(size_t param_index);  // one parameter's AccumulateGrad finished
  void post_backward();        // reduce (if syncing) + reshard; idempotent per backward
  // Gathers the parameters if sharded (counted as a forward or backward all-gather).
  void unshard(bool for_backward);
  // Orders the compute stream after this unit's pending all-gather (no-op if none).
  void wait_unsharded();
  void reshard();
  // End of a backward pass: clears per-step state.
  void reset_step_state();

  bool called_in_forward() const { return called_in_forward_; }
  bool post_backward_done() const { return post_backward_done_; }

 private:
  bool has_collectives() const { return flat_->layout().padded_numel > 0; }

  int index_;
  UnitSpec spec_;
  ShardingStrategy strategy_;
  bool reshard_after_forward_;
  std::vector<const torch::nn::Module*> members_;
  Runtime& rt_;
  std::unique_ptr<FlatParam> flat_;
  UnitState state_ = UnitState::kSharded;
  UnitCounters counters_;

  // Recorded on the all-gather stream after unshard(); the compute stream waits on it before
  // the parameters are read.
  StreamEvent all_gather_done_;
  bool all_gather_pending_ = false;
  // Recorded on the compute stream when the unit reshards; the all-gather stream waits on it
  // so memory freed to its pool is not rewritten while compute still reads it.
  StreamEvent compute_done_;
  // Scratch: orders a side stream after the compute stream's queued work.
  StreamEvent scratch_;
  // Recorded on the reduce-scatter stream after this unit's reduction.
  StreamEvent reduce_done_;

  // AccumulateGrad nodes of our parameters, held so the post hooks we add stay installed
  // (autograd caches them only weakly).
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators_;
  std::vector<uintptr_t> hook_keys_;

  // Per-step state (reset at the end of backward).
  int64_t member_calls_ = 0;      // flatshard::call entries in this forward
  bool called_in_forward_ = false;
  bool pre_backward_done_ = false;
  int64_t grads_ready_ = 0;       // AccumulateGrad post hooks fired in this backward
  bool post_backward_done_ = false;
};

}  // namespace flatshard
