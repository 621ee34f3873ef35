// flatshard/benchmarks/bench_options.cpp — see bench_options.h for the contract.
#include "benchmarks/bench_options.h"

#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <iostream>
#include <limits>
#include <sstream>

#include "cli/numbers.h"
#include "cli/options.h"
#include "fsdp/resolve.h"
#include "wrap_policies/tp_plan.h"
#include "support/input_file.h"
#include "cli/exit.h"

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
first run) within 1e-4 relative (fp32) / 2e-2 (bf16, fp16, quantized gathers, --fp8), and a sharded run's losses after
each optimizer step must match an unsharded fp32 reference trained on every rank's batch within
1e-4 (fp32) / 1e-2 (bf16, fp16, --gather-dtype fp8 / int8, or --fp8), else check=FAIL and exit code 1
(benchmarks/bench_report.h).
fp16 (GPUs without bf16: V100, T4): sharded runs train with flatshard::ShardedGradScaler
(fsdp/grad_scaler.h; a step with inf/NaN gradients on any rank is skipped on every rank).
Old flag names, still accepted with a note (docs/vocabulary.md): --granularity = --policy,
--nproc = --world.
FLATSHARD_TRACE=run.json: one trace per sharded run, run.<run>.rank<R>.json, each named on stderr.
Exit codes: 0 ok, 1 a check failed, 2 usage error (one line on stderr), 3 runtime error.)";

// Old flag names (docs/vocabulary.md): flatshard-explain's names are the ones both tools use.
const std::vector<tools::FlagRename> kRenames = {
    {"--granularity", "--policy", /*repeatable=*/true}, {"--nproc", "--world"}};

// c10::Error::what() carries a backtrace and sometimes several lines; a usage error is one line.
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

template <class T>
void require(bool ok, const std::string& flag, const char* what, T value) {
  if (ok) return;
  std::ostringstream os;
  os << flag << " must be " << what << ", got " << value;
  throw UsageError(os.str());
}

// The raw values of the flags, before the device-dependent defaults and the checks.
struct Flags {
  cli::ModelFlags model;        // --model, --preset, the size overrides, --seq
  cli::ShardingFlags sharding;  // --strategy, dtypes, --prefetch, --offload-step, ...
  std::string device = "cpu", optimizer = "adamw", init = "deferred", moments = "fp32";
  int64_t batch = 0;
  int nproc = 0, warmup = 2, steps = 0, kernel_profile = 0, tp = 1;
  std::string tp_plan;  // --tp-plan as given
  uint64_t seed = 0;
  double peak_tflops = 0;
  // The options whose count() a default or a check depends on.
  CLI::Option *preset, *batch_opt, *nproc_opt, *steps_opt, *kprof, *sync, *peak, *profile, *graph,
      *tp_plan_opt;
};

void add_model_flags(CLI::App& app, Flags& f) {
  const char* group = "Model";
  f.preset = cli::add_model_flags(app, f.model, group, "default: see below",
                                  "override: sequence length")
                 .preset;
  cli::add_fp8_flag(app, f.model, group);
  f.batch_opt = app.add_option("--batch", f.batch, "sequences per rank per step (cpu 2, cuda 4)")
                    ->transform(cli::integer(1, kInt64Max))
                    ->group(group);
}

void add_sharding_flags(CLI::App& app, Flags& f, BenchOptions& o) {
  const char* group = "Sharding (applies to every run)";
  app.add_option("--policy", o.policies,
                 "named plans / policy specs, comma list (below); repeatable (old name "
                 "--granularity)")
      ->type_name("LIST")
      ->allow_extra_args(false)
      ->group(group);
  app.add_flag("--recompute", o.recompute,
               "recompute every non-root unit's forward in backward (activation checkpointing; "
               "runs are labelled GRANULARITY+recompute; 'local' stays as is)")
      ->group(group);
  app.add_option("--offload", o.offload_levels,
                 "CPU offload levels, comma list of 0 | 1 | 2: 1 keeps fp32 master, gradients "
                 "and optimizer state in pinned host memory (optimizer on the CPU), 2 the bf16 "
                 "shard too; each level is a run of every granularity but 'local' (default 0)")
      ->delimiter(',')
      ->transform(cli::integer())
      ->check(CLI::Range(0, 2))
      ->group(group);
  // Runs are labelled GRANULARITY+offloadN+bwdstep / +delayed, GRANULARITY+lpgrads.
  cli::add_sharding_flags(app, f.sharding, group, "cpu fp32, cuda bf16");
  cli::add_tp_flag(app, f.tp, group,
                   "--world counts every rank: shard x tp; cpu only ('local' stays unsplit)");
  f.tp_plan_opt = app.add_option("--tp-plan", f.tp_plan,
                                 "the TP plan for --tp (wrap_policies/tp_plan.h text form, e.g. "
                                 "'colwise:path=*.mlp.fc;rowwise:path=*.mlp.proj'); default: "
                                 "the model family's")
                      ->type_name("SPEC")
                      ->group(group);
}

void add_run_flags(CLI::App& app, Flags& f, BenchOptions& o) {
  const char* group = "Run";
  app.add_option("--device", f.device, "cpu (ranks as threads) | cuda (one process per GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->group(group);
  f.nproc_opt = app.add_option("--world", f.nproc,
                               "ranks (old name --nproc). cpu: threads (default 2). cuda: "
                               "processes to launch on this host (default: one per visible "
                               "GPU; under torchrun/srun/mpirun the launcher decides)")
                    ->transform(cli::integer())
                    ->group(group);
  app.add_option("--warmup", f.warmup, "untimed steps per run (default 2)")
      ->transform(cli::integer())
      ->group(group);
  f.steps_opt = app.add_option("--steps", f.steps, "timed steps per run (cpu 5, cuda 20)")
                    ->transform(cli::integer())
                    ->group(group);
  app.add_option("--seed", f.seed, "model init and data seed (default 0)")
      ->transform(cli::unsigned64())  // CLI11 alone saturates past 2^64 - 1 and wraps "-1"
      ->group(group);
  app.add_option("--optimizer", f.optimizer,
                 "adamw: torch::optim::AdamW (default) | fused: flatshard::FusedAdamW (one fused "
                 "ATen kernel per device and dtype); every run, local included, uses it")
      ->check(CLI::IsMember({"adamw", "fused"}))
      ->group(group);
  app.add_option("--adamw-moments", f.moments,
                 "fp32 (default) | bf16: FusedAdamW keeps fp32 parameters' two moments in bf16 "
                 "(Note [Low-precision moments], optim/fused_adamw.h; 8 B per parameter less); "
                 "needs --optimizer fused")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->group(group);
  app.add_flag("--param-groups", o.param_groups,
               "two optimizer groups by parameter name (no weight decay on norms and biases), "
               "over ShardedModel::named_parameters(): per-parameter shard views instead of one "
               "master per unit (local: the model's parameters); measures what groups cost")
      ->group(group);
  app.add_option("--init", f.init,
                 "deferred: sharded runs build the model on the meta device and fully_shard "
                 "initialises it unit by unit on the device (default) | eager: build it on the "
                 "host in fp32 first; local runs are always eager. Setup time and peak are "
                 "reported either way")
      ->check(CLI::IsMember({"eager", "deferred"}))
      ->group(group);
  f.kprof = app.add_option("--kernel-profile", f.kernel_profile,
                           "cuda: after the measured steps, profile N more (PyTorch profiler, "
                           "CUPTI) and print rank 0's device time per step by kernel category "
                           "and name")
                ->transform(cli::integer())
                ->group(group);
  f.sync = app.add_flag("--sync-debug",
                        "cuda: warn at every synchronizing CUDA call while a measured step is "
                        "issued (c10's sync debug mode; TORCH_SHOW_CPP_STACKTRACES=1 adds the "
                        "caller's stack): what makes a step's host wait for the device (with "
                        "CPU offload, the end of backward's one sync is expected)")
               ->group(group);
  f.graph = app.add_flag("--cuda-graph",
                         "cuda, world 1: sharded runs capture forward + backward as one CUDA "
                         "graph after their warmup and replay it each step; the optimizer stays "
                         "eager (flatshard::CudaGraphStep, Note [CUDA graph step]); runs are "
                         "labelled GRANULARITY+graph, 'local' stays eager; turns the NCCL "
                         "watchdog off unless FLATSHARD_NCCL_WATCHDOG is set")
                ->group(group);
  f.peak = cli::add_peak_tflops_flag(app, f.peak_tflops, group);
}

void add_output_flags(CLI::App& app, Flags& f, BenchOptions& o) {
  const char* group = "Output";
  app.add_option("--json", o.json_path, "write the results as JSON to PATH")
      ->type_name("PATH")
      ->group(group);
  app.add_option("--csv", o.csv_path, "write the results as CSV to PATH")
      ->type_name("PATH")
      ->group(group);
  app.add_option("--plot", o.plot_path, "write an SVG bar chart (step time, peak memory) to PATH")
      ->type_name("PATH")
      ->group(group);
  f.profile = app.add_option("--write-profile", o.profile_path,
                             "write the machine profile these runs measure "
                             "(planner/machine_profile.h; benchmarks/bench_profile.h says which "
                             "numbers) to PATH, for flatshard-explain --profile")
                  ->type_name("PATH")
                  ->group(group);
}

// Values CLI11 accepted that the bench still refuses: control bytes in a policy, empty paths.
void check_texts(const CLI::App& app, const Flags& f, const BenchOptions& o) {
  // A granularity or policy spec is printable text: one with control bytes (ESC, BEL) would be
  // echoed raw to the terminal by every later error that names it.
  if (printable_escape(f.tp_plan) != f.tp_plan)
    throw UsageError("--tp-plan '" + printable_escape(f.tp_plan) +
                     "': control characters are not part of a tp plan spec");
  for (const auto& flag : o.policies)
    if (printable_escape(flag) != flag)
      throw UsageError("--policy '" + printable_escape(flag) +
                       "': control characters are not part of any granularity or policy spec");
  if (f.profile->count() && o.profile_path.empty())
    throw UsageError("--write-profile needs a file path, got ''");
  for (const auto& [flag, path] : {std::pair<const char*, const std::string*>{"--json", &o.json_path},
                                   {"--csv", &o.csv_path},
                                   {"--plot", &o.plot_path}})
    if (app.count(flag) && path->empty())
      throw UsageError(std::string(flag) + " needs a file path, got ''");
}

// The model: the family's preset (cpu small with seq 128, cuda 1b) and the overrides.
void resolve_model(const Flags& f, bool cuda, BenchOptions& o) {
  o.preset = f.preset->count() ? f.model.preset : (cuda ? "1b" : "small");
  try {
    o.model = f.model.config(o.preset);
  } catch (const c10::Error& e) {
    throw UsageError("--model " + f.model.family + ": " + first_line(e.what_without_backtrace()));
  }
  if (!f.preset->count() && !cuda && !f.model.seq) o.model.seq_len() = 128;
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
  o.batch = f.batch_opt->count() ? f.batch : (cuda ? 4 : 2);
}

// The sharding options. What a unit cannot run is resolve_unit's to say (fsdp/resolve.h, one
// home for the rule); the bench adds what its own optimizer and gradient scaler need.
void resolve_sharding(const Flags& f, bool cuda, BenchOptions& o) {
  if (o.policies.empty()) o.policies.push_back(kDefaultGranularities);
  o.fused_optimizer = f.optimizer == "fused";
  o.bf16_moments = f.moments == "bf16";
  if (o.bf16_moments && !o.fused_optimizer)
    throw UsageError("--adamw-moments bf16 is a flatshard::FusedAdamW option: add --optimizer fused");
  o.sharding = cli::sharding_options(f.sharding, cuda ? c10::kBFloat16 : c10::kFloat);
  const std::string& step = f.sharding.offload_step;
  cli::check_offload_step_optimizer(f.sharding, o.fused_optimizer);
  const auto& mp = o.sharding.mixed_precision;
  if (mp.param_dtype == c10::kHalf && mp.keep_low_precision_grads)
    throw UsageError("--keep-low-precision-grads cannot run with --param-dtype fp16: its "
                     "gradient scaler unscales fp32 gradients only");
  if (mp.param_dtype == c10::kHalf && o.sharding.offload_step != OffloadStep::kAfterBackward)
    throw UsageError("--param-dtype fp16 trains with a gradient scaler, which must see the "
                     "gradients before any step: it cannot run with --offload-step " + step);
  for (int level : o.offload_levels) {
    if (level == 0) continue;  // nothing to refuse (and resolve_unit reads FLATSHARD_DEBUG)
    UnitSpec every_unit;
    every_unit.name = "*";
    every_unit.options.offload = level;
    try {
      resolve_unit(every_unit, o.sharding, /*shard_world_size=*/1);
    } catch (const c10::Error& e) {
      throw UsageError("--offload " + std::to_string(level) + " with --offload-step " + step +
                       (mp.keep_low_precision_grads ? " --keep-low-precision-grads" : "") +
                       ": " + first_line(e.what_without_backtrace()));
    }
  }
  o.deferred_init = f.init == "deferred";
}

// --tp and --tp-plan: the plan's text parsed (its caret error as the usage error) and printed
// back; the world split into tp groups. Whether the plan fits the model (heads, sizes, rules
// that match nothing) is parallelize()'s check, which plan_granularities asks before any run.
void resolve_tp(const Flags& f, bool cuda, BenchOptions& o) {
  o.tp = f.tp;
  if (f.tp_plan_opt->count() && o.tp == 1)
    throw UsageError("--tp-plan '" + printable_escape(f.tp_plan) +
                     "' splits modules over tp ranks: add --tp N (N >= 2)");
  if (o.tp == 1) return;
  if (cuda)
    throw UsageError("--tp " + std::to_string(o.tp) +
                     " runs on --device cpu only for now (the NCCL tp groups are not wired into "
                     "the bench yet, issue 51)");
  if (!o.profile_path.empty())
    throw UsageError("--write-profile measures a data-parallel machine profile: run it without "
                     "--tp " + std::to_string(o.tp));
  if (o.nproc % o.tp != 0) {
    std::ostringstream os;
    os << "--world " << o.nproc << " is not a multiple of --tp " << o.tp
       << " (--world counts every rank: shard x tp)";
    throw UsageError(os.str());
  }
  const std::string spec = f.tp_plan_opt->count() ? f.tp_plan : o.model.family().modules().tp_plan;
  if (spec.empty())
    throw UsageError("--tp " + std::to_string(o.tp) + ": model family '" +
                     o.model.family().name() + "' has no default tp plan; give --tp-plan");
  try {
    o.tp_plan = parse_tp_plan(spec).to_spec();
  } catch (const c10::Error& e) {
    std::string msg = e.what_without_backtrace();
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    throw UsageError("--tp-plan: " + msg);
  }
}

// Ranks, steps, seed and the cuda-only diagnostics.
void resolve_run(const Flags& f, bool cuda, BenchOptions& o) {
  o.nproc_given = f.nproc_opt->count() > 0;
  o.nproc = o.nproc_given ? f.nproc : (cuda ? 0 : 2);  // cuda 0: resolved to the GPU count later
  if (o.nproc_given) require(f.nproc >= 1, "--world", ">= 1", f.nproc);
  require(f.warmup >= 0, "--warmup", ">= 0", f.warmup);
  o.warmup = f.warmup;
  o.steps = f.steps_opt->count() ? f.steps : (cuda ? 20 : 5);
  require(o.steps >= 1, "--steps", ">= 1", o.steps);
  o.seed = f.seed;
  if (f.kprof->count()) {
    require(f.kernel_profile >= 1, "--kernel-profile", ">= 1", f.kernel_profile);
    if (!cuda)
      throw UsageError("--kernel-profile records GPU kernels: it needs --device cuda");
    o.kernel_profile_steps = f.kernel_profile;
  }
  if (f.sync->count()) {
    if (!cuda)
      throw UsageError("--sync-debug watches CUDA synchronisation: it needs --device cuda");
    o.sync_debug = true;
  }
  if (f.graph->count()) {
    if (!cuda) throw UsageError("--cuda-graph captures CUDA work: it needs --device cuda");
    for (int level : o.offload_levels)
      if (level > 0)
        throw UsageError("--cuda-graph cannot run with --offload " + std::to_string(level) +
                         ": host copies and the CPU optimizer are not capturable");
    if (o.sharding.offload_step != OffloadStep::kAfterBackward)
      throw UsageError("--cuda-graph cannot run with --offload-step other than after_backward");
    if (o.recompute)
      throw UsageError("--cuda-graph cannot run with --recompute: a recompute unit restores the "
                       "RNG state on the host, which a replay would not redo");
    if (o.param_groups)
      throw UsageError("--cuda-graph cannot run with --param-groups: named_parameters()' "
                       "gradient views are re-pointed on the host every step");
    if (o.sharding.mixed_precision.param_dtype == c10::kHalf)
      throw UsageError("--cuda-graph cannot run with --param-dtype fp16: its gradient scaler's "
                       "scale would be frozen into the graph");
    if (o.sharding.mixed_precision.gather_dtype != GatherDtype::kParam)
      throw UsageError("--cuda-graph needs the param dtype for gathers: the fp8 / int8 "
                       "gathers check their scales on the host");
    o.cuda_graph = true;
  }
  o.peak_tflops = cli::peak_tflops(*f.peak, f.peak_tflops, cuda);
  resolve_tp(f, cuda, o);
}

}  // namespace

const char* to_string(DeviceKind d) { return d == DeviceKind::kCuda ? "cuda" : "cpu"; }

ParseResult parse_command_line(int argc, char** argv) {
  CLI::App app{
      "flatshard-bench: trains a GPT (or --model llama) for a few steps at several sharding "
      "granularities and reports collectives, bytes, step time, throughput, MFU, exposed "
      "communication and peak memory per granularity, checking that every run computes the "
      "same losses.",
      "flatshard-bench"};
  app.footer(kFooter);
  Flags f;
  BenchOptions o;
  add_model_flags(app, f);
  add_sharding_flags(app, f, o);
  add_run_flags(app, f, o);
  add_output_flags(app, f, o);

  ParseResult r;
  try {
    r.notes = tools::rename_old_flags(argc, argv, kRenames);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    r.exit_now = true;
    return r;
  } catch (const CLI::ParseError& e) {
    std::string msg = tools::usage_message(app, e);  // "did you mean --policy?"
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    throw UsageError(printable_escape(msg));  // CLI11 quotes the user's value: no raw ESC
  }
  check_texts(app, f, o);
  o.device = f.device == "cuda" ? DeviceKind::kCuda : DeviceKind::kCpu;
  const bool cuda = o.device == DeviceKind::kCuda;
  resolve_model(f, cuda, o);
  resolve_sharding(f, cuda, o);
  resolve_run(f, cuda, o);
  r.options = std::move(o);
  return r;
}

}  // namespace bench
}  // namespace flatshard
