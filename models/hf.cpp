// flatshard/models/hf.cpp — see hf.h for the contract.
#include "models/hf.h"

#include <c10/util/Exception.h>

#include <map>
#include <optional>

#include "checkpoint/export.h"
#include "checkpoint/file_io.h"
#include "checkpoint/load_into_shards.h"
#include "collectives/agree.h"
#include "fsdp/sharded_model.h"
#include "models/hf_config.h"
#include "models/llama.h"
#include "support/input_file.h"

namespace flatshard {
namespace models {

ModelConfig hf_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  const HfConfig c = read_hf_config(path);
  TORCH_CHECK(c.known(), printable_escape(path), ": ", c.describe());
  llama::LlamaConfig l = *c.llama;
  // Note [Tied head in the files]: transformers 5 (modeling_utils.py, tie_weights during
  // from_pretrained) ties lm_head to embed_tokens only if the files hold no lm_head.weight or
  // one equal to model.embed_tokens.weight (torch.equal); with other values it keeps both,
  // untied, and warns. So does flatshard: the values decide, not the key alone.
  if (l.tie_embeddings && !pick_weights_in_dir(dir).path.empty()) {
    const std::optional<bool> equal =
        safetensors_tensors_equal(dir, "model.embed_tokens.weight", "lm_head.weight");
    if (equal.has_value() && !*equal) {
      l.tie_embeddings = false;
      TORCH_WARN("hf_config: ", printable_escape(path),
                 " has tie_word_embeddings true, but the weights hold an lm_head.weight that "
                 "differs from model.embed_tokens.weight: both are loaded, untied, as "
                 "transformers loads them (set tie_word_embeddings false to silence this)");
    }
  }
  return ModelConfig::of(l);
}

std::string hf_parameter_name(const std::string& name) {
  static const std::map<std::string, std::string> top = {
      {"embed_tokens.weight", "model.embed_tokens.weight"},
      {"norm.weight", "model.norm.weight"},
      {"lm_head.weight", "lm_head.weight"},
  };
  static const std::map<std::string, std::string> inner = {
      {"input_norm.weight", "input_layernorm.weight"},
      {"post_attn_norm.weight", "post_attention_layernorm.weight"},
      {"attn.q.weight", "self_attn.q_proj.weight"},
      {"attn.k.weight", "self_attn.k_proj.weight"},
      {"attn.v.weight", "self_attn.v_proj.weight"},
      {"attn.o.weight", "self_attn.o_proj.weight"},
      {"attn.q.bias", "self_attn.q_proj.bias"},
      {"attn.k.bias", "self_attn.k_proj.bias"},
      {"attn.v.bias", "self_attn.v_proj.bias"},
      {"mlp.gate.weight", "mlp.gate_proj.weight"},
      {"mlp.up.weight", "mlp.up_proj.weight"},
      {"mlp.down.weight", "mlp.down_proj.weight"},
  };
  if (auto it = top.find(name); it != top.end()) return it->second;
  const std::string prefix = "layers.";
  if (name.compare(0, prefix.size(), prefix) == 0) {
    const size_t dot = name.find('.', prefix.size());
    const std::string index = name.substr(prefix.size(), dot - prefix.size());
    if (dot != std::string::npos && !index.empty() &&
        index.find_first_not_of("0123456789") == std::string::npos)
      if (auto it = inner.find(name.substr(dot + 1)); it != inner.end())
        return "model.layers." + index + "." + it->second;
  }
  TORCH_CHECK(false, "hf_parameter_name: '", name,
              "' is not a parameter of flatshard's LLaMA that a Hugging Face checkpoint names");
}

ParamLoader hf_loader(const std::string& dir, const ModelConfig& cfg) {
  TORCH_CHECK(cfg.family().name() == std::string("llama"), "hf_loader: ", dir,
              ": the config is of the '", cfg.family().name(),
              "' family; Hugging Face directories load into the llama family (hf_config)");
  // Unread without a word, as transformers leaves them: the rotary tables older checkpoints
  // saved, and a tied model's lm_head.weight (hf_config ties only when it equals the
  // embedding, Note [Tied head in the files]).
  const bool tied = cfg.as<llama::LlamaConfig>().tie_embeddings;
  const auto is_buffer = hf_naming().is_buffer;
  return safetensors_loader(dir, hf_parameter_name, nullptr,
                            [tied, is_buffer](const std::string& tensor) {
                              return is_buffer(tensor) || (tied && tensor == "lm_head.weight");
                            });
}

void save_hf(const ShardedModel& model, const std::string& dir, const HfSaveOptions& options) {
  const auto* llama = dynamic_cast<const llama::LlamaImpl*>(&model.module());
  TORCH_CHECK(llama != nullptr, "save_hf('", dir, "'): the sharded model is a '",
              model.module().name(),
              "', not flatshard's LLaMA (models/llama.h); for another model write safetensors "
              "with export_safetensors (checkpoint/export.h) and a name map");
  ExportOptions o;
  o.name_map = hf_parameter_name;
  o.dtype = options.dtype;
  o.max_file_bytes = options.max_file_bytes;
  o.durable = options.durable;
  // The config (a base file read on each rank) may fail on some ranks only: agree before the
  // export's collectives.
  run_agreed(model.mesh(), "save_hf('" + dir + "')", [&] {
    o.text_files = {{"config.json",
                     hf_config_json(llama->config(), options.dtype, options.base_config)}};
  });
  export_safetensors(model, dir, o);
}

}  // namespace models
}  // namespace flatshard
