// ShardedModel::check_optimizer: is the optimizer built on the master shards?
//
// Why a separate check: an optimizer built on model->parameters() after fully_shard compiles,
// runs and does nothing (those parameters are views of gathered buffers whose .grad flatshard
// clears after reducing), so the mistake shows up only as a loss that does not fall.
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <unordered_map>
#include <unordered_set>

#include "fsdp/sharded_model.h"

namespace flatshard {

void ShardedModel::check_optimizer(const torch::optim::Optimizer& opt) const {
  const int rank = comm_.rank();
  // What an optimizer may hold: per unit its master or its parameters' shard views (Note
  // [Original-parameter views]); frozen views are allowed (they never get a gradient).
  struct Target {
    size_t unit;
    int64_t view;  // -1: the master
  };
  std::unordered_map<const c10::TensorImpl*, Target> targets;
  for (size_t i = 0; i < num_units(); ++i) {
    const FlatParam& f = unit(i).flat();
    if (f.layout().padded_numel == 0) continue;
    targets.emplace(f.master().unsafeGetTensorImpl(), Target{i, -1});
    for (size_t k = 0; k < f.shard_views().size(); ++k)
      targets.emplace(f.shard_views()[k].tensor.unsafeGetTensorImpl(),
                      Target{i, static_cast<int64_t>(k)});
  }
  std::unordered_map<const c10::TensorImpl*, std::string> originals;
  for (const auto& item : model_->named_parameters(/*recurse=*/true))
    originals.emplace(item.value().unsafeGetTensorImpl(), item.key());

  std::vector<bool> has_master(num_units(), false);
  std::vector<std::vector<bool>> has_view(num_units());
  for (size_t i = 0; i < num_units(); ++i)
    has_view[i].assign(unit(i).flat().params().size(), false);
  const auto& groups = opt.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t k = 0; k < params.size(); ++k) {
      const c10::TensorImpl* impl = params[k].unsafeGetTensorImpl();
      auto t = targets.find(impl);
      if (t != targets.end()) {
        const Target& x = t->second;
        (x.view < 0 ? has_master[x.unit] : has_view[x.unit][static_cast<size_t>(x.view)]) = true;
        continue;
      }
      auto it = originals.find(impl);
      TORCH_CHECK(it == originals.end(), "check_optimizer (rank ", rank,
                  "): the optimizer's param group ", g, " index ", k,
                  " is the model's original parameter '", it->second,
                  "', not a master shard; it never receives a gradient after fully_shard, so "
                  "the optimizer would not train it. Build the optimizer on "
                  "ShardedModel::parameters() or named_parameters()");
      TORCH_CHECK(false, "check_optimizer (rank ", rank, "): the optimizer's param group ", g,
                  " index ", k, " (sizes ", params[k].sizes(),
                  ") is not one of ShardedModel::parameters() or named_parameters(); build the "
                  "optimizer on them");
    }
  }
  std::string missing;
  for (size_t i = 0; i < num_units(); ++i) {
    const FlatParam& f = unit(i).flat();
    if (f.layout().padded_numel == 0 || !f.any_trainable()) continue;
    bool any_view = false;
    for (bool b : has_view[i]) any_view = any_view || b;
    TORCH_CHECK(!(has_master[i] && any_view), "check_optimizer (rank ", rank, "): the optimizer "
                "holds both the master shard of unit '", unit(i).name(), "' and views of its "
                "parameters: they share memory, so each step would update them twice. Build "
                "it on parameters() or on named_parameters(), not both");
    TORCH_CHECK(!any_view || f.views_active() || has_master[i], "check_optimizer (rank ", rank,
                "): the optimizer holds shard views of unit '", unit(i).name(), "', but they "
                "get no gradients: take them from ShardedModel::named_parameters()");
    if (has_master[i]) continue;
    for (size_t k = 0; k < f.params().size(); ++k) {
      if (!f.trainable(k) || f.shard_views()[k].numel() == 0 || has_view[i][k]) continue;
      missing += (missing.empty() ? "'" : ", '") + f.params()[k].name + "'";
    }
  }
  if (!missing.empty())
    TORCH_WARN("check_optimizer (rank ", rank, "): the optimizer holds neither the master shard "
               "nor the shard view of the trainable parameter(s) ", missing,
               "; they will not be trained");
}

}  // namespace flatshard
