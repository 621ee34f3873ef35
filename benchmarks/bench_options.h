// flatshard/benchmarks/bench_options.h — what flatshard-bench runs, from its command line.
//
// Contract
// - parse_command_line() reads argv with CLI11, applies the device-dependent defaults below and
//   validates every plain value (sizes > 0, heads divide d_model, steps >= 1, ...). The model
//   and sharding flags are the ones flatshard-explain has (cli/options.h: one definition);
//   numbers are decimal only (cli/numbers.h). What a unit cannot run with the sharding options
//   is resolve_unit's rule (fsdp/resolve.h), asked here for every --offload level. It does not
//   look at the model tree: granularities are resolved into plans by bench_granularity.h.
// - Old flag names (--granularity, --nproc) are renamed in argv first (cli/exit.h), each
//   giving one ParseResult::notes line; an unknown flag's error names the closest one.
// - Every user error throws UsageError with a one-line message carrying the offending value;
//   the caller prints "flatshard-bench: error: <message>" and exits with code 2.
// - --help prints the help text on stdout and returns ParseResult::exit_now.
//
// Defaults (chosen so `make bench` — CPU, 2 ranks as threads — runs in well under a minute on
// 2 cores while the granularities still differ):
// --model gpt (default) or llama; the presets and the granularities' module types are the
// family's (models/family.h).
//            preset  overrides     batch  steps  param dtype  nproc
//   cpu      small   seq 128       2      5      fp32         2 (threads)
//   cuda     1b      -             4      20     bf16         visible GPUs (processes)
// --tp N (cpu): every sharded run parallelizes the model with the TP plan (--tp-plan, else the
// family's) over tp groups of N ranks and shards it over the other --world / N; a bad plan
// spec, --world not a multiple of N, or --tp-plan without --tp > 1 is a UsageError.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/launch.h"
#include "fsdp/options.h"
#include "models/family.h"

namespace flatshard {
namespace bench {

// A user error: bad flag, bad value, impossible configuration. One line, no "error:" prefix
// (cli/launch.h: one type for every tool).
using UsageError = cli::UsageError;

enum class DeviceKind { kCpu, kCuda };
const char* to_string(DeviceKind d);

struct BenchOptions {
  std::string preset;          // the preset the model starts from
  models::ModelConfig model;   // --model family, preset + overrides, validated
  int64_t batch = 0;      // sequences per rank per step
  // --policy values as given: one comma list of named plans and specs per flag (split into
  // runs by bench_granularity.h's split_granularities).
  std::vector<std::string> policies;
  // --recompute: every non-root unit of every granularity but `local` recomputes its forward in
  // backward (UnitOptions::recompute; Note [Recompute] in fsdp/recompute.h).
  bool recompute = false;
  // --offload: CPU offload levels (Note [CPU offload], flat_param/offload.h), each a run of
  // every granularity but `local` (UnitOptions::offload on every unit, the root included;
  // labelled GRANULARITY+offloadN; level 0 is the plain run). Default {0}.
  std::vector<int> offload_levels{0};
  DeviceKind device = DeviceKind::kCpu;
  int nproc = 0;              // --world: ranks, threads on cpu; processes on cuda
  // --tp: tensor-parallel ranks per group (docs/tensor-parallel.md); --world is every rank,
  // shard x tp (no replicas), so a tp group's ranks share one batch and the data-parallel
  // ranks are --world / tp. cpu only for now.
  int tp = 1;
  // The TP plan's text (wrap_policies/tp_plan.h), parsed and printed back: --tp-plan as given,
  // else the family's default (FamilyModules::tp_plan); "" when tp is 1.
  std::string tp_plan;
  bool nproc_given = false;   // cuda: --world asks to launch that many processes
  ShardingOptions sharding;   // strategy, prefetch depth, mixed precision
  int warmup = 2;             // untimed steps before the measured ones
  int steps = 0;              // measured steps
  uint64_t seed = 0;          // model init and data; every granularity uses the same
  bool fused_optimizer = false;  // --optimizer fused: flatshard::FusedAdamW for every run
  bool bf16_moments = false;     // --adamw-moments bf16 (Note [Low-precision moments])
  // --param-groups: two AdamW groups by parameter name (no weight decay on norms and biases),
  // over ShardedModel::named_parameters() (local: the model's parameters)
  bool param_groups = false;
  // --init deferred (default): sharded runs build the model on the meta device and fully_shard
  // initialises it unit by unit on the device (fsdp/deferred_init.h), the same values as
  // eager; eager: built on the host in fp32, moved, then sharded. `local` is always eager.
  bool deferred_init = true;
  int kernel_profile_steps = 0;  // --kernel-profile N (cuda only)
  bool sync_debug = false;       // --sync-debug (cuda only)
  // --cuda-graph (cuda only): sharded runs capture forward + backward as one CUDA graph after
  // their warmup and replay it (fsdp/cuda_graph.h, Note [CUDA graph step]); labelled +graph
  bool cuda_graph = false;
  std::optional<double> peak_tflops;  // per GPU/rank, for MFU (cuda default: 989 bf16 dense)
  std::string json_path, csv_path, plot_path;
  std::string profile_path;  // --write-profile (benchmarks/bench_profile.h)
};

struct ParseResult {
  bool exit_now = false;  // --help was printed
  BenchOptions options;
  // "--granularity is deprecated, use --policy": one per old flag name used (docs/vocabulary.md).
  // argv then holds the new names, so ranks launched with it say nothing more.
  std::vector<std::string> notes;
};

ParseResult parse_command_line(int argc, char** argv);

}  // namespace bench
}  // namespace flatshard
