// flatshard/fsdp/tensor_parallel.h — tensor parallelism (Megatron's column/row split) on the
// mesh's `tp` dimension, composed with fully_shard on its `shard` dimension.
//
//   Mesh mesh(shard, replicate, tp);                    // collectives/mesh.h; run_mesh on CPU
//   auto tp = parallelize(model, parse_tp_plan(spec), mesh);  // slices, registers the modules
//   auto fsdp = fully_shard(model, policy, mesh);        // units flatten the TP-local slices
//   ... train as usual; keep `tp` alive as long as the model runs.
//
// Contract
// - parallelize() matches the plan (wrap_policies/tp_plan.h) against every module but the root
//   (wrap_policies/match.h: the terms mean what they mean in a wrap policy, aliases included)
//   and replaces each colwise/rowwise module's parameters, in place (Tensor::set_data: the same
//   tensors, new shapes), by this tp rank's slice: colwise keeps rows [k*out/tp, (k+1)*out/tp)
//   of the weight and bias (of each of the K blocks for colwise/K), rowwise columns
//   [k*in/tp, (k+1)*in/tp) of the weight and the whole bias. Every other parameter stays whole
//   (replicated across tp). From then on flatshard::call enters a colwise module through f
//   and leaves a rowwise one through g (fsdp/tp_entry.h), on mesh.tp().
// - The model's forward must read sizes from the tensors, not from its config: a module whose
//   shapes depend on the split (attention: the local head count is heads / tp) implements
//   TensorParallelModule; parallelize() calls its check before changing anything.
// - Errors (c10::Error, nothing changed yet): a rule that matches no module (the plan, the rule,
//   the model's types), a colwise/rowwise module that is not Linear-like (a 2-D `weight`, an
//   optional 1-D `bias`; a vocab module: one 2-D `weight`), sizes tp does not divide (module,
//   sizes, tp), a split parameter shared with another module (tied weights), a model parallelized
//   twice. Meta parameters are sliced as shapes (fully_shard must then load them). Every rank
//   reaches the same decision (same model, plan and sizes).
// - fully_shard on a parallelized model (Mesh with tp): units flatten the TP-local parameters
//   and all-gather / reduce-scatter over mesh.shard() only; gradients of replicated parameters
//   are equal on every tp rank by construction (their upstream gradients are all-reduced by f).
//   The setup fingerprint records the plan and tp size and is compared across the tp group;
//   clip_grad_norm_ sums split parameters over tp and counts replicated ones once. A mesh with
//   tp > 1 over a model that was not parallelized is an error. gather_full_params() and
//   gather_full_grads() give the TP-local values (full over the shard group); local_slice()
//   maps a full value to them. Checkpoints record each parameter's placement (placement(),
//   TpPlacement; the layout's one home is tp_slice / tp_unslice below) and load at any tp size.
// - Sequence and loss parallelism are options of the plan (TpPlan::sequence_parallel,
//   loss_parallel; wrap_policies/tp_plan.h); the model's forward marks the sequence region's
//   edges (sequence_shard / sequence_gather below) and its loss calls
//   vocab_parallel_cross_entropy(). Sequence parallelism needs a `sequence` rule; a split
//   module may not share a parameter with another module (tied embeddings and a colwise head).
// - Kv heads fewer than tp: Note [Replicated kv heads] (tensor_parallel.cpp).
// - A `vocab` module (an Embedding's rows split over tp: Megatron's VocabParallelEmbedding) is
//   entered through tp_enter_vocab / tp_exit_vocab (fsdp/tp_entry.h); its weight's placement is
//   kColwise (dim 0 split), so checkpoints and loaders need nothing new. Refused: a vocabulary
//   tp does not divide, a weight tied to another module, sequence_parallel (not yet).
// - Not yet (issue 51): a vocab embedding under sequence parallelism, deferred init on meta
//   without a loader
//   (a meta-built model is parallelized, shapes only, and must be loaded:
//   ShardingOptions::load, slice_loader; flatshard-bench loads from the family's init).
// - Thread rule: as fully_shard; the registry is shared by all ranks-as-threads.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "collectives/mesh.h"
#include "fsdp/options.h"
#include "wrap_policies/tp_plan.h"

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

// Implemented by a module whose forward depends on how tensor parallelism splits its children
// (attention: whole heads per rank). Called by parallelize() when a direct child is split.
class TensorParallelModule {
 public:
  virtual ~TensorParallelModule() = default;
  // Throws a c10::Error naming `path`, the sizes and `tp` when `tp` ranks cannot split it.
  virtual void check_tensor_parallel(const std::string& path, int tp) const = 0;
  // Note [Replicated kv heads]: the direct children (by name) whose output holds fewer head
  // groups than tp (LLaMA's k and v when n_kv_heads < tp), each with its group count G (tp a
  // multiple of G); the plan's colwise rule then keeps them whole instead of splitting them.
  virtual std::vector<std::pair<std::string, int64_t>> tp_replicated_children(int tp) const {
    (void)tp;
    return {};
  }
};

// Where a parameter lives under tensor parallelism (also the checkpoint manifest's "tp"):
// kColwise splits dim 0 into tp parts (of each of `parts` fused blocks), kRowwise splits dim 1
// (a 2-D weight; a rowwise module's bias is kReplicate), kReplicate keeps it whole.
struct TpPlacement {
  TpStyle style = TpStyle::kReplicate;
  int parts = 1;
  bool operator==(const TpPlacement& o) const { return style == o.style && parts == o.parts; }
  bool operator!=(const TpPlacement& o) const { return !(*this == o); }
};
// "colwise", "colwise/3", "rowwise", "replicate" and back (nullopt for anything else).
std::string to_string(const TpPlacement& p);
std::optional<TpPlacement> parse_tp_placement(const std::string& text);
// Why `full_shape` cannot be split by `tp` ranks at `p` ("" when it can).
std::string tp_split_error(const std::vector<int64_t>& full_shape, const TpPlacement& p, int tp);
// The full shape of a slice of shape `local` (checked split: p's dimension times tp).
std::vector<int64_t> tp_full_shape(std::vector<int64_t> local, const TpPlacement& p, int tp);
// tp rank `rank`'s slice of `full` (contiguous). The one home of the layout.
at::Tensor tp_slice(const at::Tensor& full, const TpPlacement& p, int tp, int rank);
// The inverse: `tp_major` holds the tp slices flattened and concatenated in tp-rank order
// (numel of the full value); returns the full value, shape `full_shape`, contiguous. For
// colwise with one block, tp-major order is the full value's own row-major order.
at::Tensor tp_unslice(const at::Tensor& tp_major, const std::vector<int64_t>& full_shape,
                      const TpPlacement& p, int tp);

// The TP collectives one rank issued (TensorParallel::counters()), over the tp group. Without
// sequence parallelism: an all-reduce of each rowwise module's output in forward and of each
// colwise module's input gradient in backward. With it (TpPlan::sequence_parallel): a colwise
// module's input is all-gathered along the sequence in forward (its gradient reduce-scattered in
// backward), a rowwise module's output reduce-scattered (its gradient all-gathered). Bytes are
// the full tensors' (the reduced or gathered one: numel x element size), so the sequence-parallel
// bytes per layer equal the all-reduce ones. Besides, per step:
//   grad_*      sequence parallelism: the gradient of each parameter that saw sequence shards
//               (`sequence` modules' and rowwise biases) all-reduced over tp, in backward;
//   boundary_*  sequence parallelism: the model's own edges of the sequence region,
//               sequence_shard()'s backward all-gather and sequence_gather()'s forward one;
//   loss_*      loss parallelism: the max, sum-exp and target-logit all-reduces of
//               vocab_parallel_cross_entropy() (fp32, one value per token each).
// explain() predicts all but boundary_* per step (planner/explain.h, TpCollectives).
struct TpCounters {
  int64_t forward_all_reduces = 0, backward_all_reduces = 0;
  int64_t forward_all_gathers = 0, forward_reduce_scatters = 0;
  int64_t backward_all_gathers = 0, backward_reduce_scatters = 0;
  int64_t forward_bytes = 0, backward_bytes = 0;  // every forward / backward collective above
  int64_t grad_all_reduces = 0, grad_bytes = 0;
  int64_t boundary_all_gathers = 0, boundary_bytes = 0;
  int64_t loss_all_reduces = 0, loss_bytes = 0;
  bool operator==(const TpCounters& o) const {
    return forward_all_reduces == o.forward_all_reduces &&
           backward_all_reduces == o.backward_all_reduces &&
           forward_all_gathers == o.forward_all_gathers &&
           forward_reduce_scatters == o.forward_reduce_scatters &&
           backward_all_gathers == o.backward_all_gathers &&
           backward_reduce_scatters == o.backward_reduce_scatters &&
           forward_bytes == o.forward_bytes && backward_bytes == o.backward_bytes &&
           grad_all_reduces == o.grad_all_reduces && grad_bytes == o.grad_bytes &&
           boundary_all_gathers == o.boundary_all_gathers && boundary_bytes == o.boundary_bytes &&
           loss_all_reduces == o.loss_all_reduces && loss_bytes == o.loss_bytes;
  }
  bool operator!=(const TpCounters& o) const { return !(*this == o); }
};

namespace detail {
struct TpCounterCells;
}

struct TpModule {
  std::string path;  // in the model's tree
  TpStyle style = TpStyle::kReplicate;
  int parts = 1;     // colwise/K
  int rule = -1;     // the plan rule that matched it
  // Note [Replicated kv heads]: > 0 for a colwise module whose output's G head groups are
  // fewer than tp: its parameters stay whole (placement kReplicate) and tp rank r uses group
  // r * G / tp of its output; its backward all-reduce is of its output gradient (out features).
  int64_t replicated_groups = 0;
};

class TensorParallel {
 public:
  TensorParallel(const TensorParallel&) = delete;
  TensorParallel& operator=(const TensorParallel&) = delete;
  ~TensorParallel();  // unregisters the modules: flatshard::call no longer splits them

  const TpPlan& plan() const { return plan_; }
  int tp_size() const { return tp_size_; }
  int tp_rank() const { return tp_rank_; }
  // The colwise and rowwise modules, in registration order.
  const std::vector<TpModule>& modules() const { return modules_; }
  // `param` (a parameter of the model) holds a slice, different on each tp rank.
  bool is_split(const at::Tensor& param) const;
  // This rank's slice of the full (unsplit) value of the parameter named `name`
  // (named_parameters()); `full` itself for a replicated one.
  at::Tensor local_slice(const std::string& name, const at::Tensor& full) const;
  // Where the parameter named `name` lives (kReplicate when no split module holds it).
  TpPlacement placement(const std::string& name) const;
  // Note [Loading into shards] under TP: `full` reads full tensors by name (hf_loader,
  // safetensors_loader, checkpoint_loader); the result reads this tp rank's slices. check()
  // gets each split parameter's full shape; read() maps a range of this rank's slice to the
  // runs of the full tensor it covers (colwise: one run per fused block; rowwise: one per row)
  // and reads only those. fully_shard applies it to ShardingOptions::load itself.
  ParamLoader slice_loader(ParamLoader full) const;
  // One line per split module: "colwise/3 blocks.0.attn.qkv", for explain-like output.
  std::string to_string() const;
  // The TP collectives this rank issued since parallelize() or the last reset_counters().
  TpCounters counters() const;
  void reset_counters();
  // Sequence parallelism: the parameters whose gradients are all-reduced over tp (the
  // `sequence` modules' and the rowwise biases that required grad when parallelize() ran:
  // freeze parameters before it, never unfreeze one after), by name, in registration order.
  const std::vector<std::string>& sequence_grads() const { return sequence_grad_names_; }
  // Loss parallelism: the mean cross-entropy of `logits` [..., V / tp] (this rank's vocabulary
  // slice, rows [rank * V/tp, (rank+1) * V/tp) of a colwise head) against `targets` [...] (ids
  // in [0, V), -100 ignored, as at::cross_entropy_loss), computed in fp32 without gathering the
  // logits: three all-reduces of one value per token (max, sum of exp, target logit) forward;
  // backward is local (softmax minus one-hot on the slice). Errors name the sizes.
  at::Tensor vocab_parallel_cross_entropy(const at::Tensor& logits, const at::Tensor& targets,
                                          int64_t vocab) const;

 private:
  friend std::unique_ptr<TensorParallel> parallelize(const std::shared_ptr<torch::nn::Module>&,
                                                     const TpPlan&, const Mesh&);
  friend at::Tensor sequence_shard(const torch::nn::Module&, const at::Tensor&);
  friend at::Tensor sequence_gather(const torch::nn::Module&, const at::Tensor&,
                                    const torch::nn::Module&);
  TensorParallel() = default;
  // Note [Sequence-parallel gradients] (tensor_parallel.cpp).
  static void add_sequence_grad_hooks(const torch::nn::Module& model,
                                      const std::vector<TpModule>& sequence, TensorParallel* tp);
  struct Slice {
    TpStyle style;
    int parts;
    bool is_bias;
    std::vector<int64_t> local_shape;  // this rank's slice
  };
  const torch::nn::Module* root_ = nullptr;
  std::vector<const torch::nn::Module*> registered_;
  TpPlan plan_;
  int tp_size_ = 1, tp_rank_ = 0;
  std::vector<TpModule> modules_;
  std::unordered_set<const void*> split_;  // TensorImpl of each split parameter
  std::map<std::string, Slice> slices_;     // by parameter name
  std::unique_ptr<detail::TpCounterCells> counters_;
  Communicator* group_ = nullptr;  // mesh.tp(): the sequence edges and the loss use it
  // Sequence parallelism: the gradient hooks parallelize() put on the parameters that saw
  // sequence shards (removed by the destructor: they point at counters_).
  std::vector<std::pair<at::Tensor, unsigned>> sequence_hooks_;
  std::vector<std::string> sequence_grad_names_;
};

std::unique_ptr<TensorParallel> parallelize(const std::shared_ptr<torch::nn::Module>& model,
                                            const TpPlan& plan, const Mesh& mesh);

// What parallelize() checks before it changes anything, changing nothing (the one home of the
// matching, shared with explain(): meta parameters are fine here): the colwise and rowwise
// modules `plan` names in `model`, in registration order. Throws parallelize()'s errors
// (prefixed with `where`): a rule that matches nothing, a size>= term, a TensorParallelModule's
// own check (heads), a module that is not Linear-like, sizes `tp` does not divide.
// `sequence`, when given, receives the modules the plan's `sequence` rules match (style
// kSequence), in registration order.
std::vector<TpModule> match_tp_plan(const torch::nn::Module& model, const TpPlan& plan, int tp,
                                    const std::string& where,
                                    std::vector<TpModule>* sequence = nullptr);

// Sequence parallelism (TpPlan::sequence_parallel), for a model's forward (the families call
// them; docs/tensor-parallel.md). Each is the identity when `root` was not parallelized with
// the option (or tp is 1).
// - sequence_shard(root, x): x [B, T, ...] replicated (the embeddings' output) -> this tp
//   rank's part of the sequence, [B, T/tp, ...] (rows [k*T/tp, (k+1)*T/tp) of dim 1); backward
//   all-gathers the gradient along the sequence. T that tp does not divide is an error naming
//   both sizes.
// - sequence_gather(root, x, next): the inverse before a module that needs the whole sequence
//   (a replicated lm_head): all-gather along dim 1 forward, this rank's part of the gradient
//   backward. Also the identity when `next` is a colwise module (its entry gathers).
// - takes_sequence_shards(m): `m` is split and its call gathers or scatters along dim 1, so its
//   input must keep the [B, T, ...] layout (not flattened to [B*T, ...]).
at::Tensor sequence_shard(const torch::nn::Module& root, const at::Tensor& x);
at::Tensor sequence_gather(const torch::nn::Module& root, const at::Tensor& x,
                           const torch::nn::Module& next);
bool takes_sequence_shards(const torch::nn::Module& m);

// The shape tp rank keeps of the parameter `is_bias ? bias : weight` of the split module `m`
// whose full shape is `full` (the layout parallelize() slices to).
std::vector<int64_t> tp_local_shape(const TpModule& m, bool is_bias,
                                    const std::vector<int64_t>& full, int tp);

// The TensorParallel that parallelized `root`, or nullptr.
const TensorParallel* find_tensor_parallel(const torch::nn::Module* root);

}  // namespace flatshard
