// flatshard/models/hf_config.cpp — see hf_config.h for the contract.
#include "models/hf_config.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include "models/family.h"
#include "support/input_file.h"
#include "support/json.h"

namespace flatshard {
namespace models {

namespace {

// A known architecture: its type-name prefix and transformers' defaults for the optional keys.
struct Known {
  const char* architecture;
  const char* model_type;
  const char* prefix;
  int64_t max_position_embeddings;
};
const Known kKnown[] = {
    {"LlamaForCausalLM", "llama", "Llama", 2048},
    {"MistralForCausalLM", "mistral", "Mistral", 4096 * 32},
    {"Qwen2ForCausalLM", "qwen2", "Qwen2", 32768},
};
const char* kKnownList = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_number(const std::string& s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  return os.str() + "]";
}

// A required size in [1, hi].
int64_t size_key(const json::Node& root, const std::string& key, int64_t hi) {
  const json::Node n = root.at(key);
  const int64_t v = n.as_int();
  if (v < 1 || v > hi)
    n.fail("must be in [1, " + std::to_string(hi) + "], got " + std::to_string(v));
  return v;
}
std::optional<json::Node> present(const json::Node& root, const std::string& key) {
  auto n = root.find(key);
  if (n && n->is_null()) return std::nullopt;
  return n;
}

// Which config.json key each checked value came from (the names errors use).
struct HfKeys {
  std::string rope;                       // "rope_scaling" or "rope_parameters"
  std::string rope_theta = "rope_theta";  // or "<rope>.rope_theta"
};

// LlamaConfig::validate()'s rules on the values read from config.json, each error in the
// file's own terms: "num_attention_heads (6) must divide hidden_size (256) in <path>". The
// sizes' ranges are checked where they are read (size_key); validate() stays the backstop.
void check_in_file_terms(const llama::LlamaConfig& l, const HfKeys& keys, const std::string& path) {
  const std::string in = " in " + printable_escape(path);
  TORCH_CHECK(l.head_size > 0 || l.d_model % l.n_heads == 0, "num_attention_heads (", l.n_heads,
              ") must divide hidden_size (", l.d_model, ")", in,
              " (or head_dim must give the head size)");
  TORCH_CHECK(l.n_heads % l.kv_heads() == 0, "num_key_value_heads (", l.kv_heads(),
              ") must divide num_attention_heads (", l.n_heads, ")", in);
  TORCH_CHECK(l.head_dim() % 2 == 0, "the head size ",
              l.head_size > 0
                  ? "head_dim (" + std::to_string(l.head_size) + ")"
                  : "hidden_size / num_attention_heads (" + std::to_string(l.d_model) + " / " +
                        std::to_string(l.n_heads) + " = " + std::to_string(l.head_dim()) + ")",
              " must be even", in, " (RoPE rotates pairs)");
  TORCH_CHECK(std::isfinite(l.rope_theta) && l.rope_theta > 1.0, keys.rope_theta, " (",
              l.rope_theta, ") must be finite and > 1", in);
  TORCH_CHECK(std::isfinite(l.norm_eps) && l.norm_eps > 0.0, "rms_norm_eps (", l.norm_eps,
              ") must be finite and > 0", in);
  const llama::RopeScaling& r = l.rope_scaling;
  if (r.type != llama::RopeScaling::Type::kNone)
    TORCH_CHECK(std::isfinite(r.factor) && r.factor > 0, keys.rope, ".factor (", r.factor,
                ") must be finite and > 0", in);
  if (r.type == llama::RopeScaling::Type::kLlama3) {
    TORCH_CHECK(std::isfinite(r.low_freq_factor) && std::isfinite(r.high_freq_factor) &&
                    r.low_freq_factor > 0 && r.low_freq_factor < r.high_freq_factor,
                keys.rope, ".low_freq_factor (", r.low_freq_factor, ") must be > 0 and below ",
                keys.rope, ".high_freq_factor (", r.high_freq_factor, ")", in);
    TORCH_CHECK(r.original_max_position_embeddings > 0, keys.rope,
                ".original_max_position_embeddings (", r.original_max_position_embeddings,
                ") must be > 0", in);
  }
}

// Path renaming for hf_transformer_shape: the family's top-level paths and the components
// inside a layer (models/llama.h's module paths -> transformers' names).
const std::map<std::string, std::string>& top_names() {
  static const std::map<std::string, std::string> m = {{"layers", "model.layers"},
                                                       {"embed_tokens", "model.embed_tokens"},
                                                       {"norm", "model.norm"},
                                                       {"lm_head", "lm_head"},
                                                       {"rope", ""}};  // no tensors in HF files
  return m;
}
const std::map<std::string, std::string>& inner_names() {
  static const std::map<std::string, std::string> m = {
      {"input_norm", "input_layernorm"},
      {"post_attn_norm", "post_attention_layernorm"},
      {"attn", "self_attn"},
      {"q", "q_proj"},
      {"k", "k_proj"},
      {"v", "v_proj"},
      {"o", "o_proj"},
      {"mlp", "mlp"},
      {"gate", "gate_proj"},
      {"up", "up_proj"},
      {"down", "down_proj"}};
  return m;
}
std::string rename(const std::string& path, bool top) {
  std::string out;
  size_t start = 0;
  bool first = true;
  while (start <= path.size()) {
    const size_t dot = path.find('.', start);
    const std::string part =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    const auto& table = first && top ? top_names() : inner_names();
    auto it = table.find(part);
    TORCH_CHECK(it != table.end(), "hf_transformer_shape: the LLaMA family's path '", path,
                "' has no Hugging Face name (models/hf_config.cpp's tables need it)");
    if (first && top && it->second.empty()) return "";
    out += (out.empty() ? "" : ".") + it->second;
    first = false;
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return out;
}

// flatshard's LLaMA module path -> transformers' ("layers.3.attn.q" ->
// "model.layers.3.self_attn.q_proj"), with the tables above; nullopt for a module transformers
// has none of (rope: the rotary table is not in a checkpoint) or a path the tables do not know.
std::optional<std::string> hf_module_path(const std::string& path) {
  if (path.empty()) return std::string();
  std::vector<std::string> parts;
  for (size_t start = 0;;) {
    const size_t dot = path.find('.', start);
    parts.push_back(path.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  auto top = top_names().find(parts[0]);
  if (top == top_names().end() || top->second.empty()) return std::nullopt;
  std::string out = top->second;
  size_t i = 1;
  if (parts[0] == "layers" && parts.size() > 1) {
    if (!is_number(parts[1])) return std::nullopt;
    out += "." + parts[1];
    i = 2;
  }
  if (i < parts.size() && parts[0] != "layers") return std::nullopt;  // below a leaf
  for (; i < parts.size(); ++i) {
    auto it = inner_names().find(parts[i]);
    if (it == inner_names().end()) return std::nullopt;
    out += "." + it->second;
  }
  return out;
}

const Known& known_of(llama::LlamaConfig::Architecture a) {
  using Arch = llama::LlamaConfig::Architecture;
  return kKnown[a == Arch::kLlama ? 0 : a == Arch::kMistral ? 1 : 2];
}

}  // namespace

ModuleAliases::Alias hf_module_alias(const llama::LlamaConfig& l, const std::string& path) {
  ModuleAliases::Alias alias;
  alias.path = hf_module_path(path);
  if (!alias.path) return {};
  // The type as flatshard-explain --weights names it: hf_module_namer on the Hugging Face path.
  HfConfig c;
  c.architecture = known_of(l.architecture).architecture;
  c.type_prefix = known_of(l.architecture).prefix;
  c.llama = l;
  ModuleView view;
  view.path = *alias.path;
  view.name = view.path.substr(view.path.rfind('.') == std::string::npos ? 0
                                                                         : view.path.rfind('.') + 1);
  alias.type = hf_module_namer(c)(view);
  return alias;
}

}  // namespace models

namespace llama {
// LlamaImpl's ModuleAliases (models/llama.h), defined here beside the Hugging Face naming it
// returns, so that llama.cpp needs no hf_config.h (which includes llama.h).
ModuleAliases::Alias LlamaImpl::module_alias(const std::string& path,
                                             const torch::nn::Module& /*module*/) const {
  return models::hf_module_alias(cfg_, path);
}
}  // namespace llama

namespace models {

std::string HfConfig::describe() const {
  std::string name = architecture.empty() ? model_type : architecture;
  name = name.empty() ? "(no architecture)" : printable_escape(name);  // the file's value
  if (!known()) return name + ": " + unknown_reason;
  return name + " (flatshard's LLaMA: " + llama->to_string() + ")";
}

HfConfig parse_hf_config(const std::string& text, const std::string& path) {
  HfConfig c;
  c.path = path;
  const std::string where = printable_escape(path);  // in every error below
  const json::Json doc = json::parse(text, where);
  const json::Node root(doc, where);
  TORCH_CHECK(root.is_object(), where, ": config.json must be a JSON object");
  if (auto a = present(root, "architectures")) {
    const auto items = a->items();
    if (!items.empty()) c.architecture = items.front().as_string();
  }
  if (auto m = present(root, "model_type")) c.model_type = m->as_string();
  if (auto t = present(root, "tie_word_embeddings")) c.tie_word_embeddings = t->as_bool();

  const Known* known = nullptr;
  for (const Known& k : kKnown)
    if (c.architecture.empty() ? c.model_type == k.model_type : c.architecture == k.architecture)
      known = &k;
  if (known == nullptr) {
    c.unknown_reason =
        c.architecture.empty() && c.model_type.empty()
            ? "names no architecture (no 'architectures' or 'model_type')"
            : std::string("architecture not known to flatshard (known: ") + kKnownList + ")";
    return c;
  }
  c.type_prefix = known->prefix;
  using Arch = llama::LlamaConfig::Architecture;

  llama::LlamaConfig l;
  l.architecture = known == &kKnown[0] ? Arch::kLlama
                   : known == &kKnown[1] ? Arch::kMistral
                                         : Arch::kQwen2;
  l.vocab = size_key(root, "vocab_size", int64_t{1} << 31);
  l.d_model = size_key(root, "hidden_size", int64_t{1} << 20);
  l.n_heads = size_key(root, "num_attention_heads", int64_t{1} << 16);
  l.n_layers = size_key(root, "num_hidden_layers", int64_t{1} << 16);
  l.hidden = size_key(root, "intermediate_size", int64_t{1} << 22);
  l.n_kv_heads = present(root, "num_key_value_heads")
                     ? size_key(root, "num_key_value_heads", int64_t{1} << 16)
                     : l.n_heads;
  l.seq_len = present(root, "max_position_embeddings")
                  ? size_key(root, "max_position_embeddings", int64_t{1} << 31)
                  : known->max_position_embeddings;
  l.norm_eps = 1e-6;
  if (auto e = present(root, "rms_norm_eps")) l.norm_eps = e->as_number();
  l.tie_embeddings = c.tie_word_embeddings;
  if (auto h = present(root, "head_dim")) {
    const int64_t hd = h->as_int();
    if (hd <= 0 || hd > (int64_t{1} << 16))
      h->fail("head_dim " + std::to_string(hd) + " is outside [1, 65536]");
    // An explicit head size other than hidden_size / num_attention_heads (Mistral-Nemo,
    // Llama-3-style variants): LlamaConfig::head_size.
    if (l.d_model % l.n_heads != 0 || hd != l.d_model / l.n_heads) l.head_size = hd;
  }
  if (auto a = present(root, "hidden_act"))
    if (a->as_string() != "silu")
      a->fail("hidden_act '" + printable_escape(a->as_string()) +
              "' is not supported (flatshard's LLaMA MLP is SwiGLU with silu)");
  // Biases as transformers 5 builds each architecture (models/<arch>/modeling_<arch>.py): only
  // LlamaForCausalLM reads attention_bias and mlp_bias; Qwen2's q/k/v projections always have
  // biases and Mistral's never do, and neither has MLP biases, whatever the config says (the
  // keys are ignored there, so a Qwen2 config with "attention_bias": false still has biases).
  l.attention_bias = l.architecture == Arch::kQwen2;
  if (l.architecture == Arch::kLlama) {
    if (auto b = present(root, "attention_bias")) l.attention_bias = b->as_bool();
    if (auto b = present(root, "mlp_bias"))
      if (b->as_bool())
        b->fail("mlp_bias true is not supported (flatshard's LLaMA MLP has no biases)");
  }
  // RoPE: transformers 5 writes rope_parameters {rope_type, rope_theta, factor, ...}; earlier
  // configs rope_theta beside rope_scaling {rope_type | type, factor, ...} (null: none). With
  // both, transformers 5 takes rope_scaling when it is a non-empty object
  // (modeling_rope_utils.py: `rope_scaling or rope_parameters`); rope_theta inside the chosen
  // object wins over the top-level one.
  HfKeys keys;
  if (auto r = present(root, "rope_theta")) l.rope_theta = r->as_number();
  std::optional<json::Node> rope = present(root, "rope_scaling");
  keys.rope = "rope_scaling";
  if (rope && rope->is_object() && rope->members().empty()) rope.reset();
  if (!rope) {
    rope = present(root, "rope_parameters");
    keys.rope = "rope_parameters";
  }
  if (rope) {
    if (auto t = rope->find("rope_theta")) {
      l.rope_theta = t->as_number();
      keys.rope_theta = keys.rope + ".rope_theta";
    }
    std::optional<json::Node> type = rope->find("rope_type");
    if (!type) type = rope->find("type");
    const std::string kind = type ? type->as_string() : "default";
    auto number = [&](const char* key) {
      auto v = rope->find(key);
      if (!v) rope->fail(std::string("rope type '") + kind + "' needs '" + key + "'");
      return v->as_number();
    };
    if (kind == "linear") {
      l.rope_scaling.type = llama::RopeScaling::Type::kLinear;
      l.rope_scaling.factor = number("factor");
    } else if (kind == "llama3") {
      l.rope_scaling.type = llama::RopeScaling::Type::kLlama3;
      l.rope_scaling.factor = number("factor");
      l.rope_scaling.low_freq_factor = number("low_freq_factor");
      l.rope_scaling.high_freq_factor = number("high_freq_factor");
      auto o = rope->find("original_max_position_embeddings");
      if (!o) rope->fail("rope type 'llama3' needs 'original_max_position_embeddings'");
      l.rope_scaling.original_max_position_embeddings = o->as_int();
    } else if (kind != "default") {
      (type ? *type : *rope)
          .fail("rope type '" + printable_escape(kind) +
                "' is not supported (supported: default, linear, llama3)");
    }
  }
  // Sliding-window attention (Mistral): implemented (LlamaConfig::sliding_window). Qwen2's
  // per-layer windows (use_sliding_window, max_window_layers) are not.
  if (auto u = present(root, "use_sliding_window"))
    if (u->as_bool())
      u->fail("use_sliding_window true is not supported (per-layer windows, max_window_layers)");
  if (l.architecture == Arch::kMistral)
    if (present(root, "sliding_window"))
      l.sliding_window = size_key(root, "sliding_window", int64_t{1} << 31);
  check_in_file_terms(l, keys, path);
  try {
    l.validate();  // the rules above, in flatshard's names: a backstop, never expected to fire
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, where, ": ", e.what_without_backtrace());
  }
  c.llama = l;
  return c;
}

HfConfig read_hf_config(const std::string& path) {
  return parse_hf_config(read_weights_text_file(path, kMaxConfigBytes), path);
}

namespace {

bool is_hf_buffer(const std::string& name) {
  return name == "inv_freq" || ends_with(name, ".inv_freq");
}
bool is_hf_head(const std::string& top_level) {
  return top_level == "lm_head" || top_level == "output" || top_level == "head" ||
         top_level == "score" || top_level == "classifier";
}
std::string hf_generic_type(const ModuleView& m) {
  std::string type = generic_module_type(m);  // "Linear": a 2-D weight
  if (type == "Linear" && m.path.find("embed") != std::string::npos) return "Embedding";
  return type;
}

}  // namespace

WeightsNaming hf_naming() { return {is_hf_buffer, is_hf_head, hf_generic_type}; }

WeightsNaming hf_naming(const HfConfig& c) {
  WeightsNaming n = hf_naming();
  n.module_type = hf_module_namer(c);
  return n;
}

ModuleTypeFn hf_module_namer(const HfConfig& c) {
  if (!c.known()) return hf_generic_type;
  const std::string p = c.type_prefix;
  const std::string root =
      ends_with(c.architecture, "ForCausalLM") ? c.architecture : p + "ForCausalLM";
  return [p, root](const ModuleView& m) -> std::string {
    if (m.path.empty()) return root;
    if (m.path == "model") return p + "Model";
    if (m.path == "model.layers") return "ModuleList";
    const std::string layers = "model.layers.";
    if (m.path.compare(0, layers.size(), layers) == 0 && is_number(m.path.substr(layers.size())))
      return p + "DecoderLayer";
    if (m.name == "self_attn") return p + "Attention";
    if (m.name == "mlp") return p + "MLP";
    if (ends_with(m.name, "_proj") || m.path == "lm_head") return "Linear";
    if (m.name == "embed_tokens") return "Embedding";
    if (ends_with(m.name, "norm")) return p + "RMSNorm";  // *_layernorm, norm
    if (m.name == "rotary_emb") return p + "RotaryEmbedding";
    return hf_generic_type(m);
  };
}

void check_hf_weights(const HfConfig& c, const WeightsInfo& w) {
  if (!c.known()) return;
  const llama::LlamaConfig& l = *c.llama;
  // Errors name the files and the tensors through printable_escape (names come from files).
  const std::string who =
      printable_escape(c.path) + " (" + printable_escape(c.architecture) + ")";
  const std::string weights = printable_escape(w.path);
  std::set<int64_t> layers;
  const std::string prefix = "model.layers.";
  for (const auto& t : w.tensors) {
    if (t.name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string rest = t.name.substr(prefix.size());
    const std::string index = rest.substr(0, rest.find('.'));
    TORCH_CHECK(is_number(index) && index.size() <= 9, who, ": tensor '", printable_escape(t.name),
                "' is under model.layers but not in a numbered layer");
    layers.insert(std::stoll(index));
  }
  TORCH_CHECK(!layers.empty(), who, ": no tensor of ", weights,
              " is under model.layers; the config does not describe these weights");
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == l.n_layers && *layers.begin() == 0 &&
                  *layers.rbegin() == l.n_layers - 1,
              who, ": num_hidden_layers is ", l.n_layers, " but ", weights, " holds ", layers.size(),
              " layers model.layers.", *layers.begin(), " .. ", *layers.rbegin(),
              w.format == WeightsFormat::kSafetensors
                  ? " (one shard of several? pass the directory or its index)"
                  : "");
  const int64_t d = l.d_model, hd = l.head_dim(), h = l.hidden_size();
  auto expect = [&](const std::string& name, std::vector<int64_t> shape, bool required) {
    const WeightTensor* t = w.find(name);
    TORCH_CHECK(t != nullptr || !required, who, ": ", weights, " has no tensor '", name, "'");
    if (t == nullptr) return;
    TORCH_CHECK(t->shape == shape, who, ": tensor '", name, "' in ", printable_escape(t->file), " has shape ",
                shape_string(t->shape), " but the config implies ", shape_string(shape));
  };
  expect("model.embed_tokens.weight", {l.vocab, d}, true);
  if (!l.tie_embeddings) {
    const bool tied_alias = [&] {
      for (const auto& a : w.aliases)
        if (a.first == "lm_head.weight") return true;
      return false;
    }();
    if (!tied_alias) expect("lm_head.weight", {l.vocab, d}, true);
  }
  const std::string l0 = "model.layers.0.";
  expect(l0 + "self_attn.q_proj.weight", {l.n_heads * hd, d}, false);
  expect(l0 + "self_attn.k_proj.weight", {l.kv_heads() * hd, d}, false);
  expect(l0 + "self_attn.v_proj.weight", {l.kv_heads() * hd, d}, false);
  expect(l0 + "self_attn.o_proj.weight", {d, l.n_heads * hd}, false);
  expect(l0 + "mlp.gate_proj.weight", {h, d}, false);
  expect(l0 + "mlp.up_proj.weight", {h, d}, false);
  expect(l0 + "mlp.down_proj.weight", {d, h}, false);
}

std::optional<std::string> tie_hf_embeddings(const HfConfig& c, WeightsInfo& w) {
  if (!c.tie_word_embeddings) return std::nullopt;
  const bool head = w.find("lm_head.weight") != nullptr;
  const bool embed = w.find("model.embed_tokens.weight") != nullptr;
  if (head)
    return std::string(
        "tie_word_embeddings is set but the files hold lm_head.weight: counted as "
        "its own tensor");
  if (!embed) return std::nullopt;
  add_alias(w, "lm_head.weight", "model.embed_tokens.weight");
  return std::string(
      "tied: lm_head.weight is model.embed_tokens.weight (config.json "
      "tie_word_embeddings; one tensor)");
}

TransformerShape hf_transformer_shape(const HfConfig& c) {
  TORCH_CHECK(c.known(), printable_escape(c.path), ": ", c.describe(),
              "; no shape for the cost model");
  TransformerShape s = ModelConfig::of(*c.llama).transformer_shape();
  s.layer_prefix = rename(s.layer_prefix, /*top=*/true);
  for (auto* list : {&s.input_modules, &s.head_modules}) {
    std::vector<std::string> renamed;
    for (const auto& m : *list)
      if (auto r = rename(m, /*top=*/true); !r.empty()) renamed.push_back(r);
    *list = std::move(renamed);
  }
  for (auto& [path, bytes] : s.recomputed_leaf_savings) path = rename(path, /*top=*/false);
  s.layer_type = c.type_prefix + "DecoderLayer";
  s.leaf_types = "Linear|" + c.type_prefix + "RMSNorm|Embedding";
  s.validate();
  return s;
}

std::string hf_config_json(const llama::LlamaConfig& l, at::ScalarType dtype,
                           const std::string& base) {
  using Arch = llama::LlamaConfig::Architecture;
  l.validate();
  const Known& k = known_of(l.architecture);
  const std::string who = std::string("hf_config_json: ") + k.architecture;
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, who, ": dtype ", dtype,
              " is not written (float32 or bfloat16)");
  TORCH_CHECK(l.sliding_window == 0 || l.architecture == Arch::kMistral, who,
              " has no sliding window (sliding_window = ", l.sliding_window,
              "); only MistralForCausalLM does");
  TORCH_CHECK(!l.attention_bias || l.architecture != Arch::kMistral, who,
              " has no q/k/v biases (attention_bias is set)");
  TORCH_CHECK(l.attention_bias || l.architecture != Arch::kQwen2, who,
              " always has q/k/v biases (attention_bias is false)");
  json::Json j = json::Json::object();
  if (!base.empty()) {
    const std::string text = read_weights_text_file(base, kMaxConfigBytes);
    const HfConfig b = parse_hf_config(text, base);
    TORCH_CHECK(b.known() && b.llama->architecture == l.architecture, who, ": the base config '",
                base, "' is ", b.describe(), ", not ", k.architecture);
    j = json::parse(text, base);
    for (const char* key : {"rope_scaling", "rope_theta", "torch_dtype", "layer_types"})
      j.erase(key);
    // The export's weights are plain fp32 / bf16 (the `dtype` written below), not the base
    // model's quantized storage: kept, transformers would try to load them as quantized (and
    // fails outright without the quantizer's package). Dropped like torch_dtype, but said,
    // since the export is then no longer a quantized model.
    if (j.erase("quantization_config") > 0)
      TORCH_WARN(who, ": the base config '", printable_escape(base),
                 "' has quantization_config; it is not written (the export's weights are ",
                 dtype == at::kFloat ? "float32" : "bfloat16",
                 ", unquantized; quantize the export again if you need it)");
  }
  j["architectures"] = json::Json::array({k.architecture});
  j["model_type"] = k.model_type;
  j["vocab_size"] = l.vocab;
  j["hidden_size"] = l.d_model;
  j["intermediate_size"] = l.hidden_size();
  j["num_hidden_layers"] = l.n_layers;
  j["num_attention_heads"] = l.n_heads;
  j["num_key_value_heads"] = l.kv_heads();
  j["head_dim"] = l.head_dim();
  j["max_position_embeddings"] = l.seq_len;
  j["rms_norm_eps"] = l.norm_eps;
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = l.tie_embeddings;
  json::Json rope = json::Json::object();
  rope["rope_theta"] = l.rope_theta;
  switch (l.rope_scaling.type) {
    case llama::RopeScaling::Type::kNone:
      rope["rope_type"] = "default";
      break;
    case llama::RopeScaling::Type::kLinear:
      rope["rope_type"] = "linear";
      rope["factor"] = l.rope_scaling.factor;
      break;
    case llama::RopeScaling::Type::kLlama3:
      rope["rope_type"] = "llama3";
      rope["factor"] = l.rope_scaling.factor;
      rope["low_freq_factor"] = l.rope_scaling.low_freq_factor;
      rope["high_freq_factor"] = l.rope_scaling.high_freq_factor;
      rope["original_max_position_embeddings"] = l.rope_scaling.original_max_position_embeddings;
      break;
  }
  j["rope_parameters"] = rope;
  switch (l.architecture) {
    case Arch::kLlama:
      j["attention_bias"] = l.attention_bias;
      j["mlp_bias"] = false;
      break;
    case Arch::kMistral:
      j["sliding_window"] =
          l.sliding_window > 0 ? json::Json(l.sliding_window) : json::Json(nullptr);
      break;
    case Arch::kQwen2:
      j["use_sliding_window"] = false;
      break;
  }
  j["dtype"] = dtype == at::kFloat ? "float32" : "bfloat16";
  return j.dump(2) + "\n";
}

}  // namespace models
}  // namespace flatshard
