// flatshard/models/family.cpp — see family.h for the contract.
#include "models/family.h"

#include <c10/util/Exception.h>

namespace flatshard {
namespace models {

Family parse_family(const std::string& name) {
  if (name == "gpt") return Family::kGpt;
  if (name == "llama") return Family::kLlama;
  TORCH_CHECK(false, "unknown model family '", name, "'; known: gpt, llama");
}

const char* family_name(Family f) { return f == Family::kLlama ? "llama" : "gpt"; }
const char* display_name(Family f) { return f == Family::kLlama ? "LLaMA" : "GPT"; }

std::vector<std::string> preset_names(Family f) {
  if (f == Family::kLlama) return {"tiny", "small", "1b", "7b"};
  return {"tiny", "small", "1b"};
}

const FamilyModules& family_modules(Family f) {
  static const FamilyModules kGpt{"Block", "Linear|LayerNorm|Embedding",
                                  "GPT, Block, CausalSelfAttention, MLP, Linear, LayerNorm, "
                                  "Embedding"};
  static const FamilyModules kLlama{"DecoderLayer", "Linear|RMSNorm|Embedding",
                                    "Llama, DecoderLayer, Attention, MLP, RMSNorm, "
                                    "RotaryEmbedding, Linear, Embedding"};
  return f == Family::kLlama ? kLlama : kGpt;
}

ModelConfig ModelConfig::preset(Family family, const std::string& name) {
  ModelConfig c;
  c.family = family;
  if (family == Family::kLlama) {
    c.llama = llama::LlamaConfig::preset(name);
  } else {
    c.gpt = gpt::GPTConfig::preset(name);
  }
  return c;
}

void ModelConfig::validate() const {
  if (family == Family::kLlama) {
    llama.validate();
  } else {
    gpt.validate();
  }
}

#define FLATSHARD_FIELD(name)                                                      \
  int64_t& ModelConfig::name() { return family == Family::kLlama ? llama.name : gpt.name; } \
  int64_t ModelConfig::name() const { return family == Family::kLlama ? llama.name : gpt.name; }
FLATSHARD_FIELD(vocab)
FLATSHARD_FIELD(d_model)
FLATSHARD_FIELD(n_heads)
FLATSHARD_FIELD(n_layers)
FLATSHARD_FIELD(seq_len)
#undef FLATSHARD_FIELD

bool& ModelConfig::tie_embeddings() {
  return family == Family::kLlama ? llama.tie_embeddings : gpt.tie_embeddings;
}

std::string ModelConfig::to_string() const {
  return family == Family::kLlama ? llama.to_string() : gpt.to_string();
}

int64_t ModelConfig::num_parameters() const {
  return family == Family::kLlama ? llama::num_parameters(llama) : gpt::num_parameters(gpt);
}

long double ModelConfig::num_parameters_bound() const {
  const long double d = d_model(), V = vocab(), L = n_layers(), T = seq_len();
  const bool tied = family == Family::kLlama ? llama.tie_embeddings : gpt.tie_embeddings;
  const long double embeddings = V * d * (tied ? 1 : 2);
  if (family == Family::kGpt) return embeddings + T * d + L * (12 * d * d + 13 * d) + 2 * d;
  const long double h = 8 * d / 3 + 256;
  return embeddings + L * (2 * d + 4 * d * d + 3 * d * h) + d;
}

double ModelConfig::flops_per_token() const {
  return family == Family::kLlama ? llama::flops_per_token(llama) : gpt::flops_per_token(gpt);
}

std::shared_ptr<torch::nn::Module> ModelConfig::build(uint64_t seed) const {
  if (family == Family::kLlama) return llama::Llama(llama, seed).ptr();
  return gpt::GPT(gpt, seed).ptr();
}

std::pair<at::Tensor, at::Tensor> ModelConfig::synthetic_batch(int64_t batch, int64_t seed,
                                                               int rank, int64_t step) const {
  if (family == Family::kLlama) return llama::synthetic_batch(llama, batch, seed, rank, step);
  return gpt::synthetic_batch(gpt, batch, seed, rank, step);
}

at::Tensor ModelConfig::loss(torch::nn::Module& model, const at::Tensor& idx,
                             const at::Tensor& targets) const {
  if (family == Family::kLlama) {
    auto* m = dynamic_cast<llama::LlamaImpl*>(&model);
    TORCH_CHECK(m != nullptr, "ModelConfig::loss: the model is a ", model.name(),
                ", not a Llama");
    return m->loss(idx, targets);
  }
  auto* m = dynamic_cast<gpt::GPTImpl*>(&model);
  TORCH_CHECK(m != nullptr, "ModelConfig::loss: the model is a ", model.name(), ", not a GPT");
  return m->loss(idx, targets);
}

TransformerShape ModelConfig::transformer_shape() const {
  TransformerShape s;
  const FamilyModules& m = family_modules(family);
  s.layer_type = m.layer_type;
  s.leaf_types = m.leaf_types;
  if (family == Family::kGpt) {
    s.kind = TransformerShape::Kind::kGpt;
    s.vocab = gpt.vocab;
    s.d_model = gpt.d_model;
    s.n_heads = s.n_kv_heads = gpt.n_heads;
    s.mlp_hidden = 4 * gpt.d_model;
    s.n_layers = gpt.n_layers;
    s.layer_prefix = "blocks";
  } else {
    s.kind = TransformerShape::Kind::kLlama;
    s.vocab = llama.vocab;
    s.d_model = llama.d_model;
    s.n_heads = llama.n_heads;
    s.n_kv_heads = llama.kv_heads();
    s.mlp_hidden = llama.hidden_size();
    s.n_layers = llama.n_layers;
    s.layer_prefix = "layers";
    s.rms_norm_paths = {"input_norm", "post_attn_norm"};  // models/llama.cpp, DecoderLayerImpl
  }
  return s;
}

}  // namespace models
}  // namespace flatshard
