// flatshard/models/family.h — the reference model families by name, for the programs that let
// the user pick one (flatshard-bench, flatshard-explain: --model gpt|llama).
//
// Contract
//   * Family names: "gpt" (models/gpt.h) and "llama" (models/llama.h); parse_family() throws
//     c10::Error naming both for anything else.
//   * FamilyModules: the module type names a family's tree uses, so a program builds its
//     default wrap policies from the model it runs instead of assuming the GPT's names:
//       layer_type   one transformer layer ("Block" / "DecoderLayer")
//       leaf_types   every module that owns parameters directly, as a spec alternation
//                    ("Linear|LayerNorm|Embedding" / "Linear|RMSNorm|Embedding")
//       type_names   every type of the tree, for error messages
//   * ModelConfig: one family's config, by value. preset() takes the family's presets (see
//     GPTConfig::preset, LlamaConfig::preset); the shared sizes (vocab, d_model, n_heads,
//     n_layers, seq_len) read and write the selected family's fields; num_parameters() and
//     flops_per_token() are the family's closed forms. build() constructs the model on CPU in
//     fp32, deterministically from the seed (under flatshard::MetaInit: shapes only).
//     loss() calls the model's own loss() (fp32); the model must come from build() of a config
//     of the same family (else c10::Error).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/cost_model.h"
#include "models/gpt.h"
#include "models/llama.h"

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {
namespace models {

enum class Family { kGpt, kLlama };

Family parse_family(const std::string& name);
const char* family_name(Family f);     // "gpt", "llama"
const char* display_name(Family f);    // "GPT", "LLaMA"
std::vector<std::string> preset_names(Family f);

struct FamilyModules {
  std::string layer_type;
  std::string leaf_types;
  std::string type_names;
};
const FamilyModules& family_modules(Family f);

struct ModelConfig {
  Family family = Family::kGpt;
  gpt::GPTConfig gpt;
  llama::LlamaConfig llama;

  static ModelConfig preset(Family family, const std::string& name);
  void validate() const;

  int64_t& vocab();
  int64_t& d_model();
  int64_t& n_heads();
  int64_t& n_layers();
  int64_t& seq_len();
  int64_t vocab() const;
  int64_t d_model() const;
  int64_t n_heads() const;
  int64_t n_layers() const;
  int64_t seq_len() const;
  bool& tie_embeddings();

  std::string to_string() const;  // the family config's to_string()
  int64_t num_parameters() const;
  // num_parameters() in long double, at least the exact count, for any sizes (no int64
  // overflow): what tools check hostile sizes against before building anything. GPT: the exact
  // closed form; LLaMA: kv heads as many as heads, MLP hidden size 8d/3 + 256.
  long double num_parameters_bound() const;
  double flops_per_token() const;

  std::shared_ptr<torch::nn::Module> build(uint64_t seed) const;
  std::pair<at::Tensor, at::Tensor> synthetic_batch(int64_t batch, int64_t seed, int rank,
                                                    int64_t step) const;
  at::Tensor loss(torch::nn::Module& model, const at::Tensor& idx,
                  const at::Tensor& targets) const;
  // The shape the cost model and the plan advisor read (fsdp/cost_model.h): sizes, the layer
  // list's module path ("blocks" / "layers") and the family's spec type names.
  TransformerShape transformer_shape() const;
};

}  // namespace models
}  // namespace flatshard
