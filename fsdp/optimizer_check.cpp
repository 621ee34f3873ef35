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
  std::unordered_map<const c10::TensorImpl*, std::string> masters;
  for (size_t i = 0; i < num_units(); ++i) {
    const Unit& u = unit(i);
    if (u.flat().layout().padded_numel > 0)
      masters.emplace(u.flat().master().unsafeGetTensorImpl(), u.name());
  }
  std::unordered_map<const c10::TensorImpl*, std::string> originals;
  for (const auto& item : model_->named_parameters(/*recurse=*/true))
    originals.emplace(item.value().unsafeGetTensorImpl(), item.key());

  std::unordered_set<const c10::TensorImpl*> seen;
  const auto& groups = opt.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (size_t k = 0; k < params.size(); ++k) {
      const c10::TensorImpl* impl = params[k].unsafeGetTensorImpl();
      if (masters.count(impl)) {
        seen.insert(impl);
        continue;
      }
      auto it = originals.find(impl);
      TORCH_CHECK(it == originals.end(), "check_optimizer (rank ", rank,
                  "): the optimizer's param group ", g, " index ", k,
                  " is the model's original parameter '", it->second,
                  "', not a master shard; it never receives a gradient after fully_shard, so "
                  "the optimizer would not train it. Build the optimizer on "
                  "ShardedModel::parameters()");
      TORCH_CHECK(false, "check_optimizer (rank ", rank, "): the optimizer's param group ", g,
                  " index ", k, " (sizes ", params[k].sizes(),
                  ") is not one of ShardedModel::parameters(); build the optimizer on them");
    }
  }
  std::string missing;
  for (const auto& [impl, name] : masters)
    if (!seen.count(impl)) missing += (missing.empty() ? "'" : ", '") + name + "'";
  if (!missing.empty())
    TORCH_WARN("check_optimizer (rank ", rank, "): the optimizer does not hold the master shard "
               "of unit(s) ", missing, "; they will not be trained");
}

}  // namespace flatshard
