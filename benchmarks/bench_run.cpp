// flatshard/benchmarks/bench_run.cpp — see bench_run.h for the contract.
#include "benchmarks/bench_run.h"

#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <array>
#include <map>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>

#include "benchmarks/timed_communicator.h"
#include "collectives/thread_communicator.h"
#include "collectives/thread_mesh.h"
#include "fsdp/deferred_init.h"
#include "fsdp/call.h"
#include "fsdp/cuda_graph.h"
#include "optim/fused_adamw.h"
#include "fsdp/grad_scaler.h"
#include "fsdp/meta_init.h"
#include "fsdp/sharded_model.h"
#include "models/model_init.h"
#include "profiling/counting_allocator.h"

namespace flatshard {
namespace bench {

namespace {

// The optimizer is part of what a step costs; the check compares the losses after its steps
// with reference_losses(), which uses the same settings.
torch::optim::AdamWOptions adamw_options() {
  return torch::optim::AdamWOptions(1e-3).weight_decay(0.1);
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

ParamLoader init_loader(const std::shared_ptr<torch::nn::Module>& model) {
  auto* self = dynamic_cast<const InitializesItself*>(model.get());
  TORCH_CHECK(self != nullptr, "init_loader: the model (", model->name(),
              ") does not initialise itself (flatshard::InitializesItself)");
  struct State {
    std::map<std::string, std::vector<int64_t>> shapes;  // full shapes, from check()
    std::string name;                                    // the tensor drawn last
    at::Tensor values;                                   // its values, flattened
  };
  auto state = std::make_shared<State>();
  ParamLoader out;
  out.check = [state](const std::vector<PlannedParam>& params) {
    for (const PlannedParam& p : params) state->shapes[p.name] = p.shape;
  };
  out.read = [state, model, self](const std::string& name, int64_t begin, int64_t end,
                                  const at::Tensor& dst) {
    if (state->name != name) {
      auto it = state->shapes.find(name);
      TORCH_CHECK(it != state->shapes.end(), "init_loader: parameter '", name,
                  "' was not in the planned parameters");
      at::Tensor v = at::empty(it->second, at::TensorOptions().dtype(at::kFloat));
      self->init_tensor(name, v);
      state->values = v.reshape({-1});
      state->name = name;
    }
    dst.copy_(state->values.slice(0, begin, end));
  };
  return out;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

namespace {

// --param-groups: the usual recipe's two groups by name: weight decay except on norms and
// biases (names containing "bias" or "norm", or LayerNorm's "ln").
std::vector<torch::optim::OptimizerParamGroup> name_groups(
    const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::vector<at::Tensor> decay, no_decay;
  for (const auto& [name, p] : named) {
    if (!p.requires_grad()) continue;
    const bool plain = name.find("bias") != std::string::npos ||
                       name.find("norm") != std::string::npos ||
                       name.find("ln") != std::string::npos;
    (plain ? no_decay : decay).push_back(p);
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(adamw_options()));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    adamw_options().weight_decay(0)));
  return groups;
}

// The run's optimizer over `params` (or, with --param-groups, two groups over `named`).
std::shared_ptr<torch::optim::AdamW> make_optimizer(
    const RunConfig& config, const std::vector<at::Tensor>& params,
    const std::vector<std::pair<std::string, at::Tensor>>& named) {
  if (!config.fused_optimizer)
    return config.param_groups
               ? std::make_shared<torch::optim::AdamW>(name_groups(named), adamw_options())
               : std::make_shared<torch::optim::AdamW>(params, adamw_options());
  auto fused = config.param_groups ? std::make_shared<FusedAdamW>(name_groups(named), adamw_options())
                                   : std::make_shared<FusedAdamW>(params, adamw_options());
  if (config.bf16_moments) fused->set_moments_dtype(at::kBFloat16);  // Note [Low-precision moments]
  return fused;
}

// Rank `rank`'s batch of step `step`, on `device` (the run's input_seq applied).
std::pair<at::Tensor, at::Tensor> step_batch(const RunConfig& config, int rank, int step,
                                             c10::Device device) {
  auto b = config.model.synthetic_batch(config.batch, static_cast<int64_t>(config.seed), rank, step);
  if (config.input_seq > 0 && config.input_seq < b.first.size(1)) {
    b.first = b.first.narrow(1, 0, config.input_seq).contiguous();
    b.second = b.second.narrow(1, 0, config.input_seq).contiguous();
  }
  return {b.first.to(device), b.second.to(device)};
}

}  // namespace

std::vector<double> reference_losses(const RunConfig& config, int world_size,
                                     const DeviceHooks& hooks) {
  auto model = config.model.build(config.seed);
  model->to(hooks.device, c10::kFloat);
  const auto params = models::unique_parameters(*model);
  std::vector<std::pair<std::string, at::Tensor>> named;
  if (config.param_groups) named = models::unique_named_parameters(*model);
  auto optimizer = make_optimizer(config, params, named);
  std::vector<double> losses;
  for (int s = 0; s < config.warmup + config.steps; ++s) {
    optimizer->zero_grad();
    for (int r = 0; r < world_size; ++r) {
      const auto batch = step_batch(config, r, s, hooks.device);
      const at::Tensor loss = config.model.loss(*model, batch.first, batch.second);
      (loss / world_size).backward();  // the sharded runs' gradients: the ranks' mean
      if (r == 0) losses.push_back(loss.item<double>());
    }
    optimizer->step();
  }
  hooks.synchronize();
  return losses;
}

namespace {

// What one rank trains with: the model (sharded unless local), its optimizer (attached where
// flatshard drives it) and, for fp16 compute, the loss scaler.
struct RankModel {
  std::shared_ptr<torch::nn::Module> model;
  std::unique_ptr<TensorParallel> tp;  // outlives fsdp (fsdp/tensor_parallel.h)
  std::unique_ptr<ShardedModel> fsdp;
  std::shared_ptr<torch::optim::AdamW> optimizer;
  std::unique_ptr<ShardedGradScaler> scaler;
};

RankModel build_rank_model(const RunConfig& config, const Granularity& granularity,
                           Communicator* comm, const DeviceHooks& hooks, const Mesh* mesh) {
  const c10::ScalarType param_dtype = config.sharding.mixed_precision.param_dtype;
  RankModel m;
  const bool deferred = config.deferred_init && !granularity.local;
  if (deferred) {
    MetaInit meta;  // shapes only: fully_shard gives each unit memory and values in turn
    m.model = config.model.build(config.seed);
  } else {
    m.model = config.model.build(config.seed);
  }
  std::vector<at::Tensor> params;
  std::vector<std::pair<std::string, at::Tensor>> named;  // --param-groups
  if (granularity.local) {
    m.model->to(hooks.device, param_dtype);
    params = models::unique_parameters(*m.model);
    if (config.param_groups) named = models::unique_named_parameters(*m.model);
  } else if (mesh != nullptr) {
    // Tensor parallelism: slice (shapes only on meta), then shard the TP-local parameters over
    // the mesh's shard group; a meta model is loaded from its own init (init_loader).
    ShardingOptions sharding = config.sharding;
    if (deferred) {
      MetaInit meta;  // a second model in shapes only, unsplit: the init's full tensors
      sharding.load = init_loader(config.model.build(config.seed));
    }
    m.tp = parallelize(m.model, config.tp_plan, *mesh);
    if (!deferred) {
      m.model->to(hooks.device);
    }
    m.fsdp = fully_shard(m.model, granularity.plan, *mesh, sharding);
    params = m.fsdp->parameters();
    if (config.param_groups) named = m.fsdp->named_parameters();
  } else {
    if (!deferred) m.model->to(hooks.device);
    m.fsdp = fully_shard(m.model, granularity.plan, *comm, config.sharding);
    params = m.fsdp->parameters();
    if (config.param_groups) named = m.fsdp->named_parameters();
  }
  m.optimizer = make_optimizer(config, params, named);
  // Note [Offload step in backward]: flatshard steps the offloaded units during backward
  // (bench_options.cpp makes this mode imply --optimizer fused); Note [Compute copy in the
  // step]: FusedAdamW writes NO_SHARD units' compute copies.
  if (m.fsdp && config.fused_optimizer) {
    const auto units = m.fsdp->units();
    if (config.sharding.offload_step != OffloadStep::kAfterBackward ||
        std::any_of(units.begin(), units.end(), [](const UnitInfo& u) { return u.step_copy; }))
      m.fsdp->attach_optimizer(std::static_pointer_cast<FusedAdamW>(m.optimizer));
  }
  // fp16 compute: the loss is scaled and steps with inf/NaN gradients are skipped on every rank
  // (fsdp/grad_scaler.h). `local` has no fp32 master to unscale into: it trains as it is.
  if (m.fsdp && param_dtype == c10::kHalf)
    m.scaler = std::make_unique<ShardedGradScaler>(*m.fsdp);
  return m;
}

}  // namespace

namespace {

// train_rank's arguments: a communicator unless local; under TP the mesh, its shard group as it.
void check_rank_args(const RunConfig& config, const Granularity& granularity,
                     const Communicator* group, const Mesh* mesh) {
  const std::string who = "train_rank: granularity '" + granularity.label + "'";
  TORCH_CHECK(granularity.local || group != nullptr, who, " needs a communicator");
  TORCH_CHECK(mesh == nullptr || &mesh->shard() == group, who,
              ": the communicator must be the mesh's shard group");
  TORCH_CHECK((mesh != nullptr) == (config.tp > 1 && !granularity.local), who, " at tp ",
              config.tp, (mesh ? " got" : " did not get"), " a mesh");
}

// A step's marks: the device's own (DeviceHooks::mark / elapsed_ms) or host-clock ones (CPU work
// is synchronous).
class StepClock {
 public:
  explicit StepClock(const DeviceHooks& hooks) : hooks_(hooks) {}
  void mark(int i) {
    if (hooks_.mark) {
      hooks_.mark(i);
    } else {
      host_marks_[static_cast<size_t>(i)] = std::chrono::steady_clock::now();
    }
  }
  double elapsed(int a, int b) const {
    if (hooks_.elapsed_ms) return hooks_.elapsed_ms(a, b);
    return std::chrono::duration<double, std::milli>(host_marks_[static_cast<size_t>(b)] -
                                                     host_marks_[static_cast<size_t>(a)])
        .count();
  }

 private:
  const DeviceHooks& hooks_;
  std::array<std::chrono::steady_clock::time_point, DeviceHooks::kMarks> host_marks_;
};

// --cuda-graph: forward + backward through one CUDA graph (Note [CUDA graph step]); its warmup
// ends one step before the bench's, so the capture is not a measured step. Null otherwise.
std::unique_ptr<CudaGraphStep> make_graph_step(
    const RunConfig& config, const RankModel& m,
    const std::vector<std::pair<at::Tensor, at::Tensor>>& batches) {
  if (!config.cuda_graph || !m.fsdp) return nullptr;
  TORCH_CHECK(!m.scaler, "--cuda-graph: the fp16 gradient scaler is not supported");
  CudaGraphOptions go;
  go.warmup_steps = std::max(1, config.warmup - 1);
  std::shared_ptr<torch::nn::Module> model = m.model;
  return std::make_unique<CudaGraphStep>(
      *m.fsdp, std::vector<at::Tensor>{batches[0].first, batches[0].second},
      [&config, model](const std::vector<at::Tensor>& in) {
        return enter(model, [&] { return config.model.loss(*model, in[0], in[1]); });
      },
      go);
}

// Profiled steps, untimed: every rank runs them (collectives), rank 0 records its device.
std::optional<KernelProfile> profile_steps(const RunConfig& config, int rank,
                                          const DeviceHooks& hooks,
                                          const std::function<void(int)>& step) {
  if (rank == 0) profiling::start_kernel_profile();
  for (int k = 0; k < config.kernel_profile_steps; ++k) step(k);
  hooks.synchronize();
  if (rank != 0) return std::nullopt;
  return profiling::summarize_kernels(profiling::stop_kernel_profile(),
                                      config.kernel_profile_steps);
}

}  // namespace

RunResult train_rank(const RunConfig& config, const Granularity& granularity, Communicator* group,
                     const DeviceHooks& hooks, const ProgressFn& progress, const Mesh* mesh) {
  check_rank_args(config, granularity, group, mesh);
  // Rank 0 reports; a tp group's ranks share the data rank (their shard coordinate).
  const int rank = mesh ? mesh->global_rank() : group ? group->rank() : 0;
  const int data_rank = group ? group->rank() : 0;
  // Shard groups, then tp groups: once both barriers pass, every rank of the mesh has arrived.
  auto barrier = [&] {
    if (group) group->barrier();
    if (mesh && mesh->tp()) mesh->tp()->barrier();
  };
  const int total = config.warmup + config.steps;

  // The communicator sharding uses: none for local, else the group (timed when asked).
  std::unique_ptr<TimedCommunicator> timed;
  Communicator* comm = granularity.local ? nullptr : group;
  if (comm && config.time_collectives) {
    timed = std::make_unique<TimedCommunicator>(*comm);
    comm = timed.get();
  }
  // Under TP the shard group's collectives are timed through the same wrapper (the tp group's
  // all-reduces are not: they run inside the layers' forward and backward).
  std::optional<Mesh> timed_mesh;
  const Mesh* run_mesh_ptr = mesh;
  if (mesh && timed) {
    timed_mesh.emplace(*timed, mesh->replicate(), mesh->tp());
    run_mesh_ptr = &*timed_mesh;
  }

  // Setup's peak and time start together on every rank.
  auto reset_peak = [&] {
    hooks.synchronize();
    barrier();
    if (rank == 0 && hooks.memory_reset_peak) hooks.memory_reset_peak();
    barrier();
  };
  reset_peak();
  const auto setup_start = std::chrono::steady_clock::now();
  RankModel m = build_rank_model(config, granularity, comm, hooks, run_mesh_ptr);
  const std::shared_ptr<torch::nn::Module>& model = m.model;
  ShardedModel* fsdp = m.fsdp.get();
  hooks.synchronize();
  const double setup_s = ms_since(setup_start) * 1e-3;
  torch::optim::AdamW& opt = *m.optimizer;
  ShardedGradScaler* scaler = m.scaler.get();

  std::vector<std::pair<at::Tensor, at::Tensor>> batches;
  for (int s = 0; s < total; ++s)
    batches.push_back(step_batch(config, data_rank, s, hooks.device));

  RunResult r;
  r.granularity = granularity.label;
  r.setup_s = setup_s;
  r.world_size = mesh ? mesh->global_size() : comm ? comm->world_size() : 1;
  r.tp = mesh ? mesh->size(MeshDim::kTp) : 1;
  if (fsdp)
    for (const auto& u : fsdp->units()) r.units += u.padded_numel > 0 ? 1 : 0;

  // Reset the peak once every rank finished setup: the steps' peak is the steady state we want,
  // not setup's (reported on its own).
  hooks.synchronize();
  barrier();
  if (hooks.memory_peak) r.setup_peak_memory_bytes = hooks.memory_peak();
  reset_peak();

  StepClock clock(hooks);

  std::unique_ptr<CudaGraphStep> graph = make_graph_step(config, m, batches);

  // One training step on batch b; after_backward() runs between backward and the optimizer step.
  auto train_step = [&](int b, auto&& after_backward) {
    opt.zero_grad();
    const auto& batch = batches[static_cast<size_t>(b)];
    at::Tensor loss;
    if (graph) {
      loss = graph->run({batch.first, batch.second});
    } else {
      loss = enter(model, [&] { return config.model.loss(*model, batch.first, batch.second); });
      (scaler ? scaler->scale(loss) : loss).backward();
    }
    after_backward();
    if (scaler) {
      if (!scaler->step(opt)) ++r.skipped_steps;
      scaler->update();
    } else {
      opt.step();
    }
    return loss;
  };

  double comm_ms = 0, step_ms_sum = 0;
  // --cuda-graph: the collectives a replay runs are those the capture step counted (a replay
  // runs no hook, so its own counters stay zero); its host time is the replays' (zero).
  std::optional<UnitCounters> captured_step;
  for (int s = 0; s < total; ++s) {
    if (fsdp) fsdp->reset_counters();
    if (m.tp) m.tp->reset_counters();
    if (timed) timed->reset_time();
    const bool watch = config.sync_debug && hooks.sync_debug && s >= config.warmup;
    const auto t0 = std::chrono::steady_clock::now();
    if (watch) hooks.sync_debug(true);
    clock.mark(0);
    at::Tensor loss = train_step(s, [&] { clock.mark(1); });
    clock.mark(2);
    if (watch) hooks.sync_debug(false);  // the bench's own wait below is not the step's
    const double issue_ms = ms_since(t0);
    hooks.synchronize();
    const double ms = ms_since(t0);
    r.losses.push_back(loss.item<double>());
    if (s == 0) r.loss_step0 = r.losses.back();
    if (s >= config.warmup) {
      r.step_ms.push_back(ms);
      r.fwd_bwd_ms.push_back(clock.elapsed(0, 1));
      r.optimizer_ms.push_back(clock.elapsed(1, 2));
      r.host_issue_ms.push_back(issue_ms);
      if (fsdp) {
        const UnitCounters c = fsdp->counters().total;
        r.hook_forward_ms.push_back(static_cast<double>(c.host_forward_ns) * 1e-6);
        r.hook_backward_ms.push_back(static_cast<double>(c.host_backward_ns) * 1e-6);
      }
      step_ms_sum += ms;
      if (timed) comm_ms += static_cast<double>(timed->nanoseconds()) * 1e-6;
    }
    if (graph && graph->captured() && !captured_step) {
      captured_step = fsdp->counters().total;
      captured_step->host_forward_ns = captured_step->host_backward_ns = 0;
    }
    if (rank == 0 && progress) progress(s, total, ms);
  }
  if (fsdp) r.per_step = captured_step ? *captured_step : fsdp->counters().total;
  if (m.tp) r.tp_per_step = m.tp->counters();
  if (timed && step_ms_sum > 0) r.exposed_comm_share = comm_ms / step_ms_sum;

  if (config.kernel_profile_steps > 0) {
    hooks.synchronize();
    barrier();
    r.kernel_profile =
        profile_steps(config, rank, hooks, [&](int k) { train_step(k % total, [] {}); });
  }

  barrier();  // every rank's steps are inside the peak
  if (hooks.memory_peak) r.peak_memory_bytes = hooks.memory_peak();
  return r;
}

RunResult run_on_cpu_threads(const RunConfig& config, const Granularity& granularity,
                             int world_size, const ProgressFn& progress,
                             std::chrono::milliseconds timeout) {
  profiling::CountingCpuAllocator& mem = profiling::CountingCpuAllocator::install();
  DeviceHooks hooks;
  hooks.memory_current = [&mem] { return mem.current_bytes(); };
  hooks.memory_peak = [&mem] { return mem.peak_bytes(); };
  hooks.memory_reset_peak = [&mem] { mem.reset_peak(); };

  const int world = world_size;
  const int64_t baseline = hooks.memory_current();
  RunResult result;
  std::mutex mu;
  if (config.tp > 1 && !granularity.local) {
    TORCH_CHECK(world % config.tp == 0, "run_on_cpu_threads: world ", world,
                " is not a multiple of tp ", config.tp);
    run_mesh(MeshShape(world / config.tp, 1, config.tp), [&](const Mesh& mesh) {
      RunResult r = train_rank(config, granularity, &mesh.shard(), hooks, progress, &mesh);
      if (mesh.global_rank() == 0) {
        std::lock_guard<std::mutex> lock(mu);
        result = std::move(r);
      }
    }, timeout);
  } else {
    run_ranks(world, [&](Communicator& comm) {
      RunResult r = train_rank(config, granularity, &comm, hooks, progress);
      if (comm.rank() == 0) {
        std::lock_guard<std::mutex> lock(mu);
        result = std::move(r);
      }
    }, timeout);
  }
  result.peak_memory_bytes = (result.peak_memory_bytes - baseline) / world;
  result.setup_peak_memory_bytes = (result.setup_peak_memory_bytes - baseline) / world;
  return result;
}

}  // namespace bench
}  // namespace flatshard
