// flatshard/cli/options.h — the flags flatshard-bench, flatshard-explain and flatshard-train
// share, defined once: the reference model (--model, --preset and the size overrides), the
// sharding options (--strategy, --param-dtype, --reduce-dtype, --gather-dtype,
// --keep-low-precision-grads, --keep-compute-shard, --offload-step, --prefetch) and the peak for
// MFU (--peak-tflops). Each tool adds them to its CLI11 app, then turns them into a
// models::ModelConfig and a ShardingOptions with the functions below, so a flag has one name, one default, one
// meaning and one check in both tools (docs/vocabulary.md).
//
// Contract
// - add_model_flags(): --model (default: `flags.family` as given, gpt unless the tool sets
//   another first), --preset, --layers, --d-model, --heads, --vocab,
//   --seq. The sizes are decimal integers >= 1 (cli/numbers.h): "--layers: must be >= 1, got 0".
//   ModelFlags::config() is the family's preset (the given one, else the tool's default) with
//   the given overrides (and add_fp8_flag()'s --fp8) applied; it does not validate (explain checks its size bounds before
//   anything is built, bench calls ModelConfig::validate()). Throws c10::Error for an unknown
//   family or preset (CLI11's IsMember refuses both while parsing).
// - add_sharding_flags(): the values are checked while parsing (CLI11 IsMember, cli/numbers.h);
//   sharding_options() maps them (support/dtype_name.h for the dtypes) onto ShardingOptions:
//   strategy, mixed precision (an unset --param-dtype is the tool's default, an unset
//   --reduce-dtype stays unset: the param dtype; --gather-dtype param | fp8 | int8 through
//   gather_dtype_from_name, flat_param/flat_param_config.h), keep_low_precision_grads, offload_step, and --prefetch as
//   both depths when given. Cross-option rules are not repeated here: what a unit cannot run is
//   resolve_unit's (fsdp/resolve.h), which the tools call on the options.
// - add_tp_flag(): --tp, the mesh's tp size (default 1: no tensor parallelism).
// - add_peak_tflops_flag(): --peak-tflops, a decimal number; peak_tflops() is the peak MFU is
//   computed against: the given value (UsageError unless > 0), else kCudaPeakTflops on cuda,
//   else none. mfu() is model FLOPs utilisation by the PaLM convention (the family's
//   flops_per_token, models/family.h): tokens/s per rank x FLOPs per token / peak FLOP/s;
//   nullopt without a peak.
#pragma once

#include <CLI/CLI.hpp>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>

#include "fsdp/options.h"
#include "models/family.h"

namespace flatshard {
namespace cli {

struct ModelFlags {
  std::string family = "gpt";  // --model
  std::string preset;          // --preset; "" when not given: config()'s default
  // The overrides; 0 when not given (a given one is >= 1).
  int64_t layers = 0, d_model = 0, heads = 0, vocab = 0, seq = 0;
  bool fp8 = false;  // --fp8 (add_fp8_flag): TransformerConfig::fp8

  // The preset (default_preset when none was given) with the overrides applied.
  models::ModelConfig config(const std::string& default_preset) const;
};

// The options added, for a tool that needs one (`excludes`, count()).
struct ModelOptions {
  CLI::Option *family, *preset, *layers, *d_model, *heads, *vocab, *seq;
};

// `preset_help`: what the tool does without --preset; `seq_help`: what --seq means to it.
ModelOptions add_model_flags(CLI::App& app, ModelFlags& flags, const std::string& group,
                             const std::string& preset_help, const std::string& seq_help);

// --fp8 (the tools that run a model: bench, train): the layers' Linears run fp8 matmuls
// (models/fp8_linear.h; CPU, or CUDA compute capability 8.9+); config() sets
// TransformerConfig::fp8 from it.
CLI::Option* add_fp8_flag(CLI::App& app, ModelFlags& flags, const std::string& group);

struct ShardingFlags {
  std::string strategy = "full";       // --strategy: full | grad_op | noshard
  std::string param_dtype;             // --param-dtype; "": the tool's default
  std::string reduce_dtype;            // --reduce-dtype; "": the param dtype
  std::string gather_dtype = "param";  // --gather-dtype: param | fp8 | int8
  std::string offload_step = "after";  // --offload-step: after | backward | delayed
  int prefetch = -1;                   // --prefetch, both depths; -1: not given
  bool keep_low_precision_grads = false;  // --keep-low-precision-grads
  bool keep_compute_shard = false;        // --keep-compute-shard
};

// `param_dtype_default`: the tool's default, as its help says it ("fp32"; "cpu fp32, cuda bf16").
void add_sharding_flags(CLI::App& app, ShardingFlags& flags, const std::string& group,
                        const std::string& param_dtype_default);

// ShardingOptions from the flags; `default_param_dtype` when --param-dtype was not given.
// The other fields (reshard, offload level, align, ...) keep ShardingOptions' defaults.
ShardingOptions sharding_options(const ShardingFlags& flags, c10::ScalarType default_param_dtype);

// --offload-step backward / delayed step units through an attached flatshard::FusedAdamW: a
// UsageError naming the flag unless the tool's optimizer is that (`fused_optimizer`).
void check_offload_step_optimizer(const ShardingFlags& flags, bool fused_optimizer);

// --tp: tensor-parallel ranks per group (docs/tensor-parallel.md), a decimal integer in
// [1, 4096]; the tool splits its model with the family's default TP plan
// (FamilyModules::tp_plan). `world_help` says how the tool's world relates to it.
CLI::Option* add_tp_flag(CLI::App& app, int& tp, const std::string& group,
                         const std::string& world_help);

// H100 / H200 dense bf16 TFLOP/s: the peak assumed on cuda when --peak-tflops is not given.
constexpr double kCudaPeakTflops = 989.0;

CLI::Option* add_peak_tflops_flag(CLI::App& app, double& tflops, const std::string& group);

// `option`: add_peak_tflops_flag's; `tflops` its value.
std::optional<double> peak_tflops(const CLI::Option& option, double tflops, bool cuda);

std::optional<double> mfu(double tokens_per_s_per_rank, double flops_per_token,
                          std::optional<double> peak_tflops);

}  // namespace cli
}  // namespace flatshard
