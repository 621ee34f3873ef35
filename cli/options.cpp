// flatshard/cli/options.cpp — see options.h for the contract.
#include "cli/options.h"

#include <limits>
#include <sstream>

#include "cli/launch.h"
#include "cli/numbers.h"
#include "support/dtype_name.h"

namespace flatshard {
namespace cli {

namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

std::string dtype_list() {
  std::string s;
  for (const auto& n : dtype_names()) s += (s.empty() ? "" : " | ") + n;
  return s;
}

}  // namespace

models::ModelConfig ModelFlags::config(const std::string& default_preset) const {
  auto cfg = models::ModelConfig::preset(family, preset.empty() ? default_preset : preset);
  if (layers) cfg.n_layers() = layers;
  if (d_model) cfg.d_model() = d_model;
  if (heads) cfg.n_heads() = heads;
  if (vocab) cfg.vocab() = vocab;
  if (seq) cfg.seq_len() = seq;
  cfg.sizes().fp8 = fp8;
  return cfg;
}

CLI::Option* add_fp8_flag(CLI::App& app, ModelFlags& f, const std::string& group) {
  return app
      .add_flag("--fp8", f.fp8,
                "the layers' Linears run fp8 matmuls (torchao's tensorwise recipe: e4m3 "
                "forward, e5m2 output gradients, at::_scaled_mm; models/fp8_linear.h), on the "
                "fp8 gather's bytes with --gather-dtype fp8; embeddings and the output head "
                "stay in the param dtype. CPU, or CUDA GPUs of compute capability 8.9+")
      ->group(group);
}

ModelOptions add_model_flags(CLI::App& app, ModelFlags& f, const std::string& group,
                             const std::string& preset_help, const std::string& seq_help) {
  ModelOptions o;
  o.family = app.add_option("--model", f.family,
                            "model family (models/family.h; default " + f.family + "): " +
                                models::families_help())
                 ->check(CLI::IsMember(models::family_names()))
                 ->group(group);
  o.preset = app.add_option("--preset", f.preset, "the family's preset (" + preset_help + ")")
                 ->check(CLI::IsMember(models::all_preset_names()))
                 ->group(group);
  auto size = [&](const char* flag, int64_t& field, const std::string& help) {
    return app.add_option(flag, field, help)->transform(integer(1, kInt64Max))->group(group);
  };
  o.layers = size("--layers", f.layers, "override: transformer blocks");
  o.d_model = size("--d-model", f.d_model, "override: model width");
  o.heads = size("--heads", f.heads, "override: attention heads (divide d-model)");
  o.vocab = size("--vocab", f.vocab, "override: vocabulary size");
  o.seq = size("--seq", f.seq, seq_help);
  return o;
}

void add_sharding_flags(CLI::App& app, ShardingFlags& f, const std::string& group,
                        const std::string& param_dtype_default) {
  app.add_option("--strategy", f.strategy,
                 "default sharding strategy: full | grad_op | noshard (default full)")
      ->check(CLI::IsMember({"full", "grad_op", "noshard"}))
      ->group(group);
  app.add_option("--prefetch", f.prefetch, "forward and backward prefetch depth (default 1)")
      ->transform(integer(0))
      ->group(group);
  app.add_option("--param-dtype", f.param_dtype,
                 dtype_list() + ": gathered params and compute (default " + param_dtype_default +
                     "); flatshard-bench trains fp16 with a gradient scaler")
      ->check(CLI::IsMember(dtype_names()))
      ->group(group);
  app.add_option("--reduce-dtype", f.reduce_dtype,
                 dtype_list() + ": gradient reduction (default: the param dtype)")
      ->check(CLI::IsMember(dtype_names()))
      ->group(group);
  app.add_option("--gather-dtype", f.gather_dtype,
                 "param | fp8 | fp8_delayed | int8: what sharded units' all-gathers send "
                 "(MixedPrecision::gather_dtype; default param, the shard in the param dtype): "
                 "fp8 e4m3 with one scale per parameter (plus an amax all-reduce per gather; "
                 "fp8_delayed: the previous gather's amax, no all-reduce after the first) or "
                 "block-wise int8 (one scale per 256 elements); gathered params are still the "
                 "param dtype")
      ->check(CLI::IsMember({"param", "fp8", "fp8_delayed", "int8"}))
      ->group(group);
  app.add_flag("--keep-low-precision-grads", f.keep_low_precision_grads,
               "master gradients stay in the reduce dtype (MixedPrecision::"
               "keep_low_precision_grads): no upcast, half the gradient memory; not with "
               "offload levels above 0 or fp16's gradient scaler")
      ->group(group);
  app.add_flag("--keep-compute-shard", f.keep_compute_shard,
               "sharded units below fp32 keep their shard's compute-dtype cast on the device "
               "(ShardingOptions::keep_compute_shard, +2 B per parameter / ranks for bf16); "
               "FusedAdamW writes it in its pass, so gathers do not cast")
      ->group(group);
  app.add_option("--offload-step", f.offload_step,
                 "when offloaded units' CPU optimizer steps: after (in optimizer.step(), "
                 "default) | backward (per unit during backward, overlapping the GPU; exact) | "
                 "delayed (ZeRO-Offload's one-step-delayed update: step N's CPU update runs "
                 "beside step N+1's forward and backward, so parameters are ONE STEP STALE; "
                 "offload level 1 only)")
      ->check(CLI::IsMember({"after", "backward", "delayed"}))
      ->group(group);
}

ShardingOptions sharding_options(const ShardingFlags& f, c10::ScalarType default_param_dtype) {
  ShardingOptions o;
  o.strategy = f.strategy == "grad_op"   ? ShardingStrategy::kShardGradOp
               : f.strategy == "noshard" ? ShardingStrategy::kNoShard
                                         : ShardingStrategy::kFullShard;
  const c10::ScalarType param =
      f.param_dtype.empty() ? default_param_dtype : dtype_from_name(f.param_dtype).value();
  o.mixed_precision.param_dtype = param;
  if (!f.reduce_dtype.empty())  // else unset: the param dtype (MixedPrecision)
    o.mixed_precision.reduce_dtype = dtype_from_name(f.reduce_dtype).value();
  o.mixed_precision.keep_low_precision_grads = f.keep_low_precision_grads;
  o.keep_compute_shard = f.keep_compute_shard;
  o.mixed_precision.gather_dtype = gather_dtype_from_name(f.gather_dtype).value();
  o.offload_step = f.offload_step == "backward"  ? OffloadStep::kBackward
                   : f.offload_step == "delayed" ? OffloadStep::kDelayed
                                                 : OffloadStep::kAfterBackward;
  if (f.prefetch >= 0) {
    o.forward_prefetch = f.prefetch;
    o.backward_prefetch = f.prefetch;
  }
  return o;
}

void check_offload_step_optimizer(const ShardingFlags& f, bool fused_optimizer) {
  if (f.offload_step != "after" && !fused_optimizer)
    throw UsageError("--offload-step " + f.offload_step +
                     " steps units through flatshard::FusedAdamW: add --optimizer fused");
}

CLI::Option* add_tp_flag(CLI::App& app, int& tp, const std::string& group,
                         const std::string& world_help) {
  return app
      .add_option("--tp", tp,
                  "tensor-parallel ranks per group (default 1), splitting attention and "
                  "MLP with the model family's default TP plan (docs/tensor-parallel.md); " +
                      world_help)
      ->transform(integer(1, 4096))
      ->group(group);
}

CLI::Option* add_peak_tflops_flag(CLI::App& app, double& tflops, const std::string& group) {
  return app.add_option("--peak-tflops", tflops,
                        "peak TFLOP/s per rank for MFU (cuda default 989: H100/H200 bf16 "
                        "dense; cpu: MFU is - unless given)")
      ->check(number())
      ->group(group);
}

std::optional<double> peak_tflops(const CLI::Option& option, double tflops, bool cuda) {
  if (option.count() > 0) {
    if (!(tflops > 0)) {
      std::ostringstream os;
      os << "--peak-tflops must be > 0, got " << tflops;
      throw UsageError(os.str());
    }
    return tflops;
  }
  if (cuda) return kCudaPeakTflops;
  return std::nullopt;
}

std::optional<double> mfu(double tokens_per_s_per_rank, double flops_per_token,
                          std::optional<double> peak_tflops) {
  if (!peak_tflops) return std::nullopt;
  return tokens_per_s_per_rank * flops_per_token / (*peak_tflops * 1e12);
}

}  // namespace cli
}  // namespace flatshard
