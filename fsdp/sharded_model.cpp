#include "fsdp/sharded_model.h"

#include <torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "collectives/env.h"
#include "flat_param/collective_plan.h"
#include "flat_param/offload_state.h"
#include "fsdp/call.h"
#include "fsdp/offload_step.h"
#include "fsdp/resolve.h"
#include "fsdp/runtime.h"
#include "fsdp/setup.h"
#include "fsdp/tensor_parallel.h"
#include "optim/fused_adamw.h"

namespace flatshard {

ShardedModel::ShardedModel(std::shared_ptr<torch::nn::Module> model, Plan plan,
                           Communicator& comm, ShardingOptions options)
    : ShardedModel(std::move(model), std::move(plan), ShardingMesh(comm), std::move(options)) {}

ShardedModel::ShardedModel(std::shared_ptr<torch::nn::Module> model, Plan plan,
                           const ShardingMesh& mesh, ShardingOptions options)
    : model_(std::move(model)), plan_(std::move(plan)), mesh_(mesh), comm_(mesh_.shard()) {
  runtime_ = detail::setup_runtime(model_, plan_, mesh_, std::move(options));
  mesh_.reset_counters();
}

ShardedModel::~ShardedModel() {
  if (!runtime_) return;
  for (auto& u : runtime_->units())
    for (const torch::nn::Module* m : u->members()) detail::unregister_member(m);
}

const ShardingOptions& ShardedModel::options() const { return runtime_->options(); }

std::vector<at::Tensor> ShardedModel::parameters() const {
  std::vector<at::Tensor> out;
  for (auto& u : runtime_->units()) {
    const FlatParam& f = u->flat();
    if (f.layout().padded_numel == 0 || !f.any_trainable()) continue;
    if (f.all_trainable()) {
      out.push_back(f.master());
      continue;
    }
    for (size_t i = 0; i < f.params().size(); ++i)
      if (f.trainable(i) && f.shard_views()[i].numel() > 0)
        out.push_back(f.shard_views()[i].tensor);
  }
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> ShardedModel::named_parameters() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& u : runtime_->units()) {
    FlatParam& f = u->flat();
    f.set_views_active(true);
    for (size_t i = 0; i < f.params().size(); ++i)
      out.emplace_back(f.params()[i].name, f.shard_views()[i].tensor);
  }
  return out;
}

size_t ShardedModel::num_units() const { return runtime_->units().size(); }

const Unit& ShardedModel::unit(size_t i) const {
  TORCH_CHECK(i < runtime_->units().size(), "ShardedModel::unit(", i, "): there are ",
              runtime_->units().size(), " units");
  return *runtime_->units()[i];
}

Unit& ShardedModel::unit(size_t i) {
  TORCH_CHECK(i < runtime_->units().size(), "ShardedModel::unit(", i, "): there are ",
              runtime_->units().size(), " units");
  return *runtime_->units()[i];
}

std::vector<UnitInfo> ShardedModel::units() const {
  std::vector<UnitInfo> out;
  for (auto& u : runtime_->units()) {
    const auto& l = u->flat().layout();
    out.push_back(UnitInfo{u->name(), u->strategy(), u->reshard_after_forward(), l.used_numel,
                           l.padded_numel, u->flat().master().numel(), u->flat().params().size(),
                           u->flat().step_copy() != nullptr});
  }
  return out;
}

StepCounters ShardedModel::counters() const {
  StepCounters c;
  for (auto& u : runtime_->units()) {
    c.per_unit.push_back(u->counters());
    c.total += u->counters();
  }
  return c;
}

void ShardedModel::reset_counters() {
  for (auto& u : runtime_->units()) u->reset_counters();
}

void ShardedModel::set_requires_gradient_sync(bool sync) {
  TORCH_CHECK(!runtime_->in_backward(),
              "set_requires_gradient_sync cannot be called during backward");
  runtime_->set_requires_grad_sync(sync);
}

void ShardedModel::attach_optimizer(std::shared_ptr<FusedAdamW> opt) {
  TORCH_CHECK(opt != nullptr, "attach_optimizer: the optimizer is null (rank ", comm_.rank(), ")");
  const auto& stepper = runtime_->offload_stepper();
  // Note [Compute copy in the step] (optim/fused_adamw.h): per unit that keeps a device copy,
  // its master and shard views paired with their parts of the copy.
  std::vector<FusedAdamW::ComputeCopies> copies;
  const std::weak_ptr<char> alive = alive_;
  for (auto& u : runtime_->units()) {
    FlatParam* flat = &u->flat();
    StepCopy* step = flat->step_copy();
    if (step == nullptr) continue;
    const at::Tensor& copy = step->tensor();
    FusedAdamW::ComputeCopies set;
    set.tensors.emplace_back(flat->master(), copy);
    for (const auto& v : flat->shard_views())
      if (v.numel() > 0) set.tensors.emplace_back(v.tensor, copy.narrow(0, v.begin, v.numel()));
    // The optimizer may outlive this model: then its copies are never current again.
    set.current = [alive, step] { return !alive.expired() && step->current(); };
    set.written = [alive, step] {
      if (!alive.expired()) step->mark_current();
    };
    copies.push_back(std::move(set));
  }
  TORCH_CHECK(stepper != nullptr || !copies.empty(), "attach_optimizer (rank ", comm_.rank(),
              "): nothing here for the optimizer to be attached to: flatshard steps offloaded "
              "units itself only with ShardingOptions::offload_step = OffloadStep::kBackward or "
              "kDelayed, and writes device compute copies in the step only for NO_SHARD units "
              "below fp32 and for sharded ones with ShardingOptions::keep_compute_shard (Note "
              "[Compute copy in the step]); this model has neither, so call opt.step() as usual");
  check_optimizer(*opt);
  opt->set_compute_copies(env::step_compute_copy() ? std::move(copies)
                                                   : std::vector<FusedAdamW::ComputeCopies>{});
  if (stepper == nullptr) return;
  std::vector<FlatParam*> flats;
  std::vector<int> trace_units;
  for (auto& u : runtime_->units()) {
    flats.push_back(&u->flat());
    trace_units.push_back(u->trace_info().index);
  }
  stepper->attach(opt, flats, trace_units);
  std::weak_ptr<OffloadStepper> weak = stepper;
  // Note [Delayed offload step]: delayed steps run on through the next forward; opt.step()
  // finds the offloaded units without gradients and steps the rest.
  if (stepper->delayed()) {
    opt->set_before_step(nullptr);
    return;
  }
  opt->set_before_step([weak] {
    if (auto s = weak.lock()) s->wait();
  });
}

void ShardedModel::wait_offload_steps() const { runtime_->wait_offload_steps(); }

void ShardedModel::sync_offload_params() {
  wait_offload_steps();
  for (auto& u : runtime_->units())
    if (OffloadCopy* c = u->flat().offload_copy()) c->release_hold();
}

double ShardedModel::clip_grad_norm_(double max_norm, bool error_if_nonfinite) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(max_norm > 0, "clip_grad_norm_: max_norm must be positive, got ", max_norm);
  wait_offload_steps();
  const bool stepped_in_backward =
      runtime_->offload_stepper() != nullptr && runtime_->any_offloaded();
  TORCH_CHECK(!stepped_in_backward, "clip_grad_norm_ (rank ", comm_.rank(),
              "): with offload_step = ",
              runtime_->offload_stepper()->delayed() ? "delayed" : "backward",
              " the offloaded units' steps took their gradients during backward, before the "
              "global norm was known, so clipping cannot apply to them. Use the default "
              "offload_step (after backward) to clip (Note [Offload step in backward], "
              "fsdp/offload_step.h)");
  // One squared norm per unit, summed across ranks in one all-reduce: the total is their sum,
  // and a non-finite total can name the first unit it comes from (any rank's shard).
  const auto& units = runtime_->units();
  at::Tensor sumsq = at::zeros({static_cast<int64_t>(units.size())},
                               at::TensorOptions().dtype(at::kFloat).device(comm_.device()));
  // Tensor parallelism (fsdp/tensor_parallel.h): a split parameter's slices are summed over
  // the tp group; a replicated one (equal on every tp rank) is counted on tp rank 0 only.
  Communicator* tp_group = mesh_.tp();
  const TensorParallel* tp = tp_group ? find_tensor_parallel(model_.get()) : nullptr;
  for (size_t i = 0; i < units.size(); ++i) {
    units[i]->flat().absorb_view_grads();  // zero_grad on the views since the reduction
    const at::Tensor& g = units[i]->flat().master().grad();
    if (!g.defined()) continue;
    // A replicated unit's gradient is identical on every rank: count it on rank 0 only.
    const bool no_shard = units[i]->strategy() == ShardingStrategy::kNoShard;
    if (no_shard && comm_.rank() != 0) continue;
    // Note [Low-precision master gradient]: a bf16 / fp16 gradient's norm in fp32.
    const at::Tensor g32 = g.to(at::kFloat);  // g if fp32
    if (tp == nullptr || tp->tp_rank() == 0) {
      sumsq[static_cast<int64_t>(i)].copy_(g32.pow(2).sum());
      continue;
    }
    // Other tp ranks: only the split parameters' parts of this rank's shard.
    const FlatParam& flat = units[i]->flat();
    const FlatLayout& layout = flat.layout();
    const int64_t begin = no_shard ? 0 : layout.shard_begin(comm_.rank());
    const int64_t end = begin + g32.numel();
    for (size_t j = 0; j < flat.params().size(); ++j) {
      if (!tp->is_split(flat.params()[j].param)) continue;
      const int64_t lo = std::max(begin, layout.offsets[j]);
      const int64_t hi = std::min(end, layout.offsets[j] + layout.numels[j]);
      if (hi > lo) sumsq[static_cast<int64_t>(i)].add_(g32.narrow(0, lo - begin, hi - lo).pow(2).sum());
    }
  }
  if (!units.empty()) comm_.all_reduce(sumsq, ReduceOp::kSum, comm_.current_stream());
  if (!units.empty() && tp != nullptr)
    tp_group->all_reduce(sumsq, ReduceOp::kSum, tp_group->current_stream());
  const at::Tensor per_unit = sumsq.to(at::kDouble).cpu();
  const double total = std::sqrt(per_unit.sum().item<double>());
  if (error_if_nonfinite && !std::isfinite(total)) {
    const double* v = per_unit.data_ptr<double>();
    size_t first = 0;
    while (first + 1 < units.size() && std::isfinite(v[first])) ++first;
    TORCH_CHECK(false, "clip_grad_norm_: the total gradient norm is ", total, " (rank ",
                comm_.rank(), "); the first unit with a non-finite gradient is '",
                units[first]->name(), "' (squared norm ", v[first],
                "). Gradients were left unchanged; pass error_if_nonfinite=false to clip "
                "anyway (as torch.nn.utils.clip_grad_norm_)");
  }
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    for (auto& u : units) {
      at::Tensor g = u->flat().master().grad();
      if (!g.defined()) continue;
      if (g.scalar_type() == at::kFloat) {
        g.mul_(coef);
      } else {  // Note [Low-precision master gradient]: scaled in fp32, rounded once
        g.copy_(g.to(at::kFloat).mul_(coef));
      }
    }
  }
  return total;
}

TraceScope ShardedModel::trace_optimizer_step() {
  return TraceScope(runtime_->tracer(), TraceKind::kOptimizer, nullptr);
}

std::string ShardedModel::write_trace() {
  return runtime_->tracer() ? runtime_->tracer()->write() : std::string();
}

Tracer* ShardedModel::tracer() const { return runtime_->tracer(); }

std::vector<std::pair<std::string, at::Tensor>> ShardedModel::gather_full_params() const {
  return gather_full(/*grads=*/false);
}

std::vector<std::pair<std::string, at::Tensor>> ShardedModel::gather_full_grads() const {
  return gather_full(/*grads=*/true);
}

std::vector<std::pair<std::string, at::Tensor>> ShardedModel::gather_full(bool grads) const {
  at::NoGradGuard no_grad;
  wait_offload_steps();
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& u : runtime_->units()) {
    FlatParam& f = u->flat();
    if (grads) f.absorb_view_grads();  // zero_grad on the views since the reduction
    const FlatLayout& l = f.layout();
    at::Tensor local = f.master();
    if (grads)
      local = f.master().grad().defined()
                  ? f.master().grad()
                  : at::zeros_like(local, local.options().dtype(f.config().grad_dtype()));
    const at::Tensor full = f.gather_whole(local);
    for (size_t i = 0; i < f.params().size(); ++i)
      out.emplace_back(f.params()[i].name,
                       full.narrow(0, l.offsets[i], l.numels[i]).view(l.shapes[i]).clone());
  }
  // Tied parameters are stored once; list them under every name the model has for them.
  for (const auto& [first, others] : plan_.tied) {
    for (size_t i = 0; i < out.size(); ++i) {
      if (out[i].first != first) continue;
      for (const auto& other : others) out.emplace_back(other, out[i].second);
      break;
    }
  }
  return out;
}

std::unique_ptr<ShardedModel> fully_shard(std::shared_ptr<torch::nn::Module> model,
                                          const Plan& plan, Communicator& comm,
                                          ShardingOptions options) {
  return std::make_unique<ShardedModel>(std::move(model), plan, comm, std::move(options));
}

std::unique_ptr<ShardedModel> fully_shard(std::shared_ptr<torch::nn::Module> model,
                                          const Policy& policy, Communicator& comm,
                                          ShardingOptions options) {
  TORCH_CHECK(model != nullptr, "fully_shard: model is null");
  Plan plan = make_plan(*model, policy);
  check_recompute_policy(policy, *model, plan);  // recompute on the root's type (fsdp/resolve.h)
  return fully_shard(model, plan, comm, std::move(options));
}

std::unique_ptr<ShardedModel> fully_shard(std::shared_ptr<torch::nn::Module> model,
                                          const Plan& plan, const ShardingMesh& mesh,
                                          ShardingOptions options) {
  return std::make_unique<ShardedModel>(std::move(model), plan, mesh, std::move(options));
}

std::unique_ptr<ShardedModel> fully_shard(std::shared_ptr<torch::nn::Module> model,
                                          const Policy& policy, const ShardingMesh& mesh,
                                          ShardingOptions options) {
  TORCH_CHECK(model != nullptr, "fully_shard: model is null");
  Plan plan = make_plan(*model, policy);
  check_recompute_policy(policy, *model, plan);  // recompute on the root's type (fsdp/resolve.h)
  return fully_shard(model, plan, mesh, std::move(options));
}

}  // namespace flatshard
