// flatshard/benchmarks/bench_main.cpp — flatshard-bench: command line, runs, report.
//
// Flow: parse and validate the flags; on cuda without a launcher, launch one process per GPU
// and wait (cli/launch.h); build one planning model and resolve every granularity into a
// plan (so a bad spec fails before anything runs); run the granularities one after another with
// the same seed and data; rank 0 prints the table and writes JSON/CSV/SVG.
//
// Exit codes: 0 all runs ok; 1 a result check failed (loss differs from the reference run);
// 2 usage error (one line "flatshard-bench: error: ..." on stderr, on every rank whatever RANK
// says; "flatshard-bench: rank N: error: ..." for one a launched rank N > 0 found after the
// command line); 3 runtime failure (an output file that could not be written included: it is
// left as it was, support/output_file.h).
//
// The environment is read after --help (which never reads it) and before anything runs: every
// set launcher variable must be valid (collectives/launch_env.h), also on cpu where none is
// used, and every FLATSHARD_* knob (collectives/env.h), also those only the NCCL path reads; a
// bad one is a usage error naming it. On cpu the threads' collective timeout is
// FLATSHARD_TIMEOUT_MS when set, else 60 s.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "benchmarks/bench_cuda.h"
#include "benchmarks/bench_granularity.h"
#include "benchmarks/bench_memory.h"
#include "benchmarks/bench_options.h"
#include "benchmarks/bench_plot.h"
#include "benchmarks/bench_profile.h"
#include "benchmarks/bench_progress.h"
#include "benchmarks/bench_report.h"
#include "benchmarks/bench_run.h"
#include "cli/launch.h"
#include "collectives/env.h"
#include "fsdp/meta_init.h"
#include "fsdp/tensor_parallel.h"
#include "fsdp/trace.h"
#include "support/input_file.h"
#include "support/output_file.h"

namespace fb = flatshard::bench;

namespace {

constexpr int kExitCheckFailed = 1;
constexpr int kExitUsage = 2;
constexpr int kExitFailure = 3;

std::vector<fb::Granularity> plan_granularities(const fb::BenchOptions& o) {
  // One model for planning only (plans are data: names, shapes, tied identities), built on the
  // meta device: no host memory, no init time (fsdp/meta_init.h).
  std::shared_ptr<torch::nn::Module> planning;
  {
    flatshard::MetaInit meta;
    planning = o.model.build(o.seed);
  }
  const auto& modules = o.model.family().modules();
  // --tp: the plan must fit the model before anything runs (parallelize()'s own checks: heads,
  // sizes, rules that match nothing), as a usage error.
  if (o.tp > 1) {
    try {
      flatshard::match_tp_plan(*planning, flatshard::parse_tp_plan(o.tp_plan), o.tp, "--tp " + std::to_string(o.tp));
    } catch (const c10::Error& e) {
      std::string msg = e.what_without_backtrace();
      std::replace(msg.begin(), msg.end(), '\n', ' ');
      throw fb::UsageError(msg);
    }
  }
  std::vector<fb::Granularity> out;
  for (const auto& label : fb::split_granularities(o.policies)) {
    fb::Granularity g = fb::resolve_granularity(label, *planning, modules);
    if (o.recompute) g = fb::with_recompute(std::move(g));
    if (o.sharding.mixed_precision.keep_low_precision_grads && !g.local) g.label += "+lpgrads";
    if (o.sharding.keep_compute_shard && !g.local) g.label += "+kept";
    if (o.bf16_moments && !g.local) g.label += "+bf16m";
    if (o.cuda_graph && !g.local) g.label += "+graph";
    if (o.sharding.mixed_precision.gather_dtype != flatshard::GatherDtype::kParam && !g.local)
      g.label +=
          std::string("+") + flatshard::gather_dtype_name(o.sharding.mixed_precision.gather_dtype);
    if (g.local) {
      out.push_back(std::move(g));
      continue;
    }
    for (int level : o.offload_levels)
      out.push_back(fb::with_offload(g, level, o.sharding.offload_step));
  }
  return out;
}

fb::RunConfig run_config(const fb::BenchOptions& o) {
  fb::RunConfig c;
  c.model = o.model;
  c.batch = o.batch;
  c.seed = o.seed;
  c.warmup = o.warmup;
  c.steps = o.steps;
  c.sharding = o.sharding;
  c.fused_optimizer = o.fused_optimizer;
  c.bf16_moments = o.bf16_moments;
  c.param_groups = o.param_groups;
  c.deferred_init = o.deferred_init;
  c.time_collectives = o.device == fb::DeviceKind::kCpu;
  c.kernel_profile_steps = o.kernel_profile_steps;
  c.sync_debug = o.sync_debug;
  c.cuda_graph = o.cuda_graph;
  c.tp = o.tp;
  if (o.tp > 1) c.tp_plan = flatshard::parse_tp_plan(o.tp_plan);
  return c;
}

// FLATSHARD_TRACE=run.json over several runs: each sharded run traces to its own file, the run's
// label made a file name before the extension ("run.layer.json", "run.every-2+recompute.json";
// then ".rank<R>" per rank, fsdp/trace.h), so a run does not overwrite the one before it. A
// label that another run's name already took gets "-<index>". "" for local runs (no
// ShardedModel) and when tracing is off; "nvtx" stays as it is.
std::vector<std::string> run_trace_paths(const std::vector<fb::Granularity>& grans) {
  namespace env = flatshard::env;
  const std::string base = env::trace_path();
  std::vector<std::string> paths(grans.size());
  if (base.empty()) return paths;
  const std::string ext = ".json";
  const bool has_ext =
      base.size() > ext.size() && base.compare(base.size() - ext.size(), ext.size(), ext) == 0;
  const std::string stem = has_ext ? base.substr(0, base.size() - ext.size()) : base;
  std::vector<std::string> used;
  for (size_t i = 0; i < grans.size(); ++i) {
    if (grans[i].local) continue;
    if (base == "nvtx") {
      paths[i] = base;
      continue;
    }
    std::string name;
    for (char c : grans[i].label)
      name += std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '+' || c == '_'
                  ? c
                  : '_';
    if (std::find(used.begin(), used.end(), name) != used.end()) name += "-" + std::to_string(i);
    used.push_back(name);
    paths[i] = stem + "." + name + (has_ext ? ext : "");
  }
  return paths;
}

// The run's config with its own trace file (run_trace_paths), FLATSHARD_TRACE_STEPS kept.
fb::RunConfig with_trace(fb::RunConfig c, const std::string& path) {
  namespace env = flatshard::env;
  if (path.empty()) return c;
  c.sharding.trace.path = path;
  if (!env::get(env::kTraceSteps).empty()) c.sharding.trace.max_steps = env::trace_steps();
  return c;
}

// "flatshard-bench: trace of run 'layer': run.layer.rank0.json, run.layer.rank1.json", once,
// after the run wrote them (its ShardedModel is gone).
void say_trace(const std::string& label, const std::string& path, int world) {
  if (path.empty() || path == "nvtx") return;
  std::cerr << "flatshard-bench: trace of run '" << flatshard::printable_escape(label) << "':";
  for (int r = 0; r < world; ++r)
    std::cerr << (r ? ", " : " ")
              << flatshard::printable_escape(flatshard::trace_file_for_rank(path, r, world));
  std::cerr << std::endl;
}

int report(const fb::BenchOptions& o, int world, const std::string& device_description,
           std::vector<std::string> notes, const std::vector<fb::Granularity>& grans,
           std::vector<fb::RunResult> results, std::vector<double> reference_losses,
           const fb::RunResult* host_probe = nullptr) {
  if (!o.profile_path.empty())  // before make_report takes the results
    flatshard::save_profile(
        fb::measure_profile(o, world, grans, results, device_description, host_probe),
        o.profile_path);
  fb::Report rep = fb::make_report(o, world, device_description, std::move(notes),
                                   std::move(results), std::move(reference_losses));
  fb::print_table(rep, std::cout);
  fb::print_kernel_profiles(rep, std::cout);
  flatshard::flush_stdout();
  if (!o.json_path.empty()) fb::write_json(rep, o.json_path);
  if (!o.csv_path.empty()) fb::write_csv(rep, o.csv_path);
  if (!o.plot_path.empty()) fb::write_svg(rep, o.plot_path);
  return rep.all_ok() ? 0 : kExitCheckFailed;
}

void check_outputs(const fb::BenchOptions& o) {
  fb::check_writable("--json", o.json_path);
  fb::check_writable("--csv", o.csv_path);
  fb::check_writable("--plot", o.plot_path);
  fb::check_writable("--write-profile", o.profile_path);
}

// FLATSHARD_TIMEOUT_MS when set (validated by env::check_all), else the threads backend's 60 s.
std::chrono::milliseconds cpu_timeout() {
  namespace env = flatshard::env;
  return env::get(env::kTimeoutMs).empty() ? std::chrono::milliseconds(60000) : env::timeout();
}

int run_cpu(const fb::BenchOptions& o) {
  fb::check_memory(o, o.nproc, std::nullopt);
  const auto grans = plan_granularities(o);
  check_outputs(o);
  const fb::RunConfig config = run_config(o);
  const std::chrono::milliseconds timeout = cpu_timeout();
  fb::Progress progress(std::cerr, fb::Progress::stderr_is_tty());
  std::vector<fb::RunResult> results;
  const std::vector<std::string> traces = run_trace_paths(grans);
  for (size_t i = 0; i < grans.size(); ++i) {
    auto fn = progress.start(grans[i].label, static_cast<int>(i), static_cast<int>(grans.size()),
                             o.warmup);
    results.push_back(
        fb::run_on_cpu_threads(with_trace(config, traces[i]), grans[i], o.nproc, fn, timeout));
    progress.finish(results.back());
    say_trace(grans[i].label, traces[i], o.nproc);
  }
  // The check's reference for the steps after the first (bench_report.h), untimed.
  // Under TP the ranks of a tp group share a batch: the data-parallel ranks are --world / tp.
  std::vector<double> reference = fb::reference_losses(config, o.nproc / o.tp, fb::DeviceHooks{});
  const std::string layout =
      o.tp > 1 ? " (shard " + std::to_string(o.nproc / o.tp) + " x tp " + std::to_string(o.tp) + ")"
               : "";
  return report(o, o.nproc,
                "cpu, " + std::to_string(o.nproc) + " ranks as threads" + layout +
                    " (1 compute thread each)",
                {"local: one unsharded replica per rank thread, run concurrently without "
                 "communication (same core contention as the sharded runs).",
                 "exposed: host time inside collectives / step time, rank 0 (CPU collectives are "
                 "synchronous: all of it is exposed).",
                 "peak MiB: per-rank AVERAGE = process peak of live CPU tensor bytes during the "
                 "steps (counting c10 CPU allocator, minus what was live before the run) / "
                 "ranks, since ranks are threads of one process."},
                grans, std::move(results), std::move(reference));
}

int run_cuda_rank(const fb::BenchOptions& o, const flatshard::LaunchEnv& env) {
  const int gpus = fb::cuda_device_count();
  if (env.local_rank >= gpus)
    throw fb::UsageError("local rank " + std::to_string(env.local_rank) + " has no GPU: " +
                         std::to_string(gpus) + " visible");
  fb::check_memory(o, env.world_size, fb::cuda_device_memory(env.local_rank));
  const auto grans = plan_granularities(o);
  if (env.rank == 0) check_outputs(o);
  // Note [CUDA graph step]: the watchdog polls events from its thread, which a capture forbids.
  // Off unless the user set it (then CudaGraphStep's guard says why it must be off).
  if (o.cuda_graph) setenv("FLATSHARD_NCCL_WATCHDOG", "0", /*overwrite=*/0);
  fb::CudaRank rank = fb::open_cuda_rank(env.local_rank, "flatshard-bench");
  const fb::RunConfig config = run_config(o);
  fb::Progress progress(std::cerr, fb::Progress::stderr_is_tty());
  std::vector<fb::RunResult> results;
  const std::vector<std::string> traces = run_trace_paths(grans);
  for (size_t i = 0; i < grans.size(); ++i) {
    fb::ProgressFn fn;
    if (env.rank == 0)
      fn = progress.start(grans[i].label, static_cast<int>(i), static_cast<int>(grans.size()),
                          o.warmup);
    results.push_back(
        fb::run_on_cuda(with_trace(config, traces[i]), grans[i], *rank.comm, rank.hooks, fn));
    if (env.rank == 0) progress.finish(results.back());
    if (env.rank == 0) say_trace(grans[i].label, traces[i], rank.comm->world_size());
  }
  // --write-profile: the calibration plan once more on short sequences, for the host's own cost
  // per step (bench_profile.h); every rank runs it (collectives), rank 0 measures.
  std::optional<fb::RunResult> probe;
  const int cal = o.profile_path.empty() ? -1 : fb::calibration_run(grans, results);
  if (cal >= 0) {
    fb::RunConfig short_config = config;
    short_config.input_seq = fb::kHostProbeSeq;
    short_config.kernel_profile_steps = 0;
    short_config.sync_debug = false;
    fb::ProgressFn fn;
    if (env.rank == 0)
      fn = progress.start(grans[static_cast<size_t>(cal)].label + " (host probe, " +
                              std::to_string(fb::kHostProbeSeq) + " tokens)",
                          static_cast<int>(grans.size()), static_cast<int>(grans.size()) + 1,
                          o.warmup);
    probe = fb::run_on_cuda(short_config, grans[static_cast<size_t>(cal)], *rank.comm,
                            rank.hooks, fn);
    if (env.rank == 0) progress.finish(*probe);
  }
  const int world = rank.comm->world_size();
  // The check's reference for the steps after the first (bench_report.h): rank 0 alone, untimed.
  std::vector<double> reference;
  if (env.rank == 0) reference = fb::reference_losses(config, world, rank.hooks);
  rank.close();
  if (env.rank != 0) return 0;
  return report(o, world,
                "cuda, " + std::to_string(world) + " ranks (one process per GPU, NCCL), " +
                    fb::cuda_device_name(env.local_rank),
                {"exposed: not measured on CUDA yet (collectives are asynchronous; it needs "
                 "CUDA-event timing of the communication streams).",
                 "peak MiB: rank 0's CUDA caching-allocator peak of allocated bytes during the "
                 "steps, minus what was live before the run."},
                grans, std::move(results), std::move(reference), probe ? &*probe : nullptr);
}

int run(const fb::BenchOptions& o, char** argv, const std::optional<flatshard::LaunchEnv>& env) {
  if (o.device == fb::DeviceKind::kCpu) return run_cpu(o);
  const std::string why = fb::cuda_unavailable_reason();
  if (!why.empty()) throw fb::UsageError(why);
  if (env) return run_cuda_rank(o, *env);
  const int gpus = fb::cuda_device_count();
  const int n = o.nproc_given ? o.nproc : gpus;
  if (n < 1) throw fb::UsageError("--device cuda: no CUDA device is visible");
  if (n > gpus)
    throw fb::UsageError("--world " + std::to_string(n) + " exceeds the " +
                         std::to_string(gpus) + " visible GPUs (one rank per GPU)");
  fb::check_memory(o, n, fb::cuda_device_memory(0));  // before n processes allocate anything
  // Exit 1 is a failed result check on rank 0 after every rank finished: not a reason to stop
  // the others.
  return flatshard::cli::launch_local_ranks(n, argv, /*failed_from=*/2);
}

}  // namespace

int main(int argc, char** argv) {
  int rank = 0;
  bool launched = false;
  try {
    // The command line first: --help prints and exits without reading the environment.
    std::optional<fb::ParseResult> parsed;
    std::string usage_error;
    try {
      parsed = fb::parse_command_line(argc, argv);
    } catch (const fb::UsageError& e) {
      usage_error = e.what();
    }
    if (parsed && parsed->exit_now) {
      flatshard::flush_stdout();
      return 0;
    }
    const std::optional<flatshard::LaunchEnv> env = flatshard::cli::launcher_env();
    launched = env.has_value();
    rank = env ? env->rank : 0;
    // A command-line error is printed whatever RANK says: every rank has the same command line,
    // so a rank that keeps quiet may be the only one the user watches (RANK=1 in a shell).
    if (!parsed) {
      std::cerr << "flatshard-bench: error: " << usage_error << std::endl;
      return kExitUsage;
    }
    // Once per run: a rank this process launches gets the renamed argv; under torchrun rank 0.
    if (rank == 0)
      for (const auto& note : parsed->notes)
        std::cerr << "flatshard-bench: note: " << note << std::endl;
    try {
      flatshard::env::check_all();
    } catch (const c10::Error& e) {
      throw fb::UsageError(e.what_without_backtrace());
    }
    // Launcher variables only matter for cuda: a cpu run under srun/torchrun is a plain run.
    return run(parsed->options, argv,
               parsed->options.device == fb::DeviceKind::kCuda ? env : std::nullopt);
  } catch (const fb::UsageError& e) {
    // Every rank says it (a launched rank other than 0 with its number): a usage error found
    // after the launch may be this rank's alone ("local rank 3 has no GPU").
    const std::string who = launched && rank != 0 ? "rank " + std::to_string(rank) + ": " : "";
    std::cerr << "flatshard-bench: " << who << "error: " << e.what() << std::endl;
    return kExitUsage;
  } catch (const c10::Error& e) {
    std::cerr << "flatshard-bench: " << (launched ? "rank " + std::to_string(rank) + ": " : "")
              << "error: " << e.what_without_backtrace() << std::endl;
    return kExitFailure;
  } catch (const std::exception& e) {
    std::cerr << "flatshard-bench: " << (launched ? "rank " + std::to_string(rank) + ": " : "")
              << "error: " << e.what() << std::endl;
    return kExitFailure;
  }
}
