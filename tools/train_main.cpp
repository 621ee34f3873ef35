// flatshard-train — train a family preset or a Hugging Face directory on token files
// (docs/training.md):
//   python tools/prepare_tokens.py --byte-level input.txt data/       # data/train.bin, val.bin
//   flatshard-train --data data/train.bin --val data/val.bin --out run/ --steps 200
//   flatshard-train ... --resume                                      # from run/'s latest
//   flatshard-train --config run.toml                                 # the same flags in a file
//   flatshard-train ... --device cuda [--nproc N]      # one process per GPU (or under torchrun)
//
// Exit codes: 0 done; 1 the run failed (one line "flatshard-train: error: ..." on stderr;
// "flatshard-train: rank N: error: ..." from a launched rank N > 0); 2 usage error
// (cli/exit.h). The loop is tools/train_loop.h's; only flags and the launch live here.
// --device cuda: under torchrun / srun / mpirun (their rank variables, collectives/launch_env.h)
// this process is one rank on GPU LOCAL_RANK; without a launcher it launches --nproc copies of
// itself (default: one per visible GPU) and waits for them (cli/launch.h). The launcher's
// variables are read only with --device cuda: a CPU run is the same wherever it is started.
#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "collectives/thread_communicator.h"
#include "models/family.h"
#include "support/input_file.h"
#include "support/output_file.h"
#include "cli/cuda_rank.h"
#include "cli/exit.h"
#include "cli/launch.h"
#include "cli/numbers.h"
#include "tools/train_loop.h"

namespace ft = flatshard::train;

namespace {

constexpr const char* kProgram = "flatshard-train";
constexpr int64_t kMaxConfigBytes = int64_t{1} << 20;  // a config file of flags

constexpr const char* kFooter = R"(
Data: --data / --val name a token file (raw uint16 or uint32 tokens, nanoGPT's train.bin, or
llm.c's headered .bin) or a directory of *.bin shards; tools/prepare_tokens.py makes them.
Batches: each step trains on --global-batch sequences of --seq tokens, drawn from
(--seed, step) alone; each rank runs global / (micro x world) micro-batches of --micro-batch.
--resume continues bit for bit from the latest checkpoint in --out (or the one named), at any
--world. A --config file (TOML or INI) holds the same names as the flags (without --).)";

}  // namespace

namespace fcli = flatshard::cli;

// What the flags set beside TrainConfig: read into it after parsing.
struct FlagText {
  int world = 2;
  int nproc = 0;  // --device cuda without a launcher: processes to launch; 0: one per GPU
  std::string device = "cpu";
  std::string decay = "cosine", token_dtype = "uint16";
  double peak_tflops = 0;
  CLI::Option* peak = nullptr;
};

// The model (a preset or --hf and its overrides) and the data.
void add_model_and_data_flags(CLI::App& app, ft::TrainConfig& c, FlagText& x) {
  const char* g_model = "Model";
  // The model flags of every tool (cli/options.h): same names, help and checks as bench and
  // explain; this tool's default is the llama family's tiny preset.
  fcli::add_model_flags(app, c.model, g_model, "default tiny",
                        "override: sequence length (tokens per sample)");
  fcli::add_fp8_flag(app, c.model, g_model);
  app.add_option("--hf", c.hf_dir,
                 "a Hugging Face model directory (LLaMA, Mistral, Qwen2): its config and weights "
                 "instead of --model/--preset")
      ->group(g_model);

  const char* g_data = "Data";
  app.add_option("--data", c.data, "training tokens: a .bin file or a directory of them")
      ->required()
      ->group(g_data);
  app.add_option("--val", c.val, "validation tokens (evaluated every --eval-every steps)")
      ->group(g_data);
  app.add_option("--token-dtype", x.token_dtype, "uint16 (default) | uint32: raw files' tokens")
      ->check(CLI::IsMember({"uint16", "uint32"}))
      ->group(g_data);
  app.add_option("--global-batch", c.global_batch, "sequences per optimizer step (default 8)")
      ->transform(fcli::integer(0, std::numeric_limits<int64_t>::max()))
      ->check(CLI::PositiveNumber)
      ->group(g_data);
  app.add_option("--micro-batch", c.micro_batch,
                 "sequences per rank per forward/backward (default 2)")
      ->transform(fcli::integer(0, std::numeric_limits<int64_t>::max()))
      ->check(CLI::PositiveNumber)
      ->group(g_data);
  app.add_option("--seed", c.seed, "model init and data order (default 0)")
      ->transform(fcli::unsigned64())->group(g_data);

}

// The optimizer and its schedule.
void add_optimizer_flags(CLI::App& app, ft::TrainConfig& c, FlagText& x) {
  const char* g_opt = "Optimizer";
  app.add_option("--steps", c.steps, "optimizer steps (default 100)")
      ->transform(fcli::integer(0, std::numeric_limits<int64_t>::max()))
      ->check(CLI::PositiveNumber)
      ->group(g_opt);
  app.add_option("--optimizer", c.optimizer, "adamw (default) | fused (flatshard::FusedAdamW)")
      ->check(CLI::IsMember({"adamw", "fused"}))
      ->group(g_opt);
  app.add_option("--lr", c.schedule.lr, "peak learning rate (default 3e-4)")
      ->check(fcli::number())->group(g_opt);
  app.add_option("--min-lr", c.schedule.min_lr, "learning rate at the end (default 3e-5)")
      ->check(fcli::number())
      ->group(g_opt);
  app.add_option("--warmup", c.schedule.warmup, "linear warmup steps (default 0)")
      ->transform(fcli::integer(0, std::numeric_limits<int64_t>::max()))
      ->check(CLI::NonNegativeNumber)
      ->group(g_opt);
  app.add_option("--decay", x.decay, "cosine (default) | linear | constant, after the warmup")
      ->check(CLI::IsMember({"cosine", "linear", "constant"}))
      ->group(g_opt);
  app.add_option("--weight-decay", c.weight_decay, "AdamW weight decay (default 0.1)")
      ->check(fcli::number())
      ->group(g_opt);
  app.add_option("--beta1", c.beta1, "AdamW beta1 (default 0.9)")
      ->check(fcli::number())->group(g_opt);
  app.add_option("--beta2", c.beta2, "AdamW beta2 (default 0.95)")
      ->check(fcli::number())->group(g_opt);
  app.add_option("--clip", c.clip, "max global gradient norm; 0: off (default 1.0)")
      ->check(fcli::number())
      ->group(g_opt);

}

// Sharding (ranks, plan, dtypes, offload) and output (run folder, checkpoints, logging).
void add_run_flags(CLI::App& app, ft::TrainConfig& c, FlagText& x) {
  const char* g_shard = "Sharding";
  app.add_option("--device", x.device,
                 "cpu (default: ranks as threads) | cuda (one process per GPU, NCCL; under "
                 "torchrun/srun/mpirun the launcher decides the ranks)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->group(g_shard);
  app.add_option("--world", x.world, "cpu: ranks, as threads on this CPU (default 2)")
      ->transform(fcli::integer(0, std::numeric_limits<int64_t>::max()))
      ->check(CLI::Range(1, 64))
      ->group(g_shard);
  app.add_option("--nproc", x.nproc,
                 "cuda without a launcher: processes to launch on this host, one per GPU "
                 "(default: every visible GPU)")
      ->transform(fcli::integer(1, std::numeric_limits<int64_t>::max()))
      ->group(g_shard);
  app.add_option("--policy", c.policy,
                 "a named plan (layer, leaf, every-K, model, noshard) or a policy spec "
                 "(docs/vocabulary.md; default layer)")
      ->group(g_shard);
  // --strategy, --param-dtype, --reduce-dtype, --prefetch, --offload-step,
  // --keep-low-precision-grads, --keep-compute-shard: as in bench and explain.
  fcli::add_sharding_flags(app, c.sharding, g_shard, "fp32");
  app.add_flag("--recompute", c.recompute,
               "recompute every non-root unit's forward in backward (activation checkpointing)")
      ->group(g_shard);
  app.add_option("--offload", c.offload,
                 "CPU offload level of every unit: 0 (default) | 1 fp32 master, gradients and "
                 "optimizer state in host memory | 2 the low-precision shard too")
      ->transform(fcli::integer(0, std::numeric_limits<int64_t>::max()))
      ->check(CLI::Range(0, 2))
      ->group(g_shard);

  const char* g_out = "Output";
  app.add_option("--out", c.out, "run folder: checkpoints/, metrics.jsonl, loss.svg")
      ->required()
      ->group(g_out);
  app.add_option("--checkpoint-every", c.checkpoint_every,
                 "steps between checkpoints (default 0: only after the last)")
      ->transform(fcli::integer(0, std::numeric_limits<int64_t>::max()))
      ->check(CLI::NonNegativeNumber)
      ->group(g_out);
  app.add_option("--keep", c.keep, "checkpoints kept, newest first (default 3)")
      ->transform(fcli::integer(0, std::numeric_limits<int64_t>::max()))
      ->check(CLI::PositiveNumber)
      ->group(g_out);
  app.add_option("--resume", c.resume,
                 "continue from a checkpoint: 'latest' (the default when given without a value) "
                 "in --out/checkpoints, or a checkpoint directory")
      ->expected(0, 1)
      ->default_str("latest")
      ->group(g_out);
  app.add_option("--log-every", c.log_every, "steps between progress lines (default 10)")
      ->transform(fcli::integer(0, std::numeric_limits<int64_t>::max()))
      ->check(CLI::PositiveNumber)
      ->group(g_out);
  app.add_option("--eval-every", c.eval_every,
                 "steps between evaluations on --val (default 0: after the last step only)")
      ->transform(fcli::integer(0, std::numeric_limits<int64_t>::max()))
      ->check(CLI::NonNegativeNumber)
      ->group(g_out);
  app.add_option("--eval-batches", c.eval_batches,
                 "micro-batches per rank per evaluation (default 2)")
      ->transform(fcli::integer(0, std::numeric_limits<int64_t>::max()))
      ->check(CLI::PositiveNumber)
      ->group(g_out);
  app.add_option("--save-hf", c.save_hf,
                 "after the last step, write the model in Hugging Face's layout (LLaMA family)")
      ->group(g_out);
  x.peak = fcli::add_peak_tflops_flag(app, x.peak_tflops, g_out);

}

int main(int argc, char** argv) {
  ft::TrainConfig c;
  CLI::App app("flatshard-train: train a model on token files with flatshard (ranks as CPU "
               "threads, or one process per GPU)",
               kProgram);
  app.footer(kFooter);
  app.set_config("--config", "", "read flags from this TOML/INI file (unknown keys are errors)");
  app.allow_config_extras(CLI::config_extras_mode::error);
  FlagText x;
  add_model_and_data_flags(app, c, x);
  add_optimizer_flags(app, c, x);
  add_run_flags(app, c, x);

  std::string config_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--config" && i + 1 < argc) config_path = argv[i + 1];
    if (a.rfind("--config=", 0) == 0) config_path = a.substr(9);
  }
  try {
    // CLI11 reads the file itself; this checks it first the way every tool input is checked
    // (a regular file of bounded size: a FIFO would block CLI11's read forever).
    if (!config_path.empty())
      flatshard::read_input_file(config_path, kMaxConfigBytes, "config file");
  } catch (const c10::Error& e) {
    std::cerr << kProgram << ": error: " << e.what_without_backtrace() << std::endl;
    return flatshard::tools::kExitUsage;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ConfigError& e) {
    // CLI11 names the key but not the file: say which file it was.
    const std::string& path = config_path;
    std::cerr << kProgram << ": error: config file '" << flatshard::printable_escape(path)
              << "': " << flatshard::printable_escape(e.what()) << std::endl;
    return flatshard::tools::kExitUsage;
  } catch (const CLI::ParseError& e) {
    return flatshard::tools::cli_exit(app, e, kProgram);
  }
  // The device and the ranks: usage errors before anything is read or run.
  const bool cuda = x.device == "cuda";
  std::optional<flatshard::LaunchEnv> launched;
  // Each rank says its own error; a launched rank other than 0 with its number.
  auto who = [&]() -> std::string {
    return launched && launched->rank != 0 ? "rank " + std::to_string(launched->rank) + ": " : "";
  };
  try {
    const bool world_given = app.count("--world") > 0, nproc_given = app.count("--nproc") > 0;
    if (world_given && nproc_given)
      throw fcli::UsageError("--nproc " + std::to_string(x.nproc) + " with --world " +
                             std::to_string(x.world) +
                             ": --world counts CPU threads, --nproc the processes --device cuda "
                             "launches; give one of them");
    if (nproc_given && !cuda)
      throw fcli::UsageError("--nproc " + std::to_string(x.nproc) +
                             " launches one process per GPU: it needs --device cuda (on cpu, "
                             "--world sets the ranks)");
    if (world_given && cuda)
      throw fcli::UsageError("--world " + std::to_string(x.world) +
                             " counts CPU threads: with --device cuda, --nproc sets the processes "
                             "(or torchrun / srun / mpirun does)");
    c.peak_tflops = fcli::peak_tflops(*x.peak, x.peak_tflops, cuda);
    if (c.sharding.param_dtype == "fp16")
      throw fcli::UsageError("--param-dtype fp16 needs a gradient scaler, which flatshard-train "
                             "does not have: use bf16");
    fcli::check_offload_step_optimizer(c.sharding, c.optimizer == "fused");
    if (cuda) {
      launched = fcli::launcher_env();  // the parser's message, naming the variable
      const std::string why = fcli::cuda_unavailable_reason();
      if (!why.empty()) throw fcli::UsageError(why);
      const int gpus = fcli::cuda_device_count();
      if (launched && launched->local_rank >= gpus)
        throw fcli::UsageError("local rank " + std::to_string(launched->local_rank) +
                               " has no GPU: " + std::to_string(gpus) + " visible");
      if (!launched) {
        if (gpus < 1) throw fcli::UsageError("--device cuda: no CUDA device is visible");
        const int n = nproc_given ? x.nproc : gpus;
        if (n > gpus)
          throw fcli::UsageError("--nproc " + std::to_string(n) + " exceeds the " +
                                 std::to_string(gpus) + " visible GPUs (one rank per GPU)");
        x.nproc = n;
      }
    }
  } catch (const fcli::UsageError& e) {
    std::cerr << kProgram << ": " << who() << "error: " << e.what() << std::endl;
    return flatshard::tools::kExitUsage;
  }
  try {
    if (app.count("--resume") > 0 && c.resume.empty()) c.resume = "latest";
    c.token_dtype = flatshard::data::parse_token_dtype(x.token_dtype);
    c.schedule.decay = x.decay == "cosine"   ? ft::Decay::kCosine
                       : x.decay == "linear" ? ft::Decay::kLinear
                                           : ft::Decay::kConstant;
    c.schedule.steps = c.steps;
    for (const auto& [name, v] : {std::pair<const char*, double>{"--lr", c.schedule.lr},
                                  {"--min-lr", c.schedule.min_lr},
                                  {"--weight-decay", c.weight_decay},
                                  {"--beta1", c.beta1},
                                  {"--beta2", c.beta2},
                                  {"--clip", c.clip}})
      TORCH_CHECK(std::isfinite(v) && v >= 0, name, " ", v, ": expected a finite number >= 0");
    TORCH_CHECK(c.beta1 < 1 && c.beta2 < 1, "--beta1 ", c.beta1, " / --beta2 ", c.beta2,
                ": expected values below 1");
    TORCH_CHECK(c.schedule.lr > 0 && c.schedule.min_lr >= 0 && c.schedule.min_lr <= c.schedule.lr,
                "--lr ", c.schedule.lr, " / --min-lr ", c.schedule.min_lr,
                ": expected 0 <= min-lr <= lr and lr > 0");
    TORCH_CHECK(c.schedule.warmup <= c.steps, "--warmup ", c.schedule.warmup,
                " is more than --steps ", c.steps);
    TORCH_CHECK(c.hf_dir.empty() || c.model.family == "llama",
                "--hf loads the llama family; --model ", c.model.family, " cannot");
    if (!cuda) {
      flatshard::run_ranks(
          x.world, [&](flatshard::Communicator& comm) { ft::train_rank(c, comm); },
          std::chrono::minutes(10));
    } else if (!launched) {
      // Every rank fails alike (same flags, same files), so any failure stops the others. The
      // ranks said why; this tool's exit codes stay its own (the others' SIGTERM is not one).
      const int rc = fcli::launch_local_ranks(x.nproc, argv, /*failed_from=*/1);
      return rc == 0 ? 0 : rc == flatshard::tools::kExitUsage ? rc : 1;
    } else {
      fcli::CudaRank rank = fcli::open_cuda_rank(launched->local_rank, kProgram);
      ft::train_rank(c, *rank.comm, rank.hooks);
      rank.close();
    }
    flatshard::flush_stdout();
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    msg = msg.substr(0, msg.find('\n'));
    std::cerr << kProgram << ": " << who() << "error: " << msg << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << kProgram << ": " << who() << "error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
