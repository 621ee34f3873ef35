#include "fsdp/sharded_model.h"

#include <torch/nn/module.h>

#include <cmath>
#include <unordered_map>
#include <unordered_set>

#include "fsdp/fingerprint.h"
#include "collectives/env.h"
#include "fsdp/runtime.h"

namespace flatshard {

namespace {
Communicator& checked_shard(const ShardingMesh& mesh) {
  mesh.check();
  return *mesh.shard;
}
}  // namespace

ShardedModel::ShardedModel(std::shared_ptr<torch::nn::Module> model, Plan plan,
                           Communicator& comm, ShardingOptions options)
    : ShardedModel(std::move(model), std::move(plan), ShardingMesh(comm), std::move(options)) {}

ShardedModel::ShardedModel(std::shared_ptr<torch::nn::Module> model, Plan plan,
                           const ShardingMesh& mesh, ShardingOptions options)
    : model_(std::move(model)), plan_(std::move(plan)), comm_(checked_shard(mesh)), mesh_(mesh) {
  TORCH_CHECK(model_ != nullptr, "fully_shard: model is null");
  TORCH_CHECK(!plan_.units.empty() && plan_.units.front().is_root,
              "fully_shard: the plan must start with the root unit (use make_plan)");
  runtime_ = std::make_unique<Runtime>(comm_, options, mesh_.hybrid() ? mesh_.replicate : nullptr);
  // Before any other collective: ranks that disagree fail here, naming the difference. With
  // HSDP, also across replicas (rank j of replica i is global rank i * S + j).
  const auto fingerprint = setup_fingerprint(*model_, plan_, runtime_->options(), comm_);
  check_ranks_agree(fingerprint, comm_);
  if (mesh_.hybrid()) {
    const int S = comm_.world_size(), j = comm_.rank();
    check_ranks_agree(fingerprint, *mesh_.replicate, [S, j](int i) { return i * S + j; });
  }
  const int rank = comm_.rank();

  std::unordered_map<std::string, at::Tensor> params_by_name;
  for (const auto& item : model_->named_parameters(/*recurse=*/true))
    params_by_name.emplace(item.key(), item.value());
  std::unordered_map<std::string, const torch::nn::Module*> modules_by_path;
  for (const auto& item : model_->named_modules("", /*include_self=*/true))
    modules_by_path.emplace(item.key(), item.value().get());

  std::unordered_set<const c10::TensorImpl*> claimed;
  const auto& mp = runtime_->options().mixed_precision;
  for (size_t i = 0; i < plan_.units.size(); ++i) {
    const UnitSpec& spec = plan_.units[i];
    const ShardingStrategy strategy = spec.options.strategy.value_or(options.strategy);
    const bool reshard = spec.options.reshard_after_forward.value_or(
        spec.is_root ? false : options.reshard_after_forward);

    std::vector<const torch::nn::Module*> members;
    if (spec.is_root) {
      members.push_back(model_.get());
    } else {
      TORCH_CHECK(!spec.module_paths.empty(), "fully_shard: unit '", spec.name,
                  "' has no member modules");
      for (const auto& path : spec.module_paths) {
        auto it = modules_by_path.find(path);
        TORCH_CHECK(it != modules_by_path.end(), "fully_shard: unit '", spec.name,
                    "' names module '", path, "', which the model does not have (rank ", rank,
                    "); was the plan made for another model?");
        members.push_back(it->second);
      }
    }

    std::vector<ParamRef> params;
    for (const auto& name : spec.param_names) {
      auto it = params_by_name.find(name);
      TORCH_CHECK(it != params_by_name.end(), "fully_shard: unit '", spec.name,
                  "' names parameter '", name, "', which the model does not have (rank ", rank,
                  ")");
      const at::Tensor& p = it->second;
      TORCH_CHECK(claimed.insert(p.unsafeGetTensorImpl()).second, "fully_shard: parameter '",
                  name, "' is claimed by more than one unit (second: '", spec.name, "')");
      TORCH_CHECK(p.device() == comm_.device(), "fully_shard: parameter '", name, "' is on ",
                  p.device(), " but the communicator of rank ", rank, " works on ",
                  comm_.device(), "; move the model there before sharding it");
      params.push_back(ParamRef{name, p});
    }

    FlatParamConfig cfg;
    cfg.sharded = strategy != ShardingStrategy::kNoShard;
    cfg.param_dtype = mp.param_dtype;
    cfg.reduce_dtype = mp.reduce_dtype.value_or(mp.param_dtype);
    cfg.align = runtime_->options().align;
    cfg.sync_module_states = runtime_->options().sync_module_states;
    cfg.poison_padding = env::debug();
    runtime_->units().push_back(std::make_unique<Unit>(static_cast<int>(i), spec, strategy,
                                                       reshard, std::move(members),
                                                       std::move(params), *runtime_, cfg));
  }
  for (const auto& item : params_by_name) {
    TORCH_CHECK(claimed.count(item.second.unsafeGetTensorImpl()), "fully_shard: parameter '",
                item.first, "' belongs to no unit of the plan (rank ", rank,
                "); was the plan made for another model?");
  }
  // Register members last, so a failure above leaves nothing registered.
  std::vector<const torch::nn::Module*> registered;
  try {
    for (auto& u : runtime_->units()) {
      const auto& paths = u->spec().module_paths;
      for (size_t k = 0; k < u->members().size(); ++k) {
        detail::register_member(u->members()[k], u.get(), paths.empty() ? "<root>" : paths[k]);
        registered.push_back(u->members()[k]);
      }
    }
  } catch (...) {
    for (const auto* m : registered) detail::unregister_member(m);
    runtime_.reset();
    throw;
  }
  comm_.reset_counters();
  if (mesh_.replicate) mesh_.replicate->reset_counters();
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
    if (u->flat().layout().padded_numel > 0) out.push_back(u->flat().master());
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
                           l.padded_numel, u->flat().master().numel(), u->flat().params().size()});
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

double ShardedModel::clip_grad_norm_(double max_norm) {
  at::NoGradGuard no_grad;
  TORCH_CHECK(max_norm > 0, "clip_grad_norm_: max_norm must be positive, got ", max_norm);
  at::Tensor sumsq = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(comm_.device()));
  for (auto& u : runtime_->units()) {
    const at::Tensor& g = u->flat().master().grad();
    if (!g.defined()) continue;
    // A replicated unit's gradient is identical on every rank: count it on rank 0 only.
    if (u->strategy() == ShardingStrategy::kNoShard && comm_.rank() != 0) continue;
    sumsq.add_(g.pow(2).sum());
  }
  comm_.all_reduce(sumsq, ReduceOp::kSum, comm_.current_stream());
  const double total = std::sqrt(sumsq.item<double>());
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    for (auto& u : runtime_->units()) {
      at::Tensor g = u->flat().master().grad();
      if (g.defined()) g.mul_(coef);
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
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& u : runtime_->units()) {
    const FlatParam& f = u->flat();
    const FlatLayout& l = f.layout();
    at::Tensor master = f.master().detach();
    if (grads) master = f.master().grad().defined() ? f.master().grad() : at::zeros_like(master);
    at::Tensor full = master;
    if (f.config().sharded && l.padded_numel > 0) {
      full = at::empty({l.padded_numel}, master.options());
      comm_.all_gather(master, full, comm_.current_stream());
    }
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
  return fully_shard(model, make_plan(*model, policy), comm, std::move(options));
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
  return fully_shard(model, make_plan(*model, policy), mesh, std::move(options));
}

}  // namespace flatshard
