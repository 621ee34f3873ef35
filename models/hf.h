// flatshard/models/hf.h — a Hugging Face model directory as flatshard's LLaMA-family model:
// its config and a loader that reads its weights into the shards.
//
//   ModelConfig cfg = models::hf_config(dir);            // config.json (models/hf_config.h)
//   std::shared_ptr<torch::nn::Module> model;
//   { MetaInit meta; model = cfg.build(0); }             // shapes only
//   ShardingOptions o; o.load = models::hf_loader(dir, cfg);   // each rank reads its shard
//   auto fsdp = fully_shard(model, parse_policy("type=DecoderLayer"), comm, o);
//
// Contract
//   * hf_config(dir): dir/config.json of a LlamaForCausalLM, MistralForCausalLM or
//     Qwen2ForCausalLM (models/hf_config.h: every field it reads, what it refuses) as a
//     ModelConfig of the llama family: head_dim, q/k/v biases (Qwen2's implied), RoPE theta and
//     scaling (linear, llama3), Mistral's sliding window, tied embeddings. Another
//     architecture, or a value flatshard cannot express, is a c10::Error naming the file, the
//     field and the value.
//   * hf_parameter_name(name): flatshard's LLaMA parameter name (models/llama.h's module
//     paths) -> transformers' (embed_tokens.weight -> model.embed_tokens.weight,
//     layers.<i>.attn.q.weight -> model.layers.<i>.self_attn.q_proj.weight,
//     layers.<i>.input_norm.weight -> model.layers.<i>.input_layernorm.weight, norm.weight ->
//     model.norm.weight, lm_head.weight); c10::Error for a name it does not know.
//   * hf_loader(dir, cfg): ShardingOptions::load for the directory's model.safetensors or
//     model.safetensors.index.json (checkpoint/load_into_shards.h's safetensors_loader: every
//     planned parameter checked before any read, each rank reads only its shard's bytes) with
//     hf_parameter_name as the name map. Tied embeddings are one parameter, embed_tokens.weight,
//     read from model.embed_tokens.weight.
#pragma once

#include <string>

#include "fsdp/options.h"
#include "models/family.h"

namespace flatshard {
namespace models {

ModelConfig hf_config(const std::string& dir);
std::string hf_parameter_name(const std::string& name);
ParamLoader hf_loader(const std::string& dir, const ModelConfig& cfg);

}  // namespace models
}  // namespace flatshard
