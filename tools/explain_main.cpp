// flatshard-explain — print what a wrap policy will do to a model at a world size, before any
// GPU is involved: units, bytes, collectives per step, predicted peak memory, warnings.
//
//   flatshard-explain --preset 1b --policy type=Block --world 8
//   flatshard-explain --model llama --preset 7b --world 8        (default policy: type=DecoderLayer)
//   flatshard-explain --preset small --n-layers 12 --policy "every=2,type=Block" --world 4
//                     --param-dtype bf16 --prefetch 2 --memory-limit 2GiB    (one line)
//   flatshard-explain --preset 1b --policy type=Block --world 8 --replicate 16   (HSDP)
//   flatshard-explain --preset 1b --policy "type=Linear|LayerNorm|Embedding" --world 8
//                     --collective-latency-us 80 --reference-step-ms 45      (one line)
//   flatshard-explain --preset 1b --world 1 --param-dtype bf16 --batch 4 --profile machine.json
//                     (adds the predicted peak with activations and the predicted step time)
//   flatshard-explain --preset 1b --world 8 --param-dtype bf16 --batch 4 --suggest
//                     --memory-limit 40GiB [--profile machine.json]   (the plan advisor,
//                     planner/advisor.h: the best plan as a spec, and why the others lose)
//
// The reference model (--model gpt | llama, models/family.h) is built on the meta device (fsdp/meta_init.h): explaining 1B parameters
// allocates nothing. Your own model: call flatshard::explain() (planner/explain.h) from C++.
// Its module objects do live on the host (~20 KB a layer), so sizes are checked first, without
// building anything: at most kMaxLayers layers and kMaxParameters parameters (a clear error with
// the numbers instead of std::bad_alloc or minutes of allocation).
//
// Exit codes: 0 ok; 1 an input that is wrong (a policy that does not parse, a bad profile, a
// model too large, standard output that cannot be written); 2 a command-line error, one line
// "flatshard-explain: error: ..." (tools/cli_exit.h).
#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <cmath>
#include <iostream>
#include <limits>
#include <map>

#include "planner/advisor.h"
#include "planner/cost_model.h"
#include "planner/explain.h"
#include "planner/machine_profile.h"
#include "support/output_file.h"
#include "fsdp/meta_init.h"
#include "models/family.h"
#include "wrap_policies/spec.h"
#include "tools/cli_exit.h"

namespace {

// Sanity bounds of the model flags: 2^16 layers (every layer's modules are host objects; explain
// is linear in layers, ~1.5 ms each), 1e15 parameters (a thousand times today's largest
// models; keeps every byte count, x4 copies of fp32 state, far inside int64).
constexpr int64_t kMaxLayers = int64_t{1} << 16;
constexpr long double kMaxParameters = 1e15L;

// "40GiB", "40G" (binary), "40GB" (decimal), "1.5TiB", "123456" (bytes); at most int64's max.
int64_t parse_bytes(const std::string& text) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(text, &pos);
  } catch (const std::exception&) {
    throw CLI::ValidationError("--memory-limit", "'" + text + "' is not a size such as 40GiB");
  }
  std::string suffix = text.substr(pos);
  for (auto& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  static const std::map<std::string, double> scale = {
      {"", 1},         {"B", 1},        {"K", 0x1p10},   {"KIB", 0x1p10}, {"KB", 1e3},
      {"M", 0x1p20},   {"MIB", 0x1p20}, {"MB", 1e6},     {"G", 0x1p30},   {"GIB", 0x1p30},
      {"GB", 1e9},     {"T", 0x1p40},   {"TIB", 0x1p40}, {"TB", 1e12}};
  auto it = scale.find(suffix);
  if (it == scale.end() || !(v >= 0) || !std::isfinite(v))
    throw CLI::ValidationError("--memory-limit", "'" + text +
                                                     "' is not a size (suffixes: K/M/G/T or "
                                                     "KiB/MiB/GiB/TiB = binary, KB/MB/GB/TB = decimal)");
  // 2^63 is the first double past int64; llround of anything at or above it is undefined.
  const double bytes = v * it->second;
  if (!(bytes < 0x1p63))
    throw CLI::ValidationError(
        "--memory-limit", "'" + text + "' is too large: at most " +
                              std::to_string(std::numeric_limits<int64_t>::max()) +
                              " bytes (8 EiB)");
  return static_cast<int64_t>(std::llround(bytes));
}

// Integer options: "--world: must be >= 1, got 0" instead of CLI11's range with 300 digits.
CLI::Validator at_least(int64_t lo) {
  return CLI::Validator(
      [lo](std::string& text) -> std::string {
        try {
          size_t used = 0;
          const long long v = std::stoll(text, &used);
          if (used == text.size() && v >= lo) return "";
          if (used == text.size()) return "must be >= " + std::to_string(lo) + ", got " + text;
        } catch (const std::exception&) {
        }
        return "expected an integer, got '" + text + "'";
      },
      "INT>=" + std::to_string(lo));
}

// Real-valued options, same style: "--reference-step-ms: must be > 0, got 0".
CLI::Validator number_above(double lo, bool or_equal) {
  const std::string bound = std::string(or_equal ? ">= " : "> ") + CLI::detail::to_string(lo);
  return CLI::Validator(
      [lo, or_equal, bound](std::string& text) -> std::string {
        try {
          size_t used = 0;
          const double v = std::stod(text, &used);
          if (used == text.size() && std::isfinite(v) && (or_equal ? v >= lo : v > lo)) return "";
          if (used == text.size()) return "must be " + bound + ", got " + text;
        } catch (const std::exception&) {
        }
        return "expected a number, got '" + text + "'";
      },
      std::string("NUMBER") + (or_equal ? ">=" : ">") + CLI::detail::to_string(lo));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flatshard-explain: what a wrap policy does to a reference model at a world size "
               "(units, bytes, collectives per step, predicted peak memory, warnings). Builds "
               "nothing but shapes."};
  std::string family = "gpt", preset = "small", policy, strategy = "full";
  std::string param_dtype = "fp32", reduce_dtype, memory_limit;
  int world = 0, replicate = 1, prefetch = -1, fwd_prefetch = 1, bwd_prefetch = 1;
  int64_t align = 8;
  flatshard::ExplainOptions cost;
  bool keep = false, tied = false, show_plan = false, suggest = false;
  std::string profile_path;
  int64_t batch = 0, seq = 0;
  std::vector<int> offload_levels = {0}, prefetch_depths = {1, 2};
  std::map<std::string, int64_t> overrides;
  app.add_option("--model", family,
                 "model family (models/family.h): " + flatshard::models::families_help())
      ->check(CLI::IsMember(flatshard::models::family_names()))
      ->capture_default_str();
  app.add_option("--preset", preset, "the family's preset")
      ->check(CLI::IsMember(flatshard::models::all_preset_names()))
      ->capture_default_str();
  for (const char* key : {"vocab", "d-model", "n-heads", "n-layers", "seq-len"})
    app.add_option(std::string("--") + key, overrides[key], std::string("override the preset's ") + key)
        ->check(at_least(1));
  app.add_flag("--tied", tied, "tie lm_head.weight to the token embedding");
  app.add_option("--policy", policy, "wrap policy spec (wrap_policies/spec.h), e.g. "
                                     "\"every=2,type=Block\"; \"none\": root only (default: "
                                     "one unit per layer: type=Block, llama type=DecoderLayer)");
  app.add_option("--world", world, "number of ranks (with --replicate: ranks per shard group)")
      ->required()
      ->check(at_least(1));
  app.add_option("--replicate", replicate,
                 "HSDP: replicas of the shard group (default 1: plain sharding over --world)")
      ->check(at_least(1));
  app.add_option("--strategy", strategy, "default strategy: full, grad_op, noshard")
      ->check(CLI::IsMember({"full", "grad_op", "noshard"}))
      ->capture_default_str();
  app.add_flag("--keep", keep, "FULL_SHARD units keep parameters from forward to backward");
  int offload = 0;
  app.add_option("--offload", offload,
                 "CPU offload level for units the policy sets none for: 0 off, 1 master, grads "
                 "and AdamW state on the host, 2 the compute-dtype shard too")
      ->check(CLI::Range(0, 2))
      ->capture_default_str();
  app.add_option("--prefetch", prefetch, "forward and backward prefetch depth")
      ->check(at_least(0));
  app.add_option("--forward-prefetch", fwd_prefetch, "units all-gathered ahead in forward")
      ->check(at_least(0))
      ->capture_default_str();
  app.add_option("--backward-prefetch", bwd_prefetch, "units all-gathered ahead in backward")
      ->check(at_least(0))
      ->capture_default_str();
  app.add_option("--param-dtype", param_dtype, "all-gather / compute dtype: fp32, bf16")
      ->check(CLI::IsMember({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_option("--reduce-dtype", reduce_dtype, "gradient reduction dtype (default: param dtype)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--align", align, "alignment of parameters in a flat buffer, in elements")
      ->check(at_least(1))
      ->capture_default_str();
  app.add_option("--memory-limit", memory_limit,
                 "model-state memory per rank to check the prefetch depth against, e.g. 40GiB");
  app.add_option("--collective-latency-us", cost.collective_latency_us,
                 "fixed cost of one collective for the fragmentation warning (NVLink: ~50)")
      ->check(number_above(0, /*or_equal=*/true))
      ->capture_default_str();
  app.add_option("--reference-step-ms", cost.reference_step_ms,
                 "step time the collectives' latency is compared with (explain has no compute "
                 "model; default: the 1B GPT at 4 seq/GPU on H200)")
      ->check(number_above(0, /*or_equal=*/false))
      ->capture_default_str();
  app.add_flag("--plan", show_plan, "also print the plan (Plan::to_string)");
  app.add_option("--batch", batch,
                 "sequences per rank per step: adds the predicted peak with activations and the "
                 "step time (planner/cost_model.h)")
      ->check(at_least(1));
  app.add_option("--seq", seq, "tokens per sequence for --batch (default: the model's seq_len)")
      ->check(at_least(1));
  app.add_option("--profile", profile_path,
                 "machine profile JSON (planner/machine_profile.h; flatshard-bench --write-profile); "
                 "default: the stated defaults (1x/2x H200 measurements)");
  app.add_flag("--suggest", suggest,
               "plan advisor: the plan that fits --memory-limit at the best predicted step "
               "(needs --memory-limit; --batch defaults to 1; a --policy given joins the "
               "candidates)");
  app.add_option("--offload-levels", offload_levels,
                 "--suggest: offload levels to try, e.g. 0,1,2 (default 0)")
      ->check(CLI::Range(0, 2))
      ->delimiter(',');
  app.add_option("--prefetch-depths", prefetch_depths,
                 "--suggest: prefetch depths to try (default 1,2)")
      ->check(CLI::Range(0, 64))
      ->delimiter(',');
  int parse_exit = 0;
  if (!flatshard::tools::parse_command_line(app, argc, argv, "flatshard-explain", &parse_exit))
    return parse_exit;

  try {
    namespace fm = flatshard::models;
    auto cfg = fm::ModelConfig::preset(family, preset);
    if (overrides["vocab"]) cfg.vocab() = overrides["vocab"];
    if (overrides["d-model"]) cfg.d_model() = overrides["d-model"];
    if (overrides["n-heads"]) cfg.n_heads() = overrides["n-heads"];
    if (overrides["n-layers"]) cfg.n_layers() = overrides["n-layers"];
    if (overrides["seq-len"]) cfg.seq_len() = overrides["seq-len"];
    cfg.tie_embeddings() = tied;
    const bool policy_given = !policy.empty();
    if (policy.empty()) policy = "type=" + cfg.family().modules().layer_type;
    TORCH_CHECK(cfg.n_layers() <= kMaxLayers, "--n-layers ", cfg.n_layers(),
                " is more than explain builds (at most ", kMaxLayers,
                " layers: each is a set of host objects, even on the meta device)");
    const long double params = cfg.num_parameters_bound();
    TORCH_CHECK(params <= kMaxParameters, "the model would have ",
                static_cast<double>(params), " parameters (", cfg.to_string(),
                "), more than the sanity bound of ", static_cast<double>(kMaxParameters),
                "; check --vocab, --d-model, --n-layers and --seq-len");

    std::shared_ptr<torch::nn::Module> model;
    {
      flatshard::MetaInit meta;  // shapes only: nothing is allocated or initialised
      model = cfg.build(/*seed=*/0);
    }
    flatshard::check_on_meta(*model);

    flatshard::ShardingOptions opts;
    opts.strategy = strategy == "full"      ? flatshard::ShardingStrategy::kFullShard
                    : strategy == "grad_op" ? flatshard::ShardingStrategy::kShardGradOp
                                            : flatshard::ShardingStrategy::kNoShard;
    opts.reshard_after_forward = !keep;
    opts.offload = offload;
    opts.forward_prefetch = prefetch >= 0 ? prefetch : fwd_prefetch;
    opts.backward_prefetch = prefetch >= 0 ? prefetch : bwd_prefetch;
    auto dtype = [](const std::string& s) { return s == "bf16" ? c10::kBFloat16 : c10::kFloat; };
    opts.mixed_precision.param_dtype = dtype(param_dtype);
    if (!reduce_dtype.empty()) opts.mixed_precision.reduce_dtype = dtype(reduce_dtype);
    opts.align = align;
    std::optional<int64_t> limit;
    if (!memory_limit.empty()) limit = parse_bytes(memory_limit);

    flatshard::MachineProfile profile = flatshard::MachineProfile::defaults();
    if (!profile_path.empty()) profile = flatshard::load_profile(profile_path);
    const flatshard::Workload workload{batch > 0 ? batch : 1, seq > 0 ? seq : cfg.seq_len()};
    TORCH_CHECK(workload.seq <= cfg.seq_len(), "--seq ", workload.seq,
                " is longer than the model's seq_len ", cfg.seq_len(), " (use --seq-len)");
    if (suggest) {
      TORCH_CHECK(limit.has_value(), "--suggest needs --memory-limit (e.g. 40GiB)");
      flatshard::AdvisorOptions a;
      a.memory_limit_bytes = *limit;
      a.workload = workload;
      a.shape = cfg.transformer_shape();
      a.profile = profile;
      a.offload_levels = offload_levels;
      a.prefetch_depths = prefetch_depths;
      if (policy_given) a.extra_specs.push_back(policy);  // the user's plan competes too
      std::cout << "model: " << cfg.family().display_name() << " " << cfg.to_string() << " ("
                << cfg.num_parameters() << " params)\n";
      std::cout << flatshard::suggest(*model, world, replicate, opts, a).to_string();
      flatshard::flush_stdout();
      return 0;
    }
    const auto plan = flatshard::make_plan(*model, flatshard::parse_policy(policy));
    std::cout << "model: " << cfg.family().display_name() << " " << cfg.to_string() << " ("
              << cfg.num_parameters()
              << " params); policy: " << policy << "\n";
    if (show_plan) std::cout << plan.to_string();
    const auto e = flatshard::explain(*model, plan, world, opts, limit, replicate, cost);
    std::cout << e.to_string();
    if (batch > 0) {
      const auto p =
          flatshard::predict_cost(e, cfg.transformer_shape(), workload, profile);
      std::cout << "batch " << workload.batch << " x seq " << workload.seq
                << "; profile: " << profile.source << "\n"
                << p.to_string() << "prediction: peak_bytes=" << p.peak_bytes
                << " step_ms=" << p.step_ms << " exposed_comm_ms=" << p.exposed_comm_ms
                << " host_ms=" << p.host_ms << " host_bound=" << (p.host_bound ? 1 : 0)
                << " host_bytes=" << p.host_bytes
                << " optimizer_ms=" << p.optimizer_ms + p.cpu_optimizer_ms << "\n";
    }
    flatshard::flush_stdout();
  } catch (const CLI::Error& e) {
    return flatshard::tools::cli_exit(app, e, "flatshard-explain");
  } catch (const c10::Error& e) {
    std::cerr << "flatshard-explain: " << e.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
