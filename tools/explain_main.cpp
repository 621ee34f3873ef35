// flatshard-explain — print what a wrap policy will do to a model at a world size, before any
// GPU is involved: units, bytes, collectives per step, predicted peak memory, warnings.
//
//   flatshard-explain --preset 1b --policy layer --world 8      (named plans: docs/vocabulary.md)
//   flatshard-explain --model llama --preset 7b --world 8        (default policy: type=DecoderLayer)
//   flatshard-explain --preset small --layers 12 --policy "every=2,type=Block" --world 4
//                     --param-dtype bf16 --prefetch 2 --memory-limit 2GiB    (one line)
//   flatshard-explain --preset 1b --policy type=Block --world 8 --replicate 16   (HSDP)
//   flatshard-explain --preset 1b --policy "type=Linear|LayerNorm|Embedding" --world 8
//                     --collective-latency-us 80 --reference-step-ms 45      (one line)
//   flatshard-explain --preset 1b --world 1 --param-dtype bf16 --batch 4 --profile machine.json
//                     (adds the predicted peak with activations and the predicted step time)
//   flatshard-explain --preset 1b --world 8 --param-dtype bf16 --batch 4 --suggest
//                     --memory-limit 40GiB [--profile machine.json]   (the plan advisor,
//                     planner/advisor.h: the best plan as a spec, and why the others lose)
//   flatshard-explain --weights ~/models/Llama-3-70B --world 64 --param-dtype bf16 --batch 1
//                     (any checkpoint, from its headers: a model.safetensors, a Hugging Face
//                     index, a flatshard checkpoint or a directory holding one; with a LLaMA-style
//                     config.json also --batch and --suggest. planner/weights_tree.h)
//
// The reference model (--model gpt | llama, models/family.h) is built on the meta device (fsdp/meta_init.h): explaining 1B parameters
// allocates nothing. Your own model: call flatshard::explain() (planner/explain.h) from C++.
// Its module objects do live on the host (~20 KB a layer), so sizes are checked first, without
// building anything: at most kMaxLayers layers and kMaxParameters parameters (a clear error with
// the numbers instead of std::bad_alloc or minutes of allocation).
//
// Exit codes: 0 ok; 1 an input that is wrong (a policy that does not parse, a bad profile, a
// model too large, standard output that cannot be written) or --suggest with no fitting plan;
// 2 a command-line error, one line "flatshard-explain: error: ..." (cli/exit.h).
#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <limits>
#include <map>
#include <stdexcept>
#include <vector>

#include "planner/advisor.h"
#include "planner/cost_model.h"
#include "planner/explain.h"
#include "planner/machine_profile.h"
#include "planner/topology.h"
#include "support/output_file.h"
#include "fsdp/meta_init.h"
#include "models/family.h"
#include "models/hf_config.h"
#include "planner/weights_tree.h"
#include "wrap_policies/spec.h"
#include "cli/byte_size.h"
#include "cli/numbers.h"
#include "cli/options.h"
#include "support/input_file.h"
#include "cli/exit.h"
#include "cli/named_plans.h"
#include "support/format.h"
#include "support/input_file.h"

namespace {

// Sanity bounds of the model flags: 2^16 layers (every layer's modules are host objects; explain
// is linear in layers, ~1.5 ms each), 1e15 parameters (a thousand times today's largest
// models; keeps every byte count, x4 copies of fp32 state, far inside int64).
constexpr int64_t kMaxLayers = int64_t{1} << 16;
constexpr long double kMaxParameters = 1e15L;

// "--prefetch-depths 1,2": each item an integer in [lo, hi], no empty item ("1,,2"), no
// repeat ("1,1": a repeated depth only repeated rows of the advisor's table). Throws the
// message as std::invalid_argument.
std::vector<int> parse_int_list(const std::string& text, int lo, int hi) {
  std::vector<int> out;
  size_t begin = 0;
  while (true) {
    const size_t comma = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, comma - begin);
    if (item.empty())
      throw std::invalid_argument("empty item in '" + flatshard::printable_escape(text) +
                                  "' (a comma-separated list, e.g. 1,2)");
    int64_t v = 0;
    try {
      v = flatshard::cli::parse_integer(item, lo, hi);  // decimal only
    } catch (const std::invalid_argument&) {
      throw std::invalid_argument("'" + flatshard::printable_escape(item) +
                                  "' is not an integer in [" + std::to_string(lo) + ", " +
                                  std::to_string(hi) + "]");
    }
    if (std::find(out.begin(), out.end(), static_cast<int>(v)) != out.end())
      throw std::invalid_argument(item + " is given twice in '" + flatshard::printable_escape(text) +
                                  "'");
    out.push_back(static_cast<int>(v));
    if (comma == text.size()) return out;
    begin = comma + 1;
  }
}

CLI::Validator int_list(int lo, int hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        try {
          parse_int_list(text, lo, hi);
          return "";
        } catch (const std::invalid_argument& e) {
          return e.what();
        }
      },
      "INT[,INT...]");
}

// Integer options: decimal only (cli/numbers.h), "--world: must be >= 1, got 0" instead of
// CLI11's range with 300 digits.
CLI::Validator at_least(int64_t lo, int64_t hi = std::numeric_limits<int>::max()) {
  return flatshard::cli::integer(lo, hi);
}
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// Real-valued options, same style: "--reference-step-ms: must be > 0, got 0"; at most `hi`
// (a physical bound: 1e308 us of latency printed 300-digit warnings).
CLI::Validator number_above(double lo, bool or_equal, double hi) {
  const std::string bound = std::string(or_equal ? ">= " : "> ") + CLI::detail::to_string(lo) +
                            " and <= " + CLI::detail::to_string(hi);
  return CLI::Validator(
      [lo, or_equal, hi, bound](std::string& text) -> std::string {
        double v = 0;
        try {
          v = flatshard::cli::parse_number(text);  // decimal only: "0x10" is not 16
        } catch (const std::invalid_argument& e) {
          return e.what();
        }
        if ((or_equal ? v >= lo : v > lo) && v <= hi) return "";
        return "must be " + bound + ", got " + text;
      },
      std::string("NUMBER") + (or_equal ? ">=" : ">") + CLI::detail::to_string(lo));
}

// What the command line asks of the plan, whatever the model (--model/--preset or --weights).
struct Request {
  std::string policy, memory_limit, profile_path;
  flatshard::cli::ShardingFlags sharding;  // --strategy, dtypes, --prefetch, --offload-step, ...
  int world = 1, replicate = 1, tp = 1, fwd_prefetch = 1, bwd_prefetch = 1, offload = 0;
  int64_t align = 8, batch = 0, seq = 0;
  bool keep = false, show_plan = false, suggest = false;
  int64_t gpus_per_node = -1, nodes = 0;  // --gpus-per-node (-1: the profile's), --nodes
  std::vector<int> offload_levels, prefetch_depths;
  flatshard::ExplainOptions cost;
};

// Errors about the files are one line (a name or a JSON message must not break it).
std::string one_line(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  for (auto& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  return s;
}

// A model to explain: its module tree on the meta device, what to print above the plan, the
// default policy and, where known, the shape --batch and --suggest need.
struct Described {
  std::shared_ptr<torch::nn::Module> tree;
  std::vector<std::string> notes;  // printed before the plan, one line each
  std::string model_line;          // "model: GPT vocab=... (N params)"; empty: none
  std::string default_policy, policy_note;
  // The one-rule specs the named plans build on (cli/named_plans.h): one unit per layer, one
  // per leaf module; empty where the model's types are not known.
  std::string layer_rule, leaf_rule;
  std::string tp_plan;  // the family's default TP plan (--tp); empty for --weights
  std::optional<flatshard::TransformerShape> shape;
  std::string no_shape;      // why `shape` is unset
  int64_t seq_len = 0;       // the model's longest sequence (0: unknown)
  std::string seq_len_what;  // what sets it, for the --seq error
};

// A reference family (models/family.h) built on meta from its preset and the size flags.
Described describe_reference(const flatshard::cli::ModelFlags& flags, bool tied) {
  auto cfg = flags.config(/*default_preset=*/"small");
  cfg.tie_embeddings() = tied;
  TORCH_CHECK(cfg.n_layers() <= kMaxLayers, "--layers ", cfg.n_layers(),
              " is more than explain builds (at most ", kMaxLayers,
              " layers: each is a set of host objects, even on the meta device)");
  const long double params = cfg.num_parameters_bound();
  TORCH_CHECK(params <= kMaxParameters, "the model would have ", static_cast<double>(params),
              " parameters (", cfg.to_string(), "), more than the sanity bound of ",
              static_cast<double>(kMaxParameters),
              "; check --vocab, --d-model, --layers and --seq");
  Described d;
  {
    flatshard::MetaInit meta;  // shapes only: nothing is allocated or initialised
    d.tree = cfg.build(/*seed=*/0);
  }
  flatshard::check_on_meta(*d.tree);
  d.model_line = "model: " + std::string(cfg.family().display_name()) + " " + cfg.to_string() +
                 " (" + std::to_string(cfg.num_parameters()) + " params)";
  d.default_policy = "type=" + cfg.family().modules().layer_type;
  d.layer_rule = d.default_policy;
  d.leaf_rule = "type=" + cfg.family().modules().leaf_types;
  d.tp_plan = cfg.family().modules().tp_plan;
  d.shape = cfg.transformer_shape();
  d.seq_len = cfg.seq_len();
  d.seq_len_what = "the model's seq_len " + std::to_string(cfg.seq_len()) + " (set by --seq)";
  return d;
}

// --weights: a checkpoint explained from its files' headers (planner/weights_tree.h reads them
// and builds the tree; models/hf_config.h reads config.json: type names, tied embeddings and
// the shape).
Described describe_weights(const std::string& path) {
  namespace fm = flatshard::models;
  struct {
    flatshard::WeightsInfo info;
    std::optional<fm::HfConfig> config;
  } m;
  Described d;
  m.info = flatshard::read_weights(path, fm::hf_naming());
  const auto& w = m.info;
  TORCH_CHECK(static_cast<long double>(w.num_parameters()) <= kMaxParameters, w.path, ": ",
              w.num_parameters(), " parameters, more than the sanity bound of ",
              static_cast<double>(kMaxParameters));
  const std::string config_path = w.config_path();
  if (!config_path.empty()) m.config = fm::read_hf_config(config_path);
  if (m.config) {
    if (auto note = fm::tie_hf_embeddings(*m.config, m.info)) d.notes.push_back(*note);
    fm::check_hf_weights(*m.config, m.info);
  }
  std::string weights =
      w.path + " (" + flatshard::weights_format_name(w.format) + ", " +
      std::to_string(w.files.size()) + (w.files.size() == 1 ? " file, " : " files, ") +
      std::to_string(w.tensors.size()) + " tensors, " + std::to_string(w.num_parameters()) +
      " params, file dtype " + w.dtype_summary() + "; planned as fp32 masters)";
  d.notes.insert(d.notes.begin(), "weights: " + weights);
  const bool known = m.config && m.config->known();
  d.notes.insert(d.notes.begin() + 1, m.config
                                          ? "config: " + config_path + ": " + m.config->describe()
                                          : "config: none (no config.json in " + w.dir + ")");
  d.notes.insert(d.notes.begin() + 2,
                 known
                     ? "types: from the architecture (" + m.config->type_prefix + "DecoderLayer, " +
                           m.config->type_prefix + "Attention, " + m.config->type_prefix + "MLP, " +
                           m.config->type_prefix + "RMSNorm, Linear, Embedding)"
                     : std::string("types: guessed from the tensor names: Linear (2-D weight), "
                                   "Embedding (2-D weight, path contains 'embed'), Norm (1-D "
                                   "weight), Module (the rest)"));
  int64_t buffers = 0;
  std::string first_buffer;
  for (const auto& t : w.tensors)
    if (t.buffer && buffers++ == 0) first_buffer = t.name;
  if (buffers > 0)
    d.notes.push_back("buffers: " + std::to_string(buffers) + " tensors not planned (" +
                      first_buffer + (buffers > 1 ? ", ...)" : ")"));
  if (w.unlisted > 0)
    d.notes.push_back("unlisted: " + std::to_string(w.unlisted) +
                      " tensors in the shard files are not in weight_map (left out)");
  d.tree = flatshard::module_tree_from_weights(
      m.info, m.config ? fm::hf_naming(*m.config) : fm::hf_naming());
  if (known) {
    d.shape = fm::hf_transformer_shape(*m.config);
    d.layer_rule = "type=" + d.shape->layer_type;
    if (!d.shape->leaf_types.empty()) d.leaf_rule = "type=" + d.shape->leaf_types;
  } else {
    d.leaf_rule = "type=Linear|Norm|Embedding";  // the guessed types (notes above)
    d.no_shape = m.config ? "config.json: " + m.config->describe() +
                                ": activations and step time need the model's shape"
                          : "no config.json: activations and step time need the model's shape; "
                            "pass a directory with config.json";
  }
  if (known) {
    d.seq_len = m.config->llama->seq_len;
    d.seq_len_what = "the model's max_position_embeddings " + std::to_string(d.seq_len);
  }
  const auto layers = flatshard::find_layer_list(m.info);
  const auto spec = layers ? flatshard::layer_list_policy(*layers) : std::nullopt;
  d.default_policy = spec ? *spec : "none";
  if (!known && spec) d.layer_rule = *spec;
  d.policy_note = spec ? " (default: one unit per layer of " + layers->prefix + ", " +
                             std::to_string(layers->count) + " layers)"
                       : " (default: no layer list recognised, the root only; pass --policy)";
  return d;
}

// --policy as given: a named plan (cli/named_plans.h: leaf, layer, every-K, model, noshard)
// becomes its spec for this model; anything else is a spec. A word that is neither (a mistyped
// name) and local (no plan at all) are command-line errors.
std::string policy_spec(const Described& m, const std::string& policy) {
  namespace ft = flatshard::tools;
  std::optional<std::string> spec;
  try {
    spec = ft::named_plan_spec(policy, m.layer_rule, m.leaf_rule);
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError("--policy", e.what());
  }
  if (spec && spec->empty())
    throw CLI::ValidationError(
        "--policy", "'local' is flatshard-bench's unsharded floor: there is no plan to explain "
                    "(the whole model as one unit is 'model')");
  if (spec) return *spec;
  if (policy != "none" && policy.find_first_of("=:>") == std::string::npos) {
    const std::string hint = ft::named_plan_hint(policy);
    if (!hint.empty())
      throw CLI::ValidationError("--policy", "'" + policy + "' is neither a named plan (local, "
                                             "leaf, layer, every-K, model, noshard) nor a spec" +
                                                 hint);
  }
  return policy;
}

// --- Issue 52: the cluster (--gpus-per-node, --nodes). Sets the profile's gpus_per_node from
// the flag and returns the line that says where the groups sit ("" without a topology). The
// GPUs must fill whole nodes when they span more than one.
std::string cluster_line(const Request& r, flatshard::MachineProfile* profile) {
  if (r.gpus_per_node >= 0) profile->gpus_per_node = static_cast<double>(r.gpus_per_node);
  const auto g = static_cast<int64_t>(profile->gpus_per_node);
  if (g == 0) return "";
  const int64_t gpus = static_cast<int64_t>(r.world) * r.replicate;
  TORCH_CHECK(gpus <= g || gpus % g == 0, "--world ", r.world, " x --replicate ", r.replicate,
              " = ", gpus, " GPUs do not fill whole nodes of ", g,
              " GPUs (--gpus-per-node or the profile's gpus_per_node)");
  const auto shard = flatshard::shard_group_span(r.world, gpus <= g ? 0 : g);
  std::string s = "cluster: " + std::to_string(gpus) + " GPUs on " +
                  std::to_string(std::max<int64_t>(1, gpus / g)) + " node(s) of " +
                  std::to_string(g) + "; shard group " + shard.to_string();
  if (r.replicate > 1)
    s += ", replicate group " +
         flatshard::replicate_group_span(r.replicate, r.world, gpus <= g ? 0 : g).to_string();
  return s;
}

// The plan, its explanation and (with --batch) the prediction, or (--suggest) the advisor's
// choice, for any described model.
int run(const Described& m, const Request& r) {
  const bool policy_given = !r.policy.empty();
  const std::string policy = policy_given ? policy_spec(m, r.policy) : m.default_policy;
  const std::string policy_note = policy_given ? (policy != r.policy ? " (" + r.policy + ")" : "")
                                               : m.policy_note;

  flatshard::ShardingOptions opts = flatshard::cli::sharding_options(r.sharding, c10::kFloat);
  opts.reshard_after_forward = !r.keep;
  opts.offload = r.offload;
  if (r.sharding.prefetch < 0) {  // else --prefetch set both depths
    opts.forward_prefetch = r.fwd_prefetch;
    opts.backward_prefetch = r.bwd_prefetch;
  }
  opts.align = r.align;
  std::optional<int64_t> limit;
  if (!r.memory_limit.empty()) limit = flatshard::cli::parse_byte_size(r.memory_limit);  // checked
  flatshard::MachineProfile profile = flatshard::MachineProfile::defaults();
  // Read only where it is used (--batch, --suggest); elsewhere main() said it is ignored.
  if (!r.profile_path.empty() && (r.batch > 0 || r.suggest))
    profile = flatshard::load_profile_named(r.profile_path);  // a name or a file
  const std::string cluster = cluster_line(r, &profile);
  const flatshard::Workload workload{r.batch > 0 ? r.batch : 1, r.seq > 0 ? r.seq : m.seq_len};
  if (m.shape)
    TORCH_CHECK(workload.seq <= m.seq_len, "--seq ", workload.seq, " is longer than ",
                m.seq_len_what);

  flatshard::TpPlan tp_plan;
  if (r.tp > 1) {
    TORCH_CHECK(!m.tp_plan.empty(), "--tp ", r.tp,
                " needs a reference model (--model): a "
                "checkpoint given by --weights has no TP plan");
    tp_plan = flatshard::parse_tp_plan(m.tp_plan);
  }
  for (const auto& n : m.notes) std::cout << flatshard::printable_escape(n) << "\n";
  if (r.suggest) {
    if (!limit && profile.device_memory_gb > 0) {  // the device's memory (issue 52)
      limit = static_cast<int64_t>(profile.device_memory_gb * 1e9);
      std::cout << "memory limit: the profile's device memory, " << profile.device_memory_gb
                << " GB (--memory-limit to set another)\n";
    }
    TORCH_CHECK(limit.has_value(), "--suggest needs --memory-limit (e.g. 40GiB) or a profile "
                "with device_memory_gb (--profile h100-ib400)");
    if (!m.shape) {
      flatshard::flush_stdout();
      std::cerr << "flatshard-explain: --suggest: " << m.no_shape << std::endl;
      return 1;
    }
    flatshard::AdvisorOptions a;
    a.memory_limit_bytes = *limit;
    a.workload = workload;
    a.shape = *m.shape;
    a.profile = profile;
    a.offload_levels = r.offload_levels;
    a.prefetch_depths = r.prefetch_depths;
    if (policy_given) a.extra_specs.push_back(policy);  // the user's plan competes too
    // --tp N: tp 1 and every divisor of N above 1 compete on the same --world x --tp ranks
    // (planner/advisor.h: tp_sizes; a size the heads cannot split is skipped, said why).
    const int ranks = r.world * r.tp;
    for (int t = 2; t <= r.tp; ++t)
      if (r.tp % t == 0) a.tp_sizes.push_back(t);
    if (!a.tp_sizes.empty()) a.tp_plan = tp_plan;
    if (profile.gpus_per_node > 0)  // a cluster: every HSDP shard size aligned with its nodes
      a.shard_sizes = flatshard::cluster_shard_sizes(
          static_cast<int64_t>(ranks) * r.replicate, static_cast<int64_t>(profile.gpus_per_node));
    if (!m.model_line.empty()) std::cout << m.model_line << "\n";
    if (!cluster.empty()) std::cout << cluster << "\n";
    const auto advice = flatshard::suggest(*m.tree, ranks, r.replicate, opts, a);
    std::cout << advice.to_string();
    flatshard::flush_stdout();
    // Nothing fits: the table says why; the exit status says the advisor found no plan.
    if (!advice.fits()) {
      std::cerr << "flatshard-explain: --suggest: no candidate plan fits the memory limit of "
                << *limit << " bytes per rank" << std::endl;
      return 1;
    }
    return 0;
  }
  const auto plan = flatshard::make_plan(*m.tree, flatshard::parse_policy(policy));
  // The policy is the user's text (or a spec built from a checkpoint's names): escaped.
  std::cout << (m.model_line.empty() ? "" : m.model_line + "; ")
            << "policy: " << flatshard::printable_escape(policy)
            << flatshard::printable_escape(policy_note) << "\n";
  if (r.show_plan) std::cout << plan.to_string();
  flatshard::ExplainOptions cost = r.cost;
  cost.advice = flatshard::ExplainOptions::Advice::kSpec;  // advice in --policy text
  const auto e = flatshard::explain(*m.tree, plan, flatshard::MeshShape(r.world, r.replicate, r.tp),
                                    opts, limit, cost, tp_plan);
  if (r.tp > 1) std::cout << "tp plan: " << flatshard::printable_escape(tp_plan.to_spec()) << "\n";
  std::cout << e.to_string();
  if (r.tp > 1 && r.batch > 0) {
    // The TP collectives' sizes follow the tokens; the cost model does not cover TP yet.
    const flatshard::TpCounters c =
        e.tp.counters(workload.tokens(), opts.mixed_precision.param_dtype);
    std::cout << "tp collectives per step at batch " << workload.batch << " x seq " << workload.seq
              << ": " << c.forward_all_reduces << " forward all-reduces, "
              << flatshard::format_bytes(c.forward_bytes) << " (" << c.forward_bytes << " B); "
              << c.backward_all_reduces << " backward all-reduces, "
              << flatshard::format_bytes(c.backward_bytes) << " (" << c.backward_bytes
              << " B) per rank\n"
              << "note: --batch: the step-time and peak prediction does not model tensor "
                 "parallelism yet (issue 51); memory per rank above is the TP-local model "
                 "state\n";
  } else if (r.batch > 0 && !m.shape) {
    std::cout << "note: --batch: " << m.no_shape << "\n";
  } else if (r.batch > 0) {
    const auto p = flatshard::predict_cost(e, *m.shape, workload, profile);
    std::cout << "batch " << workload.batch << " x seq " << workload.seq
              << "; profile: " << flatshard::printable_escape(profile.source) << "\n"
              << p.to_string() << "prediction: peak_bytes=" << p.peak_bytes
              << " step_ms=" << p.step_ms << " exposed_comm_ms=" << p.exposed_comm_ms
              << " host_ms=" << p.host_ms << " host_bound=" << (p.host_bound ? 1 : 0)
              << " host_bytes=" << p.host_bytes
              << " optimizer_ms=" << p.optimizer_ms + p.cpu_optimizer_ms << "\n";
    if (!cluster.empty()) std::cout << cluster << "\n";
    std::cout << p.throughput(profile) << "\n"
              << "throughput: tokens_per_s_per_gpu=" << p.tokens_per_s()
              << " mfu=" << p.mfu(profile.peak_tflops) << "\n";
    // The limit above was checked against the model state; with --batch the full peak is
    // known, the number --suggest checks the same flag against.
    if (limit)
      std::cout << (p.peak_bytes > *limit ? "warning: " : "") << "memory limit "
                << flatshard::format_bytes(*limit) << " against the predicted peak with "
                << "activations " << flatshard::format_bytes(p.peak_bytes) << ": "
                << (p.peak_bytes > *limit ? "exceeds it" : "fits") << "\n";
  }
  flatshard::flush_stdout();
  return 0;
}

// Everything the command line says.
struct CommandLine {
  flatshard::cli::ModelFlags model;  // --model, --preset, the size overrides, --seq
  bool tied = false;
  std::string weights;  // --weights: a checkpoint instead of the reference model
  std::string offload_levels_text = "0", prefetch_depths_text = "1,2";
  Request r;  // what the options ask of the plan
};

// The model and the plan: what is explained.
void add_plan_flags(CLI::App& app, CommandLine& c) {
  Request& r = c.r;
  const auto model = flatshard::cli::add_model_flags(
      app, c.model, "Model", "default small",
      "tokens per sequence (old name --seq-len); a reference model's seq_len too, as in "
      "flatshard-bench. With --weights: the sequences of --batch / --suggest, at most the "
      "checkpoint's max_position_embeddings");
  auto* tied = app.add_flag("--tied", c.tied, "tie lm_head.weight to the token embedding")
                   ->group("Model");
  CLI::Option* w = app.add_option(
      "--weights", c.weights,
      "explain a checkpoint from its headers instead of a reference model: a model.safetensors, "
      "a Hugging Face *.safetensors.index.json, a flatshard checkpoint's manifest.json, or a "
      "directory holding one (with config.json: type names and the shape for --batch and "
      "--suggest; planner/weights_tree.h, models/hf_config.h)");
  w->check(flatshard::cli::non_empty("a path"))->group("Model");
  for (CLI::Option* other :
       {model.family, model.preset, model.vocab, model.d_model, model.heads, model.layers, tied})
    w->excludes(other);

  const char* plan = "Plan";
  app.add_option("--policy", r.policy,
                 "a named plan (leaf, layer, every-K, model, noshard: docs/vocabulary.md) or a "
                 "wrap policy spec (wrap_policies/spec.h), e.g. \"every=2,type=Block\"; "
                 "\"none\" = model: root only (default: layer, one unit per layer)")
      ->check(flatshard::cli::non_empty("a named plan or a policy spec"))
      ->group(plan);
  // Required unless --nodes gives it (resolve_world()).
  app.add_option("--world", r.world, "number of ranks (with --replicate: ranks per shard group)")
      ->transform(at_least(1))
      ->group(plan);
  flatshard::cli::add_tp_flag(app, r.tp, plan,
                              "ranks: --world x --replicate x --tp (--world is the shard group); with "
                              "--suggest, tp 1 and every divisor of --tp above 1 compete on "
                              "those ranks");
  app.add_option("--replicate", r.replicate,
                 "HSDP: replicas of the shard group (default 1: plain sharding over --world)")
      ->transform(at_least(1))
      ->group(plan);
  flatshard::cli::add_sharding_flags(app, r.sharding, plan, "fp32");
  app.add_flag("--keep", r.keep, "FULL_SHARD units keep parameters from forward to backward")
      ->group(plan);
  app.add_option("--offload", r.offload,
                 "CPU offload level for units the policy sets none for: 0 off, 1 master, grads "
                 "and AdamW state on the host, 2 the compute-dtype shard too")
      ->transform(at_least(0, 2))
      ->capture_default_str()
      ->group(plan);
  app.add_option("--forward-prefetch", r.fwd_prefetch, "units all-gathered ahead in forward")
      ->transform(at_least(0))
      ->capture_default_str()
      ->group(plan);
  app.add_option("--backward-prefetch", r.bwd_prefetch, "units all-gathered ahead in backward")
      ->transform(at_least(0))
      ->capture_default_str()
      ->group(plan);
  app.add_option("--align", r.align, "alignment of parameters in a flat buffer, in elements")
      ->transform(at_least(1, kInt64Max))
      ->capture_default_str()
      ->group(plan);
}

// What is reported beside the plan: the memory limit, the prediction, the advisor.
void add_report_flags(CLI::App& app, CommandLine& c) {
  Request& r = c.r;
  const char* report = "Report";
  app.add_option("--memory-limit", r.memory_limit,
                 "memory per rank, with a unit (40GiB, 40GB, 512MiB; bytes as 123B). Checked "
                 "against the model state (prefetch depth); with --batch also against the full "
                 "predicted peak, which is what --suggest checks")
      ->check(flatshard::cli::non_empty("a size such as 40GiB"))
      ->check(flatshard::cli::byte_size())
      ->group(report);
  app.add_option("--collective-latency-us", r.cost.collective_latency_us,
                 "fixed cost of one collective for the fragmentation warning (NVLink: ~50)")
      ->check(number_above(0, /*or_equal=*/true, flatshard::kMaxLatencyUs))
      ->capture_default_str()
      ->group(report);
  app.add_option("--reference-step-ms", r.cost.reference_step_ms,
                 "step time the collectives' latency is compared with (explain has no compute "
                 "model; default: the 1B GPT at 4 seq/GPU on H200)")
      ->check(number_above(0, /*or_equal=*/false, /*hi=*/1e9))
      ->capture_default_str()
      ->group(report);
  app.add_flag("--plan", r.show_plan, "also print the plan (Plan::to_string)")->group(report);
  app.add_option("--batch", r.batch,
                 "sequences per rank per step: adds the predicted peak with activations and the "
                 "step time (planner/cost_model.h)")
      ->transform(at_least(1, kInt64Max))
      ->group(report);
  app.add_option("--profile", r.profile_path,
                 "machine profile JSON (planner/machine_profile.h; flatshard-bench --write-profile) "
                 "or a named one (planner/profiles/: h100-ib400, h200-ib400, a100-ib200); "
                 "default: the stated defaults (1x/2x H200 measurements)")
      ->check(flatshard::cli::non_empty("a file path"))
      ->group(report);
  app.add_flag("--suggest", r.suggest,
               "plan advisor: the plan that fits --memory-limit at the best predicted step "
               "(--memory-limit, else the profile's device_memory_gb; --batch defaults to 1; a "
               "--policy given joins the candidates)")
      ->group(report);
  app.add_option("--offload-levels", c.offload_levels_text,
                 "--suggest: offload levels to try, e.g. 0,1,2 (default 0; no repeats)")
      ->check(int_list(0, 2))
      ->group(report);
  app.add_option("--prefetch-depths", c.prefetch_depths_text,
                 "--suggest: prefetch depths to try, each in [0, 64] (default 1,2; no repeats)")
      ->check(int_list(0, 64))
      ->group(report);
  // Issue 52: the cluster (planner/topology.h).
  app.add_option("--gpus-per-node", r.gpus_per_node,
                 "GPUs per node: collectives of groups that span nodes run at the network's "
                 "speed (planner/topology.h); --suggest then also searches HSDP shard sizes. "
                 "Default: the profile's gpus_per_node (0: one node)")
      ->transform(at_least(0, 1000000))  // the profile key's bound (planner/machine_profile.h)
      ->group(report);
  app.add_option("--nodes", r.nodes,
                 "nodes of --gpus-per-node GPUs: sets --world to nodes x GPUs per node "
                 "(/ --replicate)")
      ->transform(at_least(1, kInt64Max))
      ->group(report);
}

// --world from --nodes x --gpus-per-node (/ --replicate), or --world alone; a usage error (exit
// code) otherwise, 0 when the world is set.
int resolve_world(const CLI::App& app, Request& r) {
  const bool world_given = app.get_option("--world")->count() > 0;
  auto usage = [&](const CLI::Error& e) {
    return flatshard::tools::cli_exit(app, e, "flatshard-explain");
  };
  if (r.nodes == 0) {
    if (world_given) return 0;
    return usage(CLI::RequiredError("--world is required (or --nodes with --gpus-per-node)",
                                    CLI::ExitCodes::RequiredError));
  }
  if (r.gpus_per_node <= 0)
    return usage(CLI::ValidationError("--nodes", "needs --gpus-per-node (GPUs per node, >= 1)"));
  if (r.nodes > std::numeric_limits<int>::max() / r.gpus_per_node)
    return usage(CLI::ValidationError("--nodes", std::to_string(r.nodes) + " nodes of " +
                                                     std::to_string(r.gpus_per_node) +
                                                     " GPUs are more ranks than an int holds"));
  const int64_t gpus = r.nodes * r.gpus_per_node;
  if (gpus % r.replicate != 0 || (world_given && gpus != int64_t{r.world} * r.replicate))
    return usage(CLI::ValidationError(
        "--nodes", std::to_string(r.nodes) + " x " + std::to_string(r.gpus_per_node) + " = " +
                       std::to_string(gpus) + " GPUs is not --world " + std::to_string(r.world) +
                       " x --replicate " + std::to_string(r.replicate)));
  r.world = static_cast<int>(gpus / r.replicate);
  return 0;
}

// An option this combination does not read is said, never dropped silently.
void warn_ignored(const CLI::App& app, const CommandLine& c) {
  const Request& r = c.r;
  auto ignored = [&](const char* flag, bool unused, const std::string& why) {
    if (unused && app.get_option(flag)->count() > 0)
      std::cerr << "flatshard-explain: warning: " << flag << " " << why << std::endl;
  };
  const bool predicts = r.batch > 0 || r.suggest;
  const bool prefetch = r.sharding.prefetch >= 0;
  ignored("--seq", !c.weights.empty() && !predicts,
          "with --weights sets the sequences of --batch or --suggest: ignored without them");
  ignored("--profile", !predicts, "is read only with --batch or --suggest: ignored");
  ignored("--prefetch-depths", !r.suggest, "is read only with --suggest: ignored");
  ignored("--offload-levels", !r.suggest, "is read only with --suggest: ignored");
  ignored("--prefetch", r.suggest, "is ignored by --suggest, which tries --prefetch-depths");
  for (const char* flag : {"--forward-prefetch", "--backward-prefetch"})
    ignored(flag, r.suggest || prefetch,
            r.suggest ? "is ignored by --suggest, which tries --prefetch-depths"
                      : "is overridden by --prefetch, which sets both depths");
  ignored("--offload", r.suggest, "is ignored by --suggest, which tries --offload-levels");
  ignored("--plan", r.suggest, "is not printed by --suggest: ignored");
  ignored("--collective-latency-us", r.suggest,
          "is not read by --suggest (the profile's collective costs are): ignored");
  ignored("--reference-step-ms", r.suggest,
          "is not read by --suggest (it predicts the step): ignored");
  ignored("--gpus-per-node", !predicts, "is read only with --batch or --suggest: ignored");
}

// The model described (a checkpoint's headers or the reference model), then run(); the exit
// code.
int explain_command(const CLI::App& app, const CommandLine& c) {
  try {
    Described m;
    if (!c.weights.empty()) {  // a checkpoint's headers instead of a reference model
      try {
        m = describe_weights(c.weights);
      } catch (const c10::Error& e) {  // about the files: one line (names, JSON messages)
        std::cerr << "flatshard-explain: "
                  << flatshard::printable_escape(one_line(e.what_without_backtrace())) << std::endl;
        return 1;
      }
    } else {
      m = describe_reference(c.model, c.tied);
    }
    return run(m, c.r);
  } catch (const CLI::Error& e) {
    return flatshard::tools::cli_exit(app, e, "flatshard-explain");
  } catch (const c10::Error& e) {
    std::cerr << "flatshard-explain: " << flatshard::cli::escape_lines(e.what_without_backtrace())
              << "\n";
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flatshard-explain: what a wrap policy does to a reference model at a world size "
               "(units, bytes, collectives per step, predicted peak memory, warnings). Builds "
               "nothing but shapes."};
  CommandLine c;
  add_plan_flags(app, c);
  add_report_flags(app, c);
  // Old names (docs/vocabulary.md): one vocabulary with flatshard-bench.
  const std::vector<flatshard::tools::FlagRename> renames = {
      {"--n-layers", "--layers"}, {"--n-heads", "--heads"}, {"--seq-len", "--seq"}};
  int parse_exit = 0;
  if (!flatshard::tools::parse_command_line(app, argc, argv, "flatshard-explain", renames,
                                            &parse_exit))
    return parse_exit;
  warn_ignored(app, c);
  if (const int code = resolve_world(app, c.r)) return code;
  c.r.seq = c.model.seq;
  c.r.offload_levels = parse_int_list(c.offload_levels_text, 0, 2);  // checked by int_list
  c.r.prefetch_depths = parse_int_list(c.prefetch_depths_text, 0, 64);
  return explain_command(app, c);
}
