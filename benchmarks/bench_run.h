// flatshard/benchmarks/bench_run.h — one granularity run: build the model, shard it per the plan,
// train warmup + measured steps, and measure.
//
// Contract
// - train_rank() is one rank's part of a run, collective over `group` (every rank calls it with
//   the same config and granularity). Every rank builds model.build(seed) (bit-identical), moves
//   it to hooks.device, shards it over `group` with the granularity's plan and trains it with
//   AdamW on synthetic_batch(model, batch, seed, rank, step). Batches are made before timing.
//   With fp16 params a sharded run scales the loss and steps through a ShardedGradScaler
//   (fsdp/grad_scaler.h; one host sync per step for its inf/NaN answer).
//   A local run never shards or communicates: the model is cast to the param dtype and trained
//   as is; `group` (which may then be null: one rank alone) only aligns the memory
//   measurement.
// - A step's time covers zero_grad, forward, backward and the optimizer step, ended by
//   hooks.synchronize() (device work included); marks split it at the end of backward (after
//   flatshard's end-of-backward wait for the reductions) into fwd_bwd_ms and optimizer_ms.
//   Counters are those of the last measured step.
// - Setup (model build + fully_shard) is timed on the host after a barrier, ended by
//   hooks.synchronize(); its memory peak is read after every rank finished it
//   (RunResult::setup_peak_memory_bytes, raw as below: the peak is reset on rank 0 between two
//   barriers before setup starts).
// - Memory: after setup (model sharded, optimizer built) the peak is reset on rank 0 between
//   two barriers; RunResult::peak_memory_bytes is the raw probe peak at the end (the caller
//   subtracts its baseline and, for process-wide probes, divides by the ranks).
// - Tensor parallelism (config.tp > 1, sharded runs): train_rank gets the run's Mesh (shard x tp);
//   `group` is its shard group. Barriers span the mesh (shard, then tp: every rank has arrived),
//   rank 0 is the mesh's global rank 0, and the data rank is the shard coordinate. Per-step
//   counters add the TP collectives (RunResult::tp_per_step: TensorParallel::counters()).
// - Progress is reported on rank 0 only, after every step.
// - The returned result is this rank's; callers use rank 0's.
#pragma once

#include <chrono>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "benchmarks/bench_granularity.h"
#include "cli/cuda_rank.h"
#include "collectives/communicator.h"
#include "collectives/mesh.h"
#include "fsdp/tensor_parallel.h"
#include "fsdp/options.h"
#include "fsdp/unit.h"
#include "models/family.h"
#include "profiling/kernel_profile.h"

namespace flatshard {
namespace bench {

// The kernel profile a run reports (profiling/kernel_profile.h), by the names the report uses.
using profiling::KernelGroup;
using profiling::KernelProfile;

// Everything a run needs besides the granularity; identical on every rank.
struct RunConfig {
  models::ModelConfig model;  // family and sizes
  int64_t batch = 1;  // sequences per rank per step
  uint64_t seed = 0;
  int warmup = 2;
  int steps = 5;
  ShardingOptions sharding;
  bool fused_optimizer = false;  // flatshard::FusedAdamW instead of torch::optim::AdamW
  bool bf16_moments = false;     // FusedAdamW::set_moments_dtype(bf16)
  bool param_groups = false;     // by name, no decay on norms/biases (BenchOptions::param_groups)
  // Sharded runs build the model under flatshard::MetaInit and let fully_shard initialise it
  // (fsdp/deferred_init.h); local runs ignore it.
  bool deferred_init = false;
  // Wrap the communicator in a TimedCommunicator and report the exposed-communication share
  // (meaningful on synchronous backends only: the CPU one).
  bool time_collectives = false;
  // After the measured steps, this many more steps under the PyTorch profiler on rank 0
  // (profiling/kernel_profile.h); 0: none. Not part of the timing.
  int kernel_profile_steps = 0;
  bool sync_debug = false;  // warn at synchronizing device calls while measured steps are issued
  // Tokens per sequence fed to the model: the first `input_seq` of each synthetic sequence
  // (0: the model's whole seq_len). The host-cost probe of --write-profile (bench_profile.h)
  // runs the same model on short inputs so that the device never holds the host back.
  int64_t input_seq = 0;
  // Sharded runs step through a flatshard::CudaGraphStep (fsdp/cuda_graph.h): its warmup is
  // max(1, warmup - 1) steps, so the capture is the last warmup step; local runs stay eager.
  bool cuda_graph = false;
  // Tensor parallelism (docs/tensor-parallel.md): sharded runs parallelize() the model with
  // `tp_plan` over tp groups of `tp` ranks of the run's mesh and shard it over the rest; the
  // ranks of a tp group train on one batch (their data rank is the mesh's shard coordinate).
  // A deferred model is built on meta, parallelized in shapes, and loaded from the family's own
  // init through ParamLoader (init_loader below), each rank reading its slices only.
  int tp = 1;
  TpPlan tp_plan;
};

// The device side of a rank (cli/cuda_rank.h: shared with flatshard-train).
using DeviceHooks = cli::DeviceHooks;

// Called on rank 0 after each step: step index over warmup + measured, the total, its time.
using ProgressFn = std::function<void(int step, int total, double ms)>;

struct RunResult {
  std::string granularity;
  int world_size = 1;
  int64_t units = 0;            // units that own parameters (0 for local)
  UnitCounters per_step;        // collectives and bytes of the last measured step
  int tp = 1;                   // tensor-parallel ranks per group (1: none)
  TpCounters tp_per_step;       // the TP collectives of the last measured step (TensorParallel)
  std::vector<double> step_ms;  // measured steps
  // The same steps split at the end of backward (device time, from DeviceHooks marks): zero_grad
  // + forward + backward with every reduction done, and the optimizer step.
  std::vector<double> fwd_bwd_ms, optimizer_ms;
  // Host time to issue the same steps: from the step's start until opt.step() returned, before
  // waiting for the device. Close to the step time: the host is the bottleneck (host-bound).
  std::vector<double> host_issue_ms;
  // Of that, the host time inside flatshard's hooks (UnitCounters::host_{forward,backward}_ns,
  // summed over the units): forward and backward, per measured step (empty for local).
  std::vector<double> hook_forward_ms, hook_backward_ms;
  double loss_step0 = 0;        // loss of the first (warmup) step, before any update
  // Rank 0's loss at every step, warmup included: losses[s] is computed with the parameters
  // after s optimizer steps (losses[0] == loss_step0). The check compares them (bench_report.h).
  std::vector<double> losses;
  // fp16 sharded runs (ShardedGradScaler): steps whose optimizer step the scaler skipped
  // (inf/NaN gradients on some rank), warmup and measured; 0 otherwise.
  int skipped_steps = 0;
  std::optional<double> exposed_comm_share;  // host time inside collectives / step time
  int64_t peak_memory_bytes = 0;
  // Setup: building the model (and moving it to the device) plus fully_shard, rank 0's wall
  // clock with device work included; its memory peak, raw like peak_memory_bytes.
  double setup_s = 0;
  int64_t setup_peak_memory_bytes = 0;
  std::optional<KernelProfile> kernel_profile;  // rank 0, with kernel_profile_steps > 0
};

// `mesh`: the run's mesh when config.tp > 1 (then `group` is &mesh->shard()), else null.
RunResult train_rank(const RunConfig& config, const Granularity& granularity, Communicator* group,
                     const DeviceHooks& hooks, const ProgressFn& progress,
                     const Mesh* mesh = nullptr);

// A ParamLoader that reads parameters from `model`'s own init (an InitializesItself root: the
// GPT and LLaMA families; `model` unsplit, on meta is fine), one whole tensor drawn at a time on
// the host and kept for the next read of the same name: how a meta-built model is parallelized
// (which needs a loader: fsdp/tensor_parallel.h; the TP slice loader reads full tensors from
// it) and still gets the eager model's values. Throws c10::Error when the model does not
// initialise itself. One per rank (not thread-safe).
ParamLoader init_loader(const std::shared_ptr<torch::nn::Module>& model);

// A whole run on CPU: `world_size` ranks as threads with one compute thread each (config.tp > 1
// and not local: a mesh of world_size / tp shard x tp, collectives/thread_mesh.h); memory from
// the counting CPU allocator as the per-rank average (process peak minus the baseline before
// the run, divided by the ranks). Returns rank 0's result.
// `local` runs one unsharded replica per rank thread, concurrently and without communicating:
// the threads share the machine's cores, so a floor measured on one thread alone would be
// faster than any rank can be and the ratio would show core contention, not sharding cost.
// `timeout`: of the threads' collectives (a rank that never arrives fails every rank).
RunResult run_on_cpu_threads(const RunConfig& config, const Granularity& granularity,
                             int world_size, const ProgressFn& progress,
                             std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));

// The check's reference for the losses after the optimizer steps (bench_report.h): the model
// built eagerly in fp32 on `hooks.device`, unsharded, trained with the run's optimizer (same
// class, options and groups) on the mean loss over the `world_size` data-parallel ranks'
// batches (under TP: --world / tp) of each step
// -- what a sharded run's averaged gradients are. Returns rank 0's batch's loss at every step
// (warmup + steps values), as RunResult::losses. Untimed; one process, no communication.
std::vector<double> reference_losses(const RunConfig& config, int world_size,
                                     const DeviceHooks& hooks);

// Median of step times (mean of the middle two for an even count; 0 for none).
double median(std::vector<double> v);

}  // namespace bench
}  // namespace flatshard
