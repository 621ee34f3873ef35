// flatshard/benchmarks/bench_options.cpp — see bench_options.h for the contract.
#include "benchmarks/bench_options.h"

#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <iostream>
#include <limits>
#include <sstream>

#include "cli/numbers.h"
#include "support/input_file.h"
#include "tools/cli_exit.h"

namespace flatshard {
namespace bench {

namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr const char* kDefaultGranularities = "local,leaf,layer,every-2,model,noshard";

const char* kFooter = R"(Policies: named plans and specs (comma list; default local,leaf,layer,every-2,model,noshard):
  local     unsharded, no communication: the floor (plain model + AdamW). On cpu every rank
            thread trains its own replica at once, so the floor shares the cores too
  leaf      every Linear/LayerNorm/Embedding is a unit (the ZeRO-3-like extreme; llama:
            Linear/RMSNorm/Embedding)
  layer     one unit per transformer layer            (policy type=Block; llama: DecoderLayer)
  every-K   K consecutive layers per unit             (policy every=K,type=Block)
  model     the whole model is one unit (the root only)
  noshard   per-layer units and the root, all NO_SHARD (DDP-like: gradients all-reduced)
  SPEC      any wrap-policy spec, e.g. 'size>=1e6' or 'noshard:path=lm_head;type=Block'.
            A piece that is not one of the names above continues the spec before it, so
            'every=2,type=Block' stays one spec; give two specs with commas in two flags.
            'recompute:type=Block' recomputes the layers (activation checkpointing), so
            '--policy layer,recompute:type=Block' measures with and without it.

Defaults:  cpu: preset small with --seq 128, batch 2, 5 steps, fp32, 2 ranks as threads
           cuda: preset 1b, batch 4, 20 steps, bf16 params, one process per visible GPU
Every run uses the same seed and data; the step-0 loss of rank 0 must match `local` (or the
first run) within 1e-4 relative (fp32) / 2e-2 (bf16, fp16), else check=FAIL and exit code 1.
fp16 (GPUs without bf16: V100, T4): sharded runs train with flatshard::ShardedGradScaler
(fsdp/grad_scaler.h; a step with inf/NaN gradients on any rank is skipped on every rank).
Old flag names, still accepted with a note (docs/vocabulary.md): --granularity = --policy,
--nproc = --world.
FLATSHARD_TRACE=run.json: one trace per sharded run, run.<run>.rank<R>.json, each named on stderr.
Exit codes: 0 ok, 1 a check failed, 2 usage error (one line on stderr), 3 runtime error.)";

// Old flag names (docs/vocabulary.md): flatshard-explain's names are the ones both tools use.
const std::vector<tools::FlagRename> kRenames = {
    {"--granularity", "--policy", /*repeatable=*/true}, {"--nproc", "--world"}};

c10::ScalarType parse_dtype(const std::string& s) {
  if (s == "fp16") return c10::kHalf;
  return s == "bf16" ? c10::kBFloat16 : c10::kFloat;
}

ShardingStrategy parse_strategy(const std::string& s) {
  if (s == "grad_op") return ShardingStrategy::kShardGradOp;
  if (s == "noshard") return ShardingStrategy::kNoShard;
  return ShardingStrategy::kFullShard;
}

// c10::Error::what() carries a backtrace and sometimes several lines; a usage error is one line.
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

template <class T>
void require(bool ok, const std::string& flag, const char* what, T value) {
  if (ok) return;
  std::ostringstream os;
  os << flag << " must be " << what << ", got " << value;
  throw UsageError(os.str());
}

}  // namespace

const char* to_string(DeviceKind d) { return d == DeviceKind::kCuda ? "cuda" : "cpu"; }

const char* dtype_name(c10::ScalarType t) {
  if (t == c10::kHalf) return "fp16";
  return t == c10::kBFloat16 ? "bf16" : "fp32";
}

ParseResult parse_command_line(int argc, char** argv) {
  CLI::App app{
      "flatshard-bench: trains a GPT (or --model llama) for a few steps at several sharding granularities and "
      "reports collectives, bytes, step time, throughput, MFU, exposed communication and peak "
      "memory per granularity, checking that every run computes the same loss.",
      "flatshard-bench"};
  app.footer(kFooter);

  std::string family = "gpt", preset, device = "cpu", strategy = "full", param_dtype, reduce_dtype,
      optimizer = "adamw", init = "deferred", offload_step = "after";
  int64_t layers = 0, d_model = 0, heads = 0, seq = 0, vocab = 0, batch = 0;
  int nproc = 0, prefetch = 1, warmup = 2, steps = 0, kernel_profile = 0;
  uint64_t seed = 0;
  double peak_tflops = 0;
  BenchOptions o;

  auto* g_model = "Model";
  app.add_option("--model", family,
                 "model family (models/family.h; default gpt): " + models::families_help())
      ->check(CLI::IsMember(models::family_names()))
      ->group(g_model);
  auto* o_preset =
      app.add_option("--preset", preset, "the family's preset (default: see below)")
          ->check(CLI::IsMember(models::all_preset_names()))
          ->group(g_model);
  auto* o_layers =
      app.add_option("--layers", layers, "override: transformer blocks")->group(g_model);
  auto* o_dmodel = app.add_option("--d-model", d_model, "override: model width")->group(g_model);
  auto* o_heads = app.add_option("--heads", heads, "override: attention heads (divide d-model)")
                      ->group(g_model);
  auto* o_seq = app.add_option("--seq", seq, "override: sequence length")->group(g_model);
  auto* o_vocab = app.add_option("--vocab", vocab, "override: vocabulary size")->group(g_model);
  auto* o_batch = app.add_option("--batch", batch, "sequences per rank per step (cpu 2, cuda 4)")
                      ->group(g_model);

  // Decimal only (cli/numbers.h): CLI11 alone reads "010" as 8 and "0x10" as 16.
  for (CLI::Option* opt : {o_layers, o_dmodel, o_heads, o_seq, o_vocab, o_batch})
    opt->transform(cli::integer(std::numeric_limits<int64_t>::min(), kInt64Max));

  auto* g_shard = "Sharding (applies to every run)";
  app.add_option("--policy", o.granularity_flags,
                 "named plans / policy specs, comma list (below); repeatable (old name "
                 "--granularity)")
      ->type_name("LIST")
      ->allow_extra_args(false)
      ->group(g_shard);
  app.add_flag("--recompute", o.recompute,
               "recompute every non-root unit's forward in backward (activation checkpointing; "
               "runs are labelled GRANULARITY+recompute; 'local' stays as is)")
      ->group(g_shard);
  app.add_option("--offload", o.offload_levels,
                 "CPU offload levels, comma list of 0 | 1 | 2: 1 keeps fp32 master, gradients "
                 "and optimizer state in pinned host memory (optimizer on the CPU), 2 the bf16 "
                 "shard too; each level is a run of every granularity but 'local' (default 0)")
      ->delimiter(',')
      ->transform(cli::integer())
      ->check(CLI::Range(0, 2))
      ->group(g_shard);
  app.add_option("--offload-step", offload_step,
                 "when offloaded units' CPU optimizer steps: after (in optimizer.step(), "
                 "default) | backward (per unit during backward, overlapping the GPU; exact; "
                 "runs labelled GRANULARITY+offloadN+bwdstep) | delayed (ZeRO-Offload's "
                 "one-step-delayed update: step N's CPU update runs beside step N+1's forward "
                 "and backward, so parameters are ONE STEP STALE; level 1 only; +delayed); "
                 "backward and delayed need --optimizer fused")
      ->check(CLI::IsMember({"after", "backward", "delayed"}))
      ->group(g_shard);
  app.add_option("--strategy", strategy, "default sharding strategy: full | grad_op | noshard")
      ->check(CLI::IsMember({"full", "grad_op", "noshard"}))
      ->group(g_shard);
  app.add_option("--prefetch", prefetch, "forward and backward prefetch depth (default 1)")
      ->transform(cli::integer())
      ->group(g_shard);
  auto* o_pdt = app.add_option("--param-dtype", param_dtype,
                               "fp32 | bf16 | fp16: gathered params and compute (cpu fp32, "
                               "cuda bf16); fp16 trains with a gradient scaler")
                    ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
                    ->group(g_shard);
  auto* o_rdt = app.add_option("--reduce-dtype", reduce_dtype,
                               "fp32 | bf16 | fp16: gradient reduction (default: the param dtype)")
                    ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
                    ->group(g_shard);
  app.add_flag("--keep-low-precision-grads",
               o.sharding.mixed_precision.keep_low_precision_grads,
               "master gradients stay in the reduce dtype (MixedPrecision::"
               "keep_low_precision_grads): no upcast, half the gradient memory; runs labelled "
               "GRANULARITY+lpgrads ('local' as is); not with --offload levels above 0 or "
               "fp16's gradient scaler")
      ->group(g_shard);

  auto* g_run = "Run";
  app.add_option("--device", device, "cpu (ranks as threads) | cuda (one process per GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->group(g_run);
  auto* o_nproc = app.add_option("--world", nproc,
                                 "ranks (old name --nproc). cpu: threads (default 2). cuda: "
                                 "processes to launch on this host (default: one per visible "
                                 "GPU; under torchrun/srun/mpirun the launcher decides)")
                      ->transform(cli::integer())
                      ->group(g_run);
  app.add_option("--warmup", warmup, "untimed steps per run (default 2)")
      ->transform(cli::integer())
      ->group(g_run);
  auto* o_steps = app.add_option("--steps", steps, "timed steps per run (cpu 5, cuda 20)")
                      ->transform(cli::integer())
                      ->group(g_run);
  app.add_option("--seed", seed, "model init and data seed (default 0)")
      ->transform(cli::unsigned64())  // CLI11 alone saturates past 2^64 - 1 and wraps "-1"
      ->group(g_run);
  app.add_option("--optimizer", optimizer,
                 "adamw: torch::optim::AdamW (default) | fused: flatshard::FusedAdamW (one fused "
                 "ATen kernel per device and dtype); every run, local included, uses it")
      ->check(CLI::IsMember({"adamw", "fused"}))
      ->group(g_run);
  app.add_flag("--param-groups", o.param_groups,
               "two optimizer groups by parameter name (no weight decay on norms and biases), "
               "over ShardedModel::named_parameters(): per-parameter shard views instead of one "
               "master per unit (local: the model's parameters); measures what groups cost")
      ->group(g_run);
  app.add_option("--init", init,
                 "deferred: sharded runs build the model on the meta device and fully_shard "
                 "initialises it unit by unit on the device (default) | eager: build it on the "
                 "host in fp32 first; local runs are always eager. Setup time and peak are "
                 "reported either way")
      ->check(CLI::IsMember({"eager", "deferred"}))
      ->group(g_run);
  auto* o_kprof =
      app.add_option("--kernel-profile", kernel_profile,
                     "cuda: after the measured steps, profile N more (PyTorch profiler, CUPTI) "
                     "and print rank 0's device time per step by kernel category and name")
          ->transform(cli::integer())
          ->group(g_run);
  auto* o_sync =
      app.add_flag("--sync-debug",
                   "cuda: warn at every synchronizing CUDA call while a measured step is issued "
                   "(c10's sync debug mode; TORCH_SHOW_CPP_STACKTRACES=1 adds the caller's "
                   "stack): what makes a step's host wait for the device (with CPU offload, "
                   "the end of backward's one sync is expected)")
          ->group(g_run);
  auto* o_peak = app.add_option("--peak-tflops", peak_tflops,
                                "peak TFLOP/s per rank for MFU (cuda default 989: H100/H200 "
                                "bf16 dense; cpu: MFU is - unless given)")
                     ->check(cli::number())
                     ->group(g_run);

  auto* g_out = "Output";
  app.add_option("--json", o.json_path, "write the results as JSON to PATH")
      ->type_name("PATH")
      ->group(g_out);
  app.add_option("--csv", o.csv_path, "write the results as CSV to PATH")
      ->type_name("PATH")
      ->group(g_out);
  app.add_option("--plot", o.plot_path, "write an SVG bar chart (step time, peak memory) to PATH")
      ->type_name("PATH")
      ->group(g_out);
  auto* o_profile = app.add_option("--write-profile", o.profile_path,
                 "write the machine profile these runs measure (planner/machine_profile.h; "
                 "benchmarks/bench_profile.h says which numbers) to PATH, for flatshard-explain "
                 "--profile")
      ->type_name("PATH")
      ->group(g_out);

  std::vector<std::string> notes;
  try {
    notes = tools::rename_old_flags(argc, argv, kRenames);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    ParseResult r;
    r.exit_now = true;
    return r;
  } catch (const CLI::ParseError& e) {
    std::string msg = tools::usage_message(app, e);  // "did you mean --policy?"
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    throw UsageError(printable_escape(msg));  // CLI11 quotes the user's value: no raw ESC
  }
  // A granularity or policy spec is printable text: one with control bytes (ESC, BEL) would be
  // echoed raw to the terminal by every later error that names it.
  for (const auto& flag : o.granularity_flags)
    if (printable_escape(flag) != flag)
      throw UsageError("--policy '" + printable_escape(flag) +
                       "': control characters are not part of any granularity or policy spec");
  if (o_profile->count() && o.profile_path.empty())
    throw UsageError("--write-profile needs a file path, got ''");
  for (const auto& [flag, path] : {std::pair<const char*, const std::string*>{"--json", &o.json_path},
                                   {"--csv", &o.csv_path},
                                   {"--plot", &o.plot_path}})
    if (app.count(flag) && path->empty())
      throw UsageError(std::string(flag) + " needs a file path, got ''");

  o.device = device == "cuda" ? DeviceKind::kCuda : DeviceKind::kCpu;
  const bool cuda = o.device == DeviceKind::kCuda;

  o.preset = o_preset->count() ? preset : (cuda ? "1b" : "small");
  try {
    o.model = models::ModelConfig::preset(family, o.preset);
  } catch (const c10::Error& e) {
    throw UsageError("--model " + family + ": " + first_line(e.what_without_backtrace()));
  }
  if (!o_preset->count() && !cuda) o.model.seq_len() = 128;
  auto override_size = [](CLI::Option* opt, int64_t value, int64_t& field) {
    if (!opt->count()) return;
    require(value > 0, opt->get_name(), "> 0", value);
    field = value;
  };
  override_size(o_layers, layers, o.model.n_layers());
  override_size(o_dmodel, d_model, o.model.d_model());
  override_size(o_heads, heads, o.model.n_heads());
  override_size(o_seq, seq, o.model.seq_len());
  override_size(o_vocab, vocab, o.model.vocab());
  if (o.model.d_model() % o.model.n_heads() != 0) {
    std::ostringstream os;
    os << "--heads " << o.model.n_heads() << " does not divide --d-model " << o.model.d_model();
    throw UsageError(os.str());
  }
  try {
    o.model.validate();
  } catch (const c10::Error& e) {
    throw UsageError(first_line(e.what_without_backtrace()));
  }
  o.batch = cuda ? 4 : 2;
  override_size(o_batch, batch, o.batch);

  if (o.granularity_flags.empty()) o.granularity_flags.push_back(kDefaultGranularities);

  o.sharding.strategy = parse_strategy(strategy);
  require(prefetch >= 0, "--prefetch", ">= 0", prefetch);
  o.fused_optimizer = optimizer == "fused";
  if (offload_step != "after") {
    if (!o.fused_optimizer)
      throw UsageError("--offload-step " + offload_step +
                       " steps units through flatshard::FusedAdamW: add --optimizer fused");
    o.sharding.offload_step =
        offload_step == "backward" ? OffloadStep::kBackward : OffloadStep::kDelayed;
    if (o.sharding.offload_step == OffloadStep::kDelayed)
      for (int level : o.offload_levels)
        if (level == 2)
          throw UsageError("--offload-step delayed runs offload level 1 only (level 2 uploads "
                           "the master at every gather, while the delayed step writes it): "
                           "drop 2 from --offload");
  }
  o.deferred_init = init == "deferred";
  o.sharding.forward_prefetch = prefetch;
  o.sharding.backward_prefetch = prefetch;
  const c10::ScalarType pdt =
      o_pdt->count() ? parse_dtype(param_dtype) : (cuda ? c10::kBFloat16 : c10::kFloat);
  o.sharding.mixed_precision.param_dtype = pdt;
  o.sharding.mixed_precision.reduce_dtype = o_rdt->count() ? parse_dtype(reduce_dtype) : pdt;
  if (o.sharding.mixed_precision.keep_low_precision_grads) {
    if (pdt == c10::kHalf)
      throw UsageError("--keep-low-precision-grads cannot run with --param-dtype fp16: its "
                       "gradient scaler unscales fp32 gradients only");
    for (int level : o.offload_levels)
      if (level > 0)
        throw UsageError("--keep-low-precision-grads cannot run with --offload " +
                         std::to_string(level) + ": offloaded gradients take the host path");
  }
  if (pdt == c10::kHalf && o.sharding.offload_step != OffloadStep::kAfterBackward)
    throw UsageError("--param-dtype fp16 trains with a gradient scaler, which must see the "
                     "gradients before any step: it cannot run with --offload-step " +
                     offload_step);

  o.nproc_given = o_nproc->count() > 0;
  o.nproc = o.nproc_given ? nproc : (cuda ? 0 : 2);  // cuda 0: resolved to the GPU count later
  if (o.nproc_given) require(nproc >= 1, "--world", ">= 1", nproc);
  require(warmup >= 0, "--warmup", ">= 0", warmup);
  o.warmup = warmup;
  o.steps = o_steps->count() ? steps : (cuda ? 20 : 5);
  require(o.steps >= 1, "--steps", ">= 1", o.steps);
  o.seed = seed;
  if (o_kprof->count()) {
    require(kernel_profile >= 1, "--kernel-profile", ">= 1", kernel_profile);
    if (!cuda)
      throw UsageError("--kernel-profile records GPU kernels: it needs --device cuda");
    o.kernel_profile_steps = kernel_profile;
  }
  if (o_sync->count()) {
    if (!cuda)
      throw UsageError("--sync-debug watches CUDA synchronisation: it needs --device cuda");
    o.sync_debug = true;
  }
  if (o_peak->count()) {
    require(peak_tflops > 0, "--peak-tflops", "> 0", peak_tflops);
    o.peak_tflops = peak_tflops;
  } else if (cuda) {
    o.peak_tflops = 989.0;
  }
  ParseResult r;
  r.options = std::move(o);
  r.notes = std::move(notes);
  return r;
}

}  // namespace bench
}  // namespace flatshard
