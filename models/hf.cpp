// flatshard/models/hf.cpp — see hf.h for the contract.
#include "models/hf.h"

#include <c10/util/Exception.h>

#include <map>

#include "checkpoint/load_into_shards.h"
#include "models/hf_config.h"
#include "models/llama.h"

namespace flatshard {
namespace models {

ModelConfig hf_config(const std::string& dir) {
  const std::string path = dir + "/config.json";
  const HfConfig c = read_hf_config(path);
  TORCH_CHECK(c.known(), path, ": ", c.describe());
  return ModelConfig::of(*c.llama);
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
  return safetensors_loader(dir, hf_parameter_name);
}

}  // namespace models
}  // namespace flatshard
