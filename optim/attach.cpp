#include "optim/attach.h"

#include <c10/util/Exception.h>

#include "collectives/env.h"
#include "flat_param/collective_plan.h"
#include "flat_param/flat_param.h"

namespace flatshard {

namespace {

// Note [Compute copy in the step]: per unit that keeps a device copy, its master and shard
// views paired with their parts of the copy.
std::vector<FusedAdamW::ComputeCopies> compute_copies(const AttachTarget& target) {
  std::vector<FusedAdamW::ComputeCopies> copies;
  const std::weak_ptr<const void> alive = target.alive;
  for (const FlatParam* flat : target.units) {
    StepCopy* step = flat->gather_plan().extras().step;
    if (step == nullptr) continue;
    const at::Tensor& copy = step->tensor();
    FusedAdamW::ComputeCopies set;
    set.tensors.emplace_back(flat->master(), copy);
    for (const auto& v : flat->shard_views())
      if (v.numel() > 0) set.tensors.emplace_back(v.tensor, copy.narrow(0, v.begin, v.numel()));
    // The optimizer may outlive the model: then its copies are never current again.
    set.current = [alive, step] { return !alive.expired() && step->current(); };
    set.written = [alive, step] {
      if (!alive.expired()) step->mark_current();
    };
    copies.push_back(std::move(set));
  }
  return copies;
}

}  // namespace

void attach(const std::shared_ptr<FusedAdamW>& opt, const AttachTarget& target) {
  TORCH_CHECK(opt != nullptr, "attach_optimizer: the optimizer is null (rank ", target.rank, ")");
  std::vector<FusedAdamW::ComputeCopies> copies = compute_copies(target);
  TORCH_CHECK(target.attach_offload || !copies.empty(), "attach_optimizer (rank ", target.rank,
              "): nothing here for the optimizer to be attached to: flatshard steps offloaded "
              "units itself only with ShardingOptions::offload_step = OffloadStep::kBackward or "
              "kDelayed, and writes device compute copies in the step only for NO_SHARD units "
              "below fp32 and for sharded ones with ShardingOptions::keep_compute_shard (Note "
              "[Compute copy in the step]); this model has neither, so call opt.step() as usual");
  if (target.check) target.check(*opt);
  opt->set_compute_copies(env::step_compute_copy() ? std::move(copies)
                                                   : std::vector<FusedAdamW::ComputeCopies>{});
  if (target.attach_offload) target.attach_offload(opt);
}

}  // namespace flatshard
