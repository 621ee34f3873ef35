// flatshard/models/hf_config.h — what a Hugging Face config.json says about a model, in
// flatshard's terms: the architecture, the module type names of its tree, and (for the
// architectures flatshard knows) a models/ config and the planner's shape. Used by
// flatshard-explain --weights (a checkpoint explained from its headers, planner/weights_tree.h).
//
//   WeightsInfo w = read_weights(dir, hf_naming());                 // HF buffers and order
//   HfConfig c = read_hf_config(w.config_path());
//   auto model = module_tree_from_weights(w, hf_naming(c));          // "LlamaDecoderLayer", ...
//   if (c.known()) shape = hf_transformer_shape(c);                 // cost model, advisor
//
// Contract
//   * parse_hf_config / read_hf_config: strict JSON (support/json.h: duplicate keys, depth,
//     exact integers), at most kMaxConfigBytes, a symbolic link followed only within a hub
//     snapshot (Note [Hub snapshots], checkpoint/file_io.h). Keys flatshard does not use are
//     ignored (configs carry dozens). `architectures` (its first
//     entry) and `model_type` say which architecture it is; `tie_word_embeddings` is read for
//     any architecture (default false, as transformers).
//   * Known architectures — LLaMA-style decoders (pre-RMSNorm, RoPE, SwiGLU, grouped-query
//     attention): LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (or, without
//     `architectures`, model_type llama / mistral / qwen2). For these `llama` is set:
//       vocab_size -> vocab, hidden_size -> d_model, num_attention_heads -> n_heads,
//       num_key_value_heads -> n_kv_heads (default n_heads), num_hidden_layers -> n_layers,
//       intermediate_size -> hidden, max_position_embeddings -> seq_len (default 2048),
//       rms_norm_eps -> norm_eps (default 1e-6), tie_word_embeddings -> tie_embeddings,
//       head_dim -> head_size (when it is not hidden_size / num_attention_heads),
//       attention_bias (read for Llama only, as transformers 5: Qwen2 always has q/k/v biases,
//       Mistral never, whatever the key says), RoPE: rope_parameters (transformers 5) or
//       rope_theta + rope_scaling (earlier; a non-empty rope_scaling wins over rope_parameters,
//       transformers' `rope_scaling or rope_parameters`) with rope_type / type default,
//       linear (factor) or llama3 (factor, low_freq_factor, high_freq_factor,
//       original_max_position_embeddings) -> rope_theta, rope_scaling; Mistral's sliding_window
//       -> sliding_window (null: none).
//     Refused, naming the key and value: another rope type (yarn, dynamic, longrope, ...),
//     hidden_act other than silu, Llama's mlp_bias true (Qwen2's and Mistral's MLPs have no
//     biases in transformers whatever the key says: ignored there), Qwen2's use_sliding_window
//     true. The five sizes are required; each is bounded (hidden_size <= 2^20,
//     intermediate_size <= 2^22, heads <= 2^16, layers <= 2^16, vocab and positions <= 2^31:
//     every closed form stays inside int64) and the result passes LlamaConfig::validate()'s
//     rules, checked in the file's own keys: "num_attention_heads (6) must divide hidden_size
//     (256) in <path>" (num_key_value_heads divides num_attention_heads, the head size even,
//     rope_theta > 1, rms_norm_eps > 0, <rope key>.factor > 0, llama3's low_freq_factor <
//     high_freq_factor and original_max_position_embeddings > 0). Errors are one line naming
//     the file and the key.
//   * Any other architecture (or none): `llama` is unset, `unknown_reason` says why, and type
//     names fall back to hf_naming()'s guesses.
//   * hf_naming(): the Hugging Face checkpoint conventions that need no config, as a
//     planner/weights_tree.h WeightsNaming (the planner itself knows no module names):
//     is_buffer: "inv_freq" and "*.inv_freq" (rotary tables older checkpoints saved);
//     runs_last: the top-level output heads "lm_head", "output", "head", "score",
//     "classifier" (so the order is embeddings, layers, norm, head: the forward's);
//     module_type: generic_module_type, except that a module it calls "Linear" whose path
//     contains "embed" is "Embedding". hf_naming(c): the same with module_type
//     hf_module_namer(c). read_weights takes hf_naming() (the config is found beside the
//     weights only after reading them), module_tree_from_weights hf_naming(c).
//   * hf_module_namer(c): Module::name() for each module of a Hugging Face tree of a known
//     architecture with prefix P ("Llama", "Mistral", "Qwen2"): the root P+"ForCausalLM",
//     "model" P+"Model", "model.layers" "ModuleList", "model.layers.<i>" P+"DecoderLayer",
//     "self_attn" P+"Attention", "mlp" P+"MLP", "*_proj" and "lm_head" "Linear", "embed_tokens"
//     "Embedding", "*norm" / "*layernorm" P+"RMSNorm", "rotary_emb" P+"RotaryEmbedding"; any
//     other module hf_naming()'s module_type. Unknown architecture: hf_naming()'s module_type.
//   * hf_module_alias(l, path): the Hugging Face path and type of flatshard's LLaMA module at
//     `path`, what flatshard-explain --weights calls it (LlamaImpl's ModuleAliases, Note [Module
//     aliases] in wrap_policies/match.h): "" -> "" / P+"ForCausalLM", layers -> model.layers /
//     ModuleList, layers.3 -> model.layers.3 / P+"DecoderLayer", layers.3.attn.q ->
//     model.layers.3.self_attn.q_proj / Linear, layers.3.input_norm ->
//     model.layers.3.input_layernorm / P+"RMSNorm", embed_tokens -> model.embed_tokens /
//     Embedding, norm -> model.norm, lm_head -> lm_head (P: the config's architecture's prefix;
//     the paths from the tables hf_transformer_shape renames with, the types from
//     hf_module_namer). {} (no alias) for rope, which transformers keeps out of checkpoints.
//   * check_hf_weights(c, w): for a known architecture, the config must describe these
//     tensors: the layer list model.layers has num_hidden_layers layers, and the shapes of
//     model.embed_tokens.weight [vocab, d], and where present layer 0's q/k/v/o and
//     gate/up/down projections, agree with the config. One-line errors name the config, the
//     tensor and both shapes.
//   * tie_hf_embeddings(c, w): tie_word_embeddings set, no lm_head.weight and a
//     model.embed_tokens.weight: registers lm_head.weight as its alias (one tensor, as the model
//     ties them) and returns a one-line note; else nullopt.
//   * hf_transformer_shape(c): for a known architecture, the family's shape
//     (ModelConfig::of(*c.llama).transformer_shape(), models/llama.h) with the paths renamed to
//     the Hugging Face tree (layers -> model.layers, embed_tokens -> model.embed_tokens, norm ->
//     model.norm, lm_head; inside a layer input_norm -> input_layernorm, post_attn_norm ->
//     post_attention_layernorm, attn -> self_attn, ...) and the type names above. Throws for an
//     unknown architecture (unknown_reason) or a family path it cannot rename.
//   * hf_config_json(l, dtype, base): the config.json transformers reads back as `l` (the
//     inverse of parse_hf_config: parse_hf_config(hf_config_json(l)) gives `l` again, hidden
//     and head size written out): architectures and model_type from l.architecture, the sizes,
//     head_dim, rms_norm_eps, tie_word_embeddings, hidden_act silu, rope_parameters
//     (transformers 5's form: rope_type default / linear / llama3 with its factors,
//     rope_theta), dtype ("float32" or "bfloat16"); Llama: attention_bias and mlp_bias false;
//     Mistral: sliding_window (null for none); Qwen2: use_sliding_window false. What the
//     architecture cannot express is an error naming it: a sliding window outside Mistral,
//     q/k/v biases on Mistral, none on Qwen2. `base` (a path, or ""): the config.json the
//     model came from, whose other keys (token ids, generation settings, ...) are kept; it must
//     be of the same architecture, and its rope_scaling, rope_theta, torch_dtype and
//     layer_types are dropped (written anew, or derived by transformers). Its
//     quantization_config is dropped with a warning (TORCH_WARN naming it and the base): the
//     export's weights are plain float32 / bfloat16, which transformers would otherwise try to
//     load as quantized (and fails without the quantizer's package). Dropped rather than
//     refused because the export is what the key would misdescribe, as torch_dtype.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>

#include "models/llama.h"
#include "planner/model_shape.h"
#include "planner/weights_tree.h"
#include "wrap_policies/match.h"

namespace flatshard {
namespace models {

inline constexpr int64_t kMaxConfigBytes = int64_t{16} << 20;

struct HfConfig {
  std::string path;          // where it was read from (error messages)
  std::string architecture;  // architectures[0]; "" when absent
  std::string model_type;    // "" when absent
  bool tie_word_embeddings = false;

  // Known architectures only (see the contract): the type-name prefix and the config.
  std::string type_prefix;  // "Llama", "Mistral", "Qwen2"; "" when unknown
  std::optional<llama::LlamaConfig> llama;
  std::string unknown_reason;  // why `llama` is unset, one phrase; "" when known

  bool known() const { return llama.has_value(); }
  // One line: "LlamaForCausalLM (model_type llama): vocab=... d_model=..." or
  // "MyForCausalLM: architecture not known to flatshard (...)".
  std::string describe() const;
};

HfConfig parse_hf_config(const std::string& text, const std::string& path);
HfConfig read_hf_config(const std::string& path);

WeightsNaming hf_naming();
WeightsNaming hf_naming(const HfConfig& c);
ModuleTypeFn hf_module_namer(const HfConfig& c);
void check_hf_weights(const HfConfig& c, const WeightsInfo& w);
std::optional<std::string> tie_hf_embeddings(const HfConfig& c, WeightsInfo& w);
TransformerShape hf_transformer_shape(const HfConfig& c);
ModuleAliases::Alias hf_module_alias(const llama::LlamaConfig& l, const std::string& path);
std::string hf_config_json(const llama::LlamaConfig& l, at::ScalarType dtype,
                           const std::string& base = "");

}  // namespace models
}  // namespace flatshard
