#include "fsdp/sharded_model.h"

#include <torch/nn/module.h>

#include <cmath>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "fsdp/call.h"
#include "fsdp/offload_step.h"
#include "fsdp/resolve.h"
#include "fsdp/runtime.h"
#include "fsdp/setup.h"
#include "fsdp/tensor_parallel.h"
#include "optim/attach.h"
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
  for (auto& u : runtime_->units())
    for (at::Tensor& t : u->optimizer_params()) out.push_back(std::move(t));
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> ShardedModel::named_parameters() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& u : runtime_->units())
    for (auto& named : u->named_shard_views()) out.push_back(std::move(named));
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
  for (auto& u : runtime_->units()) out.push_back(u->info());
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
  // The fused optimizer attaches itself (optim/attach.h); the model hands it its units and
  // what only it can do.
  AttachTarget target;
  target.rank = comm_.rank();
  for (auto& u : runtime_->units()) u->offer_to(target);
  target.alive = alive_;
  target.check = [this](const FusedAdamW& o) { check_optimizer(o); };
  OffloadLifecycle& offload = runtime_->offload();
  if (offload.steps_in_backward())
    target.attach_offload = [&offload](const std::shared_ptr<FusedAdamW>& o) { offload.attach(o); };
  attach(opt, target);
}

void ShardedModel::wait_offload_steps() const { runtime_->offload().wait(); }

void ShardedModel::sync_offload_params() { runtime_->offload().sync_params(); }

double ShardedModel::clip_grad_norm_(double max_norm, bool error_if_nonfinite) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(max_norm > 0, "clip_grad_norm_: max_norm must be positive, got ", max_norm);
  wait_offload_steps();
  runtime_->offload().check_clip_grad_norm();  // refused when offloaded units stepped already
  // One squared norm per unit, summed across ranks in one all-reduce: the total is their sum,
  // and a non-finite total can name the first unit it comes from (any rank's shard).
  const auto& units = runtime_->units();
  at::Tensor sumsq = at::zeros({static_cast<int64_t>(units.size())},
                               at::TensorOptions().dtype(at::kFloat).device(comm_.device()));
  // Tensor parallelism (fsdp/tensor_parallel.h): a split parameter's slices are summed over
  // the tp group; a replicated one (equal on every tp rank) is counted on tp rank 0 only.
  Communicator* tp_group = mesh_.tp();
  const TensorParallel* tp = tp_group ? find_tensor_parallel(model_.get()) : nullptr;
  for (size_t i = 0; i < units.size(); ++i)
    units[i]->grad_norm_sq(sumsq[static_cast<int64_t>(i)], tp);
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
  if (coef < 1.0)
    for (auto& u : units) u->scale_grad(coef);
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
  for (auto& u : runtime_->units()) u->gather_full(grads, out);
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
