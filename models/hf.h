// flatshard/models/hf.h — a Hugging Face model directory as flatshard's LLaMA-family model:
// its config and a loader that reads its weights into the shards.
//
//   ModelConfig cfg = models::hf_config(dir);            // config.json (models/hf_config.h)
//   std::shared_ptr<torch::nn::Module> model;
//   { MetaInit meta; model = cfg.build(0); }             // shapes only
//   ShardingOptions o; o.load = models::hf_loader(dir, cfg);   // each rank reads its shard
//   auto fsdp = fully_shard(model, parse_policy("type=DecoderLayer"), comm, o);
//   ... train ...
//   models::save_hf(*fsdp, "out/fine-tuned");           // transformers' from_pretrained reads it
//
// Contract
//   * hf_config(dir): dir/config.json of a LlamaForCausalLM, MistralForCausalLM or
//     Qwen2ForCausalLM (models/hf_config.h: every field it reads, what it refuses) as a
//     ModelConfig of the llama family: head_dim, q/k/v biases (Qwen2's implied), RoPE theta and
//     scaling (linear, llama3), Mistral's sliding window, tied embeddings. Another
//     architecture, or a value flatshard cannot express, is a c10::Error naming the file, the
//     field and the value. Note [Tied head in the files]: tie_word_embeddings with an
//     lm_head.weight in the weights that differs from model.embed_tokens.weight (in fp32) gives
//     an untied config and a warning, as transformers 5's from_pretrained unties them; so with
//     tie_word_embeddings set and both tensors present, hf_config reads both (a bounded piece
//     at a time, checkpoint/load_into_shards.h's safetensors_tensors_equal).
//   * hf_parameter_name(name): flatshard's LLaMA parameter name (models/llama.h's module
//     paths) -> transformers' (embed_tokens.weight -> model.embed_tokens.weight,
//     layers.<i>.attn.q.weight -> model.layers.<i>.self_attn.q_proj.weight,
//     layers.<i>.input_norm.weight -> model.layers.<i>.input_layernorm.weight, norm.weight ->
//     model.norm.weight, lm_head.weight); c10::Error for a name it does not know.
//   * hf_loader(dir, cfg): ShardingOptions::load for the directory's model.safetensors or
//     model.safetensors.index.json (checkpoint/load_into_shards.h's safetensors_loader: every
//     planned parameter checked before any read, each rank reads only its shard's bytes) with
//     hf_parameter_name as the name map. Tied embeddings are one parameter, embed_tokens.weight,
//     read from model.embed_tokens.weight. Both model.safetensors and the index present:
//     model.safetensors, as transformers (Note [Weights file of a directory],
//     checkpoint/file_io.h). Tensors no parameter reads are reported (one warning naming them),
//     except the rotary "*.inv_freq" tables and, when tied, lm_head.weight (transformers leaves
//     those without a word). A directory of the hub cache
//     (models--ORG--NAME/snapshots/REV/, files linked into ../../blobs/) is read in place
//     (Note [Hub snapshots], checkpoint/file_io.h); any other symbolic link is refused.
//   * save_hf(model, dir, options): collective (every rank), between steps. The sharded model
//     must be flatshard's LLaMA (models/llama.h; else an error naming its root's type). Writes
//     `dir` as transformers' save_pretrained would: config.json (hf_config_json,
//     models/hf_config.h: the architecture the config records, a value it cannot express is an
//     error before anything is written) and model.safetensors, or model-0000i-of-0000N files
//     and model.safetensors.index.json above options.max_file_bytes, with Hugging Face names
//     (hf_parameter_name) in options.dtype (fp32 or bf16) — tied embeddings once, as
//     model.embed_tokens.weight. checkpoint/export.h does the writing: unit by unit (rank 0
//     never holds the whole model), atomic publication, nothing replaced but an earlier export
//     and nothing left behind by a failed save. options.base_config: the config.json the model
//     was loaded from, whose other keys (token ids, ...) are kept.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

#include "fsdp/options.h"
#include "models/family.h"

namespace flatshard {
class ShardedModel;
}

namespace flatshard {
namespace models {

ModelConfig hf_config(const std::string& dir);
std::string hf_parameter_name(const std::string& name);
ParamLoader hf_loader(const std::string& dir, const ModelConfig& cfg);

struct HfSaveOptions {
  at::ScalarType dtype = at::kFloat;                         // kFloat or kBFloat16
  int64_t max_file_bytes = int64_t{5} * 1000 * 1000 * 1000;  // per safetensors file
  std::string base_config;  // a config.json whose other keys are kept; "": none
  bool durable = true;      // fsync before each rename
};
void save_hf(const ShardedModel& model, const std::string& dir, const HfSaveOptions& options = {});

}  // namespace models
}  // namespace flatshard
