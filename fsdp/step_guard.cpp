#include "fsdp/step_guard.h"

#include <c10/util/Exception.h>

#include "flat_param/collective_plan.h"
#include "fsdp/unit.h"

namespace flatshard {

namespace {
// Changes when an optimizer step (or any in-place write) reaches the unit's master or a view.
int64_t master_version(const Unit& unit) {
  return unit.flat().gather_plan().args().master_version();
}
}  // namespace

void StepGuard::on_backward_end(const std::vector<std::unique_ptr<Unit>>& units, bool reduced,
                                bool stepped, int rank, bool skip_offloaded) {
  stepped_ = stepped;
  skip_offloaded_ = skip_offloaded;
  versions_.resize(units.size());
  for (size_t i = 0; i < units.size(); ++i)
    versions_[i] = master_version(*units[i]);
  last_ = reduced ? Last::kReduced : Last::kUnreduced;
}

void StepGuard::on_step_start(const std::vector<std::unique_ptr<Unit>>& units, int rank) {
  if (last_ == Last::kNone || versions_.size() != units.size()) return;
  const Last last = last_;
  last_ = Last::kNone;
  const Unit* changed = nullptr;
  bool any_grad = false;
  for (size_t i = 0; i < units.size(); ++i) {
    const at::Tensor& m = units[i]->flat().master();
    if (units[i]->flat().layout().padded_numel == 0) continue;
    if (skip_offloaded_ && units[i]->flat().config().offload > 0) continue;
    any_grad = any_grad || m.grad().defined();
    if (!changed && master_version(*units[i]) != versions_[i]) changed = units[i].get();
  }
  if (last == Last::kUnreduced) {
    TORCH_CHECK(changed == nullptr, "flatshard (rank ", rank, "): the master shard of unit '",
                changed ? changed->name() : "", "' was modified (an optimizer step?) after a "
                "backward pass with set_requires_gradient_sync(false) and before any backward "
                "that reduced gradients: that step used unreduced, stale gradients. Turn "
                "gradient sync back on (set_requires_gradient_sync(true)) before the last "
                "micro-batch's backward and step the optimizer after it");
    return;
  }
  if (changed != nullptr || !any_grad || stepped_) {
    stale_steps_ = 0;
    return;
  }
  if (++stale_steps_ >= kStaleStepsBeforeWarning && !warned_) {
    warned_ = true;
    TORCH_WARN("flatshard (rank ", rank, "): ", stale_steps_, " backward passes in a row reduced "
               "gradients but no master shard changed. Is the optimizer built on the model's "
               "original parameters instead of ShardedModel::parameters()? (They never receive "
               "gradients, so such an optimizer does nothing.) "
               "ShardedModel::check_optimizer(opt) names a foreign parameter. Ignore this if "
               "you deliberately run many backward passes per optimizer step.");
  }
}

}  // namespace flatshard
