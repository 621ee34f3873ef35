#include "fsdp/sharded_model.h"

#include <torch/nn/module.h>

#include <cmath>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "collectives/env.h"
#include "flat_param/collective_plan.h"
#include "flat_param/offload_state.h"
#include "fsdp/buffers.h"
#include "fsdp/call.h"
#include "fsdp/deferred_init.h"
#include "fsdp/fingerprint.h"
#include "optim/fused_adamw.h"
#include "fsdp/offload_step.h"
#include "fsdp/resolve.h"
#include "fsdp/runtime.h"

namespace flatshard {

namespace {

// The model's parameters by name and modules by path: what a plan entry refers to.
struct ModelIndex {
  std::unordered_map<std::string, at::Tensor> params_by_name;
  std::unordered_map<std::string, const torch::nn::Module*> modules_by_path;
};
// Parameters already given to a unit, by identity (tied parameters have several names).
using Claimed = std::unordered_set<const c10::TensorImpl*>;

// `first_rank`: global rank 0 (shard rank 0 of replica 0), the one rank that warns: every rank
// has the same plan, and ranks as threads or processes would print the warning once each.
void check_inputs(const std::shared_ptr<torch::nn::Module>& model, const Plan& plan,
                  const ShardingOptions& options, int rank, bool first_rank) {
  TORCH_CHECK(model != nullptr, "fully_shard: model is null");
  TORCH_CHECK(!plan.units.empty() && plan.units.front().is_root,
              "fully_shard: the plan must start with the root unit (use make_plan)");
  check_recompute_plan(plan);  // Note [Recompute]: no unit nested inside a recompute unit
  const std::string unmatched = plan.unmatched_warning();
  if (!unmatched.empty()) {
    TORCH_CHECK(!options.strict_plan, "fully_shard (strict_plan): ", unmatched, " (rank ", rank,
                ")");
    if (first_rank) TORCH_WARN("fully_shard: ", unmatched);
  }
}

// fully_shard on a model (or part of one) that is already sharded: the parameters are views
// of another ShardedModel's flat buffers and hold no values. Checked before anything is built
// (the first ShardedModel stays intact); local and the same on every rank.
void check_not_sharded(torch::nn::Module& model, int rank) {
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    const detail::UnitEntry e = detail::find_unit(item.value().get());
    TORCH_CHECK(e.unit == nullptr, "fully_shard: module '",
                item.key().empty() ? "<root>" : item.key(),
                "' already belongs to unit '", e.unit->name(),
                "' of a live ShardedModel (rank ", rank,
                "): fully_shard was applied twice to the same model. Keep the first "
                "ShardedModel, or destroy it and shard a fresh model");
  }
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    TORCH_CHECK(!is_guarded_param(item.value()), "fully_shard: parameter '", item.key(),
                "' is already sharded by another fully_shard (rank ", rank,
                "), live or destroyed: its values are in that ShardedModel's master shards. "
                "Shard a fresh model (load it from gather_full_params() or a checkpoint)");
  }
}

// Before any other collective: ranks that disagree fail here, naming the difference (over the
// shard group, then with HSDP across replicas).
void check_setup_agrees(const torch::nn::Module& model, const Plan& plan,
                        const ShardingOptions& options, const Mesh& mesh) {
  check_ranks_agree(setup_fingerprint(model, plan, options, mesh), mesh);
}

// Note [Deferred initialization] (fsdp/deferred_init.h), step 2: a model built on meta gets its
// buffers now (collective, one agree point). With sync_module_states off nothing will make
// them equal, so the fingerprint, which skipped the meta buffers' values, is taken again.
std::optional<detail::DeferredInit> setup_deferred_init(torch::nn::Module& model,
                                                        const Plan& plan,
                                                        const ShardingOptions& options,
                                                        const Mesh& mesh) {
  Communicator& comm = mesh.shard();
  const bool deferred = detail::uses_deferred_init(model, comm.rank());
  TORCH_CHECK(deferred || !options.load, "fully_shard: ShardingOptions::load is set but the "
              "model's parameters hold values (rank ", comm.rank(), "); build the model on the "
              "meta device (flatshard::MetaInit) to load it straight into its shards");
  if (!deferred) return std::nullopt;
  std::optional<detail::DeferredInit> init;
  init.emplace(model, options.init, static_cast<bool>(options.load));
  // Note [Loading into shards]: the loader validates every planned parameter before any unit
  // reads, inside the buffers' agree point, so a rank that cannot load fails every rank.
  std::function<void()> check_loader;
  if (options.load && options.load.check) {
    check_loader = [&model, &plan, &options] {
      std::unordered_map<std::string, at::Tensor> params;
      for (const auto& item : model.named_parameters(/*recurse=*/true))
        params.emplace(item.key(), item.value());
      std::unordered_set<const c10::TensorImpl*> seen;
      std::vector<PlannedParam> planned;
      for (const auto& spec : plan.units) {
        for (const auto& name : spec.param_names) {
          auto it = params.find(name);
          if (it == params.end()) continue;  // build_units names it
          if (!seen.insert(it->second.unsafeGetTensorImpl()).second) continue;
          planned.push_back(PlannedParam{name, it->second.sizes().vec()});
        }
      }
      options.load.check(planned);
    };
  }
  init->materialize_buffers(model, mesh, check_loader);
  if (!options.sync_module_states) check_setup_agrees(model, plan, options, mesh);
  return init;
}

// Buffers are not sharded (fsdp/buffers.h): after the fingerprint agreed on their names,
// shapes and dtypes, cast them per buffer_dtype and, with sync_module_states, make them global
// rank 0's: within the shard group, then across replicas (as flat parameters do).
void setup_buffers(torch::nn::Module& model, const ShardingOptions& options, const Mesh& mesh) {
  cast_buffers(model, options.mixed_precision.buffer_dtype);
  if (!options.sync_module_states) return;
  broadcast_buffers(model, mesh.shard());
  if (Communicator* replicate = mesh.replicate()) broadcast_buffers(model, *replicate);
}

ModelIndex index_model(torch::nn::Module& model) {
  ModelIndex index;
  for (const auto& item : model.named_parameters(/*recurse=*/true))
    index.params_by_name.emplace(item.key(), item.value());
  for (const auto& item : model.named_modules("", /*include_self=*/true))
    index.modules_by_path.emplace(item.key(), item.value().get());
  return index;
}

// The modules whose flatshard::call enters the unit (the model itself for the root).
std::vector<const torch::nn::Module*> unit_members(const UnitSpec& spec, const ModelIndex& index,
                                                   const torch::nn::Module* model, int rank) {
  std::vector<const torch::nn::Module*> members;
  if (spec.is_root) {
    members.push_back(model);
    return members;
  }
  TORCH_CHECK(!spec.module_paths.empty(), "fully_shard: unit '", spec.name,
              "' has no member modules");
  for (const auto& path : spec.module_paths) {
    auto it = index.modules_by_path.find(path);
    TORCH_CHECK(it != index.modules_by_path.end(), "fully_shard: unit '", spec.name,
                "' names module '", path, "', which the model does not have (rank ", rank,
                "); was the plan made for another model?");
    members.push_back(it->second);
  }
  return members;
}

// The unit's parameters, each claimed for it (a parameter belongs to one unit only).
// Deferred: on meta (uses_deferred_init checked that all are); else on comm.device().
std::vector<ParamRef> unit_params(const UnitSpec& spec, const ModelIndex& index,
                                  const Communicator& comm, bool deferred, Claimed& claimed) {
  const int rank = comm.rank();
  std::vector<ParamRef> params;
  for (const auto& name : spec.param_names) {
    auto it = index.params_by_name.find(name);
    TORCH_CHECK(it != index.params_by_name.end(), "fully_shard: unit '", spec.name,
                "' names parameter '", name, "', which the model does not have (rank ", rank,
                ")");
    const at::Tensor& p = it->second;
    TORCH_CHECK(claimed.insert(p.unsafeGetTensorImpl()).second, "fully_shard: parameter '",
                name, "' is claimed by more than one unit (second: '", spec.name, "')");
    TORCH_CHECK(deferred || p.device() == comm.device(), "fully_shard: parameter '", name,
                "' is on ", p.device(), " but the communicator of rank ", rank, " works on ",
                comm.device(), "; move the model there before sharding it, or build it on the "
                "meta device (flatshard::MetaInit) for deferred initialization");
    params.push_back(ParamRef{name, p});
  }
  return params;
}

// One Unit per plan entry, in plan order, with resolve_unit()'s settings (fsdp/resolve.h).
// Deferred (`init` set): each unit's parameters are given memory and values while its Unit is
// built, one unit at a time (Note [Deferred initialization], step 3).
Claimed build_units(const Plan& plan, const ModelIndex& index, const torch::nn::Module* model,
                    Communicator& comm, Runtime& runtime, const detail::DeferredInit* init) {
  Claimed claimed;
  for (size_t i = 0; i < plan.units.size(); ++i) {
    const UnitSpec& spec = plan.units[i];
    const ResolvedUnit settings = resolve_unit(spec, runtime.options(), comm.world_size());
    auto members = unit_members(spec, index, model, comm.rank());
    auto params = unit_params(spec, index, comm, init != nullptr, claimed);
    std::function<void()> fill;
    FlatParam::RangeFill load_ranges;
    if (init && runtime.options().load) {
      // Note [Loading into shards]: each rank reads the ranges of its master shard by name.
      std::vector<std::string> names;
      for (const ParamRef& p : params) names.push_back(p.name);
      load_ranges = [read = runtime.options().load.read, names = std::move(names)](
                        size_t param, int64_t begin, int64_t end, const at::Tensor& dst) {
        read(names[param], begin, end, dst);
      };
    } else if (init) {
      // Runs inside FlatParam's constructor, once the parameters point into its flat buffer.
      // The detached handles share that storage; nothing keeps them after the fill.
      fill = [init, refs = params] {
        for (const ParamRef& p : refs) init->init(p.name, p.param.detach());
      };
    }
    runtime.units().push_back(std::make_unique<Unit>(static_cast<int>(i), spec, settings,
                                                     std::move(members), std::move(params),
                                                     runtime.unit_context(), fill,
                                                     load_ranges));
  }
  return claimed;
}

void check_every_param_claimed(const ModelIndex& index, const Claimed& claimed, int rank) {
  for (const auto& item : index.params_by_name) {
    TORCH_CHECK(claimed.count(item.second.unsafeGetTensorImpl()), "fully_shard: parameter '",
                item.first, "' belongs to no unit of the plan (rank ", rank,
                "); was the plan made for another model?");
  }
}

// Makes flatshard::call find the units. All or nothing: on a failure, what was registered is
// unregistered again before the error propagates.
void register_members(Runtime& runtime) {
  std::vector<const torch::nn::Module*> registered;
  try {
    for (auto& u : runtime.units()) {
      const auto& paths = u->spec().module_paths;
      for (size_t k = 0; k < u->members().size(); ++k) {
        detail::register_member(u->members()[k], &runtime, u.get(),
                                paths.empty() ? "<root>" : paths[k]);
        registered.push_back(u->members()[k]);
      }
    }
  } catch (...) {
    for (const auto* m : registered) detail::unregister_member(m);
    throw;
  }
}

}  // namespace

ShardedModel::ShardedModel(std::shared_ptr<torch::nn::Module> model, Plan plan,
                           Communicator& comm, ShardingOptions options)
    : ShardedModel(std::move(model), std::move(plan), ShardingMesh(comm), std::move(options)) {}

ShardedModel::ShardedModel(std::shared_ptr<torch::nn::Module> model, Plan plan,
                           const ShardingMesh& mesh, ShardingOptions options)
    : model_(std::move(model)), plan_(std::move(plan)), mesh_(mesh), comm_(mesh_.shard()) {
  mesh_.check();
  check_inputs(model_, plan_, options, comm_.rank(), mesh_.global_rank() == 0);
  check_not_sharded(*model_, comm_.rank());
  runtime_ = std::make_unique<Runtime>(mesh_, std::move(options));
  check_setup_agrees(*model_, plan_, runtime_->options(), mesh_);
  const std::optional<detail::DeferredInit> init =
      setup_deferred_init(*model_, plan_, runtime_->options(), mesh_);
  setup_buffers(*model_, runtime_->options(), mesh_);
  const ModelIndex index = index_model(*model_);
  const Claimed claimed =
      build_units(plan_, index, model_.get(), comm_, *runtime_, init ? &*init : nullptr);
  check_every_param_claimed(index, claimed, comm_.rank());
  // Register members last, so a failure above leaves nothing registered.
  try {
    register_members(*runtime_);
  } catch (...) {
    runtime_.reset();
    throw;
  }
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
              "below fp32 (Note [Compute copy in the step]); this model has neither, so call "
              "opt.step() as usual");
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
  for (size_t i = 0; i < units.size(); ++i) {
    units[i]->flat().absorb_view_grads();  // zero_grad on the views since the reduction
    const at::Tensor& g = units[i]->flat().master().grad();
    if (!g.defined()) continue;
    // A replicated unit's gradient is identical on every rank: count it on rank 0 only.
    if (units[i]->strategy() == ShardingStrategy::kNoShard && comm_.rank() != 0) continue;
    // Note [Low-precision master gradient]: a bf16 / fp16 gradient's norm in fp32.
    sumsq[static_cast<int64_t>(i)].copy_(g.to(at::kFloat).pow(2).sum());  // to(): g if fp32
  }
  if (!units.empty()) comm_.all_reduce(sumsq, ReduceOp::kSum, comm_.current_stream());
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
