// flatshard/fsdp/setup.cpp — fully_shard's setup in named steps (fsdp/setup.h).
#include "fsdp/setup.h"

#include <torch/nn/module.h>

#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "collectives/env.h"
#include "fsdp/buffers.h"
#include "fsdp/call.h"
#include "fsdp/deferred_init.h"
#include "fsdp/fingerprint.h"
#include "fsdp/resolve.h"
#include "fsdp/tensor_parallel.h"

namespace flatshard {
namespace detail {

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
    TORCH_CHECK(!options.strict_plan, "fully_shard: ", unmatched, " (rank ", rank,
                "); to shard the whole model as one unit on purpose use the policy 'none', or "
                "set ShardingOptions::strict_plan = false");
    if (first_rank) TORCH_WARN("fully_shard: ", unmatched);
  }
  if (first_rank)
    for (const std::string& w : plan.warnings) TORCH_WARN("fully_shard: ", w);
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

// A mesh with tp > 1 shards TP-local slices: the model must have been parallelize()d on it
// (fsdp/tensor_parallel.h), and a parallelized model sharded over a mesh of the same tp size.
void check_tensor_parallel(const torch::nn::Module& model, const Mesh& mesh) {
  const TensorParallel* tp = find_tensor_parallel(&model);
  const int size = mesh.size(MeshDim::kTp);
  TORCH_CHECK(tp != nullptr || size == 1, "fully_shard (", mesh.describe_rank(), "): the mesh has ",
              "tp ", size, " but the model was not parallelized; call parallelize(model, tp_plan, "
              "mesh) before fully_shard (fsdp/tensor_parallel.h), or pass a mesh without tp");
  TORCH_CHECK(tp == nullptr || tp->tp_size() == size, "fully_shard (", mesh.describe_rank(),
              "): the model was parallelized over tp ", tp ? tp->tp_size() : 0,
              " but the mesh has tp ", size, "; pass fully_shard the mesh given to parallelize");
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
  TORCH_CHECK(options.load || mesh.size(MeshDim::kTp) == 1, "fully_shard (",
              mesh.describe_rank(), "): the model is on meta and tensor-parallel (tp ",
              mesh.size(MeshDim::kTp), "); deferred initialization under tensor parallelism "
              "needs ShardingOptions::load (e.g. models::hf_loader or checkpoint_loader): "
              "initializing slices in place is not supported yet");
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

std::unique_ptr<Runtime> setup_runtime(const std::shared_ptr<torch::nn::Module>& model,
                                       const Plan& plan, const Mesh& mesh,
                                       ShardingOptions options) {
  Communicator& comm = mesh.shard();
  mesh.check();
  check_inputs(model, plan, options, comm.rank(), mesh.global_rank() == 0);
  check_not_sharded(*model, comm.rank());
  check_tensor_parallel(*model, mesh);
  // Note [Loading into shards] under TP: the loader reads full tensors, each rank its slices.
  if (const TensorParallel* tp = find_tensor_parallel(model.get()))
    options.load = tp->slice_loader(std::move(options.load));
  std::unique_ptr<Runtime> runtime = std::make_unique<Runtime>(mesh, std::move(options));
  check_setup_agrees(*model, plan, runtime->options(), mesh);
  const std::optional<detail::DeferredInit> init =
      setup_deferred_init(*model, plan, runtime->options(), mesh);
  setup_buffers(*model, runtime->options(), mesh);
  const ModelIndex index = index_model(*model);
  const Claimed claimed =
      build_units(plan, index, model.get(), comm, *runtime, init ? &*init : nullptr);
  check_every_param_claimed(index, claimed, comm.rank());
  // Register members last, so a failure above leaves nothing registered (a throw destroys the
  // runtime and its units on the way out).
  register_members(*runtime);
  return runtime;
}

}  // namespace detail
}  // namespace flatshard
