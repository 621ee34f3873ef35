// flatshard/tools/train_loop.h — flatshard-train's training run: one rank's loop over token
// files (data/token_dataset.h) with an LR schedule, gradient accumulation and clipping,
// checkpoints that carry the training state (CheckpointOptions::training_state) and resume
// from them bit for bit, evaluation, JSONL metrics and progress lines.
//
// Contract
// - train_rank() is collective over `comm` (every rank calls it with the same config): ranks as
//   threads (ThreadCommunicator) or one process per GPU (NCCL, cli/cuda_rank.h). The model,
//   batches and loss live on comm.device(); `hooks` measure its memory (null memory_peak: the
//   process's CPU tensors, profiling/counting_allocator.h). Every
//   rank builds the model (a family preset or a Hugging Face directory, models/hf.h), shards it
//   with config.policy and trains config.steps optimizer steps. Step s's global batch is the
//   dataset's samples of (seed, s) (token_dataset.h), so a run's losses do not depend on when it
//   was stopped and resumed, and the data position to record is the step.
// - Loss: each rank's loss is the mean over its micro-batches of the model's mean next-token
//   loss (each micro-batch's loss divided by the accumulation count before backward; gradient
//   sync only on the last micro-batch); flatshard averages gradients over ranks, so every world
//   size trains on the gradient of the same global mean. The logged loss is the ranks' average.
// - LR: lr_at() below, set on every parameter group before each step.
// - Checkpoints: every checkpoint_every steps and after the last, into
//   <out>/checkpoints/step-<8 digits> (sharded, with the optimizer state and the training state:
//   step, data position and seed, schedule, model, batch); then rank 0 deletes all but the
//   newest `keep` checkpoints of that folder. Resume (config.resume): "latest" picks the newest
//   complete checkpoint of <out>/checkpoints, anything else is a checkpoint directory. The saved
//   model, sequence length and global batch must equal this run's (errors name both values);
//   the world size, policy and micro-batch may differ. A fresh run (no resume) refuses an
//   <out>/checkpoints that already holds checkpoints (an earlier run's would be resumed or
//   pruned in its place).
// - Output on rank 0: a progress line every log_every steps on stdout; <out>/metrics.jsonl gets
//   one JSON object per step ({"step", "loss", "lr", "grad_norm", "tokens_per_s_per_rank",
//   "peak_memory_bytes", "elapsed_s"}, and "mfu" where peak_tflops is known: cli::mfu() with
//   the model's flops_per_token, as flatshard-bench computes it; peak memory: the process's CPU tensors, or the
//   rank's device peak (CUDA caching allocator) with device hooks), per evaluation ({"step", "val_loss"}) and per start
//   ({"event": "start" | "resume", "step"}), each line flushed as written; a resumed run
//   appends. <out>/loss.svg: the loss curve of the whole run (read back from metrics.jsonl:
//   each step's last loss since the last fresh start, so a resumed run draws every step).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "cli/cuda_rank.h"
#include "cli/options.h"
#include "collectives/communicator.h"
#include "data/token_dataset.h"

namespace flatshard {
namespace train {

enum class Decay { kCosine, kLinear, kConstant };

struct Schedule {
  double lr = 3e-4;      // peak learning rate
  double min_lr = 3e-5;  // the decay ends here
  int64_t warmup = 0;    // steps of linear warmup from lr / warmup to lr
  Decay decay = Decay::kCosine;
  int64_t steps = 1;  // the decay reaches min_lr at this step
};

// The learning rate of (0-based) step `step`: warmup lr * (step + 1) / warmup for step <
// warmup; then from lr to min_lr over [warmup, steps) by the decay (cosine: min + (lr - min) *
// (1 + cos(pi * r)) / 2, linear: lr - (lr - min) * r, with r = (step - warmup) / (steps -
// warmup)); min_lr at and after `steps`.
double lr_at(const Schedule& s, int64_t step);
const char* decay_name(Decay d);

// The model flags' defaults for this tool: the llama family (its tiny preset: TrainConfig).
inline cli::ModelFlags llama_model_flags() {
  cli::ModelFlags m;
  m.family = "llama";
  return m;
}

struct TrainConfig {
  // Model: a family preset (default llama tiny) with the shared flags' overrides
  // (cli/options.h), or a Hugging Face directory.
  cli::ModelFlags model = llama_model_flags();
  std::string hf_dir;  // set: the model and its weights from this directory
  // Data.
  std::string data, val;
  data::TokenDtype token_dtype = data::TokenDtype::kUint16;
  int64_t global_batch = 8, micro_batch = 2;
  uint64_t seed = 0;
  // Sharding.
  std::string policy = "layer";  // a named plan (cli/named_plans.h) or a policy spec
  // The shared sharding flags (cli/options.h: strategy, dtypes, prefetch, offload step, ...);
  // an unset --param-dtype is fp32.
  cli::ShardingFlags sharding;
  bool recompute = false;  // every non-root unit recomputes its forward in backward
  int offload = 0;         // ShardingOptions::offload level (0, 1, 2) of every unit
  // Optimizer.
  std::string optimizer = "adamw";  // adamw | fused
  Schedule schedule;
  double weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double clip = 1.0;  // max global gradient norm; <= 0: not clipped (the norm is still logged)
  int64_t steps = 100;
  // Evaluation: every eval_every steps and after the last (0: only after the last), over
  // eval_batches x micro_batch samples per rank of `val`.
  int64_t eval_every = 0, eval_batches = 2;
  // Output.
  std::string out;               // folder for checkpoints/, metrics.jsonl and loss.svg
  int64_t checkpoint_every = 0;  // 0: only after the last step
  int64_t keep = 3;
  std::string resume;  // "": fresh; "latest" or a checkpoint directory
  int64_t log_every = 10;
  // Per rank, for MFU in the progress lines and metrics (cli::peak_tflops); none: no MFU.
  std::optional<double> peak_tflops;
  std::string save_hf;  // set: the trained model in Hugging Face's layout at the end (llama)
};

// The newest complete checkpoint (has manifest.json) in <out>/checkpoints; "" when none.
std::string latest_checkpoint(const std::string& out);

void train_rank(const TrainConfig& config, Communicator& comm,
                const cli::DeviceHooks& hooks = cli::DeviceHooks{});

}  // namespace train
}  // namespace flatshard
