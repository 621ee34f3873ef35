// flatshard/models/family.h — the model families by name: one descriptor per family, the
// registry the programs list and parse them from (flatshard-bench, flatshard-explain: --model),
// and ModelConfig, one family's config by value.
//
// Contract
//   * families(): every registered family, in registry order ("gpt", "llama"); family(name)
//     finds one or throws c10::Error naming the known ones; family_names(): their names;
//     all_preset_names() and families_help() what a command line offers.
//   * Family: what a program needs to run or plan a family without knowing it —
//       name / display_name    "gpt" / "GPT"
//       preset_names()         "tiny", "small", "1b", ... (each a config that validates)
//       modules()              the module type names its tree uses (FamilyModules below), so a
//                              program builds its default wrap policies from the model it runs
//       preset(name)           a config (c10::Error naming the presets for another name);
//                              default_config(): the config type's defaults; accepts(c): c is
//                              of this family's config type
//       validate / to_string   of a config of this family (another family's: c10::Error)
//       num_parameters         the exact count; num_parameters_bound: at least that count, in
//                              long double, for any sizes (no int64 overflow) — what tools check
//                              hostile sizes against before building anything
//       flops_per_token        training FLOPs per token (the PaLM convention, models/gpt.h)
//       build(cfg, seed)       the model on CPU in fp32, deterministic per (seed, tensor name);
//                              under flatshard::MetaInit: shapes only
//       loss(model, idx, tgt)  the model's own fp32 next-token loss; `model` must come from
//                              build() of this family (else c10::Error)
//       logits(model, idx)     its forward: [B, T] token ids -> [B, T, vocab] logits, the
//                              same typed access (no cast to the family's module type); under
//                              fully_shard call it through flatshard::enter like loss
//       shape(cfg)             the planner's description (planner/model_shape.h)
//     FamilyOf<Config, Model> implements it from the config's and the model's own members and
//     the family's free functions, so a family is one file pair (docs/design.md "How to add a
//     model family").
//   * FamilyModules:
//       layer_type   one transformer layer ("Block" / "DecoderLayer")
//       leaf_types   every module that owns parameters directly, as a spec alternation
//                    ("Linear|LayerNorm|Embedding" / "Linear|RMSNorm|Embedding")
//       type_names   every type of the tree, for error messages
//       tp_plan      the family's default tensor-parallel plan (wrap_policies/tp_plan.h:
//                    Megatron's split of attention and MLP), for parallelize()
//   * ModelConfig: a family and a config of it, by value (copies are deep). The shared sizes
//     (vocab, d_model, n_heads, n_layers, seq_len, tie_embeddings) read and write the config's
//     fields; as<C>() is the family's own config type (c10::Error for another type).
//     synthetic_batch() is the shared synthetic language (models/synthetic_language.h) at the
//     config's vocab and seq_len. Default-constructed: the first family's default config.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "models/transformer.h"
#include "planner/model_shape.h"

namespace flatshard {
namespace models {

struct FamilyModules {
  std::string layer_type;
  std::string leaf_types;
  std::string type_names;
  std::string tp_plan;  // the default TP plan (wrap_policies/tp_plan.h text form)
};

class Family {
 public:
  virtual ~Family() = default;
  virtual const char* name() const = 0;
  virtual const char* display_name() const = 0;
  virtual std::vector<std::string> preset_names() const = 0;
  virtual const FamilyModules& modules() const = 0;
  virtual std::unique_ptr<TransformerConfig> preset(const std::string& name) const = 0;
  virtual std::unique_ptr<TransformerConfig> default_config() const = 0;
  virtual bool accepts(const TransformerConfig& c) const = 0;  // of this family's config type
  virtual void validate(const TransformerConfig& c) const = 0;
  virtual std::string to_string(const TransformerConfig& c) const = 0;
  virtual int64_t num_parameters(const TransformerConfig& c) const = 0;
  virtual long double num_parameters_bound(const TransformerConfig& c) const = 0;
  virtual double flops_per_token(const TransformerConfig& c) const = 0;
  virtual std::shared_ptr<torch::nn::Module> build(const TransformerConfig& c,
                                                   uint64_t seed) const = 0;
  virtual at::Tensor loss(torch::nn::Module& model, const at::Tensor& idx,
                          const at::Tensor& targets) const = 0;
  virtual at::Tensor logits(torch::nn::Module& model, const at::Tensor& idx) const = 0;
  virtual TransformerShape shape(const TransformerConfig& c) const = 0;
};

const std::vector<const Family*>& families();
const Family& family(const std::string& name);
std::vector<std::string> family_names();
// Every family's presets, each name once, in registry order (what a --preset flag accepts; the
// family then checks its own); and one line for a --model flag's help:
// "gpt (presets tiny, small, 1b), llama (presets tiny, small, 1b, 7b)".
std::vector<std::string> all_preset_names();
std::string families_help();

// `c` as the family's own config type; c10::Error naming `family` for another family's config.
template <class Config>
const Config& config_as(const TransformerConfig& c, const char* family) {
  const auto* typed = dynamic_cast<const Config*>(&c);
  TORCH_CHECK(typed != nullptr, "the config is not one of the '", family, "' family");
  return *typed;
}

namespace detail {
// Argument-dependent lookup: the closed forms in a family config's own namespace.
template <class Config>
int64_t num_parameters_of(const Config& c) {
  return num_parameters(c);
}
template <class Config>
double flops_per_token_of(const Config& c) {
  return flops_per_token(c);
}
template <class Config>
long double num_parameters_bound_of(const Config& c) {
  return num_parameters_bound(c);
}
template <class Config>
TransformerShape transformer_shape_of(const Config& c) {
  return transformer_shape(c);
}
}  // namespace detail

// A family from its config and model types: Config has preset(), preset_names(), validate(),
// to_string() and, in its namespace (found by argument-dependent lookup), the free functions
// num_parameters, num_parameters_bound, flops_per_token and transformer_shape; Model is the
// module type Config builds (Model(cfg, seed)) with loss(idx, targets). The names and module
// types are data: `static const FamilyOf<XConfig, XImpl> f("x", "X", {...}); return f;`.
template <class Config, class Model>
class FamilyOf final : public Family {
 public:
  FamilyOf(const char* name, const char* display_name, FamilyModules modules)
      : name_(name), display_name_(display_name), modules_(std::move(modules)) {}
  const char* name() const override { return name_; }
  const char* display_name() const override { return display_name_; }
  std::vector<std::string> preset_names() const override { return Config::preset_names(); }
  const FamilyModules& modules() const override { return modules_; }
  long double num_parameters_bound(const TransformerConfig& c) const override {
    return detail::num_parameters_bound_of(config(c, name()));
  }
  TransformerShape shape(const TransformerConfig& c) const override {
    return detail::transformer_shape_of(config(c, name()));
  }
  static const Config& config(const TransformerConfig& c, const char* family) {
    return config_as<Config>(c, family);
  }
  std::unique_ptr<TransformerConfig> preset(const std::string& name) const override {
    return std::make_unique<Config>(Config::preset(name));
  }
  std::unique_ptr<TransformerConfig> default_config() const override {
    return std::make_unique<Config>();
  }
  bool accepts(const TransformerConfig& c) const override {
    return dynamic_cast<const Config*>(&c) != nullptr;
  }
  void validate(const TransformerConfig& c) const override { config(c, name()).validate(); }
  std::string to_string(const TransformerConfig& c) const override {
    return config(c, name()).to_string();
  }
  int64_t num_parameters(const TransformerConfig& c) const override {
    return detail::num_parameters_of(config(c, name()));
  }
  double flops_per_token(const TransformerConfig& c) const override {
    return detail::flops_per_token_of(config(c, name()));
  }
  std::shared_ptr<torch::nn::Module> build(const TransformerConfig& c,
                                           uint64_t seed) const override {
    return std::make_shared<Model>(config(c, name()), seed);
  }
  at::Tensor loss(torch::nn::Module& model, const at::Tensor& idx,
                  const at::Tensor& targets) const override {
    auto* m = dynamic_cast<Model*>(&model);
    TORCH_CHECK(m != nullptr, "the model is a ", model.name(), ", not a ", display_name());
    return m->loss(idx, targets);
  }
  at::Tensor logits(torch::nn::Module& model, const at::Tensor& idx) const override {
    auto* m = dynamic_cast<Model*>(&model);
    TORCH_CHECK(m != nullptr, "the model is a ", model.name(), ", not a ", display_name());
    return m->forward(idx);
  }

 private:
  const char* name_;
  const char* display_name_;
  FamilyModules modules_;
};

class ModelConfig {
 public:
  ModelConfig();
  ModelConfig(const Family& family, const TransformerConfig& config);
  ModelConfig(const ModelConfig& other);
  ModelConfig& operator=(const ModelConfig& other);
  ModelConfig(ModelConfig&&) noexcept = default;
  ModelConfig& operator=(ModelConfig&&) noexcept = default;

  static ModelConfig preset(const Family& family, const std::string& name);
  static ModelConfig preset(const std::string& family, const std::string& name);
  // A family's own config (gpt::GPTConfig, llama::LlamaConfig, ...): its Config::family().
  template <class Config>
  static ModelConfig of(const Config& c) {
    return ModelConfig(Config::family(), c);
  }

  const Family& family() const { return *family_; }
  TransformerConfig& sizes() { return *config_; }
  const TransformerConfig& sizes() const { return *config_; }
  template <class Config>
  const Config& as() const {
    return config_as<Config>(*config_, family_->name());
  }
  template <class Config>
  Config& as() {
    return const_cast<Config&>(static_cast<const ModelConfig*>(this)->as<Config>());
  }

  void validate() const { family_->validate(*config_); }
  int64_t& vocab() { return config_->vocab; }
  int64_t& d_model() { return config_->d_model; }
  int64_t& n_heads() { return config_->n_heads; }
  int64_t& n_layers() { return config_->n_layers; }
  int64_t& seq_len() { return config_->seq_len; }
  bool& tie_embeddings() { return config_->tie_embeddings; }
  int64_t vocab() const { return config_->vocab; }
  int64_t d_model() const { return config_->d_model; }
  int64_t n_heads() const { return config_->n_heads; }
  int64_t n_layers() const { return config_->n_layers; }
  int64_t seq_len() const { return config_->seq_len; }

  std::string to_string() const { return family_->to_string(*config_); }
  int64_t num_parameters() const { return family_->num_parameters(*config_); }
  long double num_parameters_bound() const { return family_->num_parameters_bound(*config_); }
  double flops_per_token() const { return family_->flops_per_token(*config_); }
  std::shared_ptr<torch::nn::Module> build(uint64_t seed) const {
    return family_->build(*config_, seed);
  }
  std::pair<at::Tensor, at::Tensor> synthetic_batch(int64_t batch, int64_t seed, int rank,
                                                    int64_t step) const;
  at::Tensor loss(torch::nn::Module& model, const at::Tensor& idx,
                  const at::Tensor& targets) const {
    return family_->loss(model, idx, targets);
  }
  at::Tensor logits(torch::nn::Module& model, const at::Tensor& idx) const {
    return family_->logits(model, idx);
  }
  // The planner's description (planner/model_shape.h, Family::shape).
  TransformerShape transformer_shape() const { return family_->shape(*config_); }

 private:
  const Family* family_;
  std::unique_ptr<TransformerConfig> config_;
};

}  // namespace models
}  // namespace flatshard
