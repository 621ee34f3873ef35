// flatshard/models/family.cpp — see family.h for the contract. The registry's list is
// families() in models/families.cpp, one line per family (its descriptor lives with the family,
// e.g. gpt::GPTConfig::family() in gpt.cpp).
#include "models/family.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "models/synthetic_language.h"

namespace flatshard {
namespace models {

std::vector<std::string> family_names() {
  std::vector<std::string> out;
  for (const Family* f : families()) out.emplace_back(f->name());
  return out;
}

std::vector<std::string> all_preset_names() {
  std::vector<std::string> out;
  for (const Family* f : families())
    for (const auto& p : f->preset_names())
      if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
  return out;
}

std::string families_help() {
  std::string out;
  for (const Family* f : families()) {
    out += out.empty() ? "" : ", ";
    out += std::string(f->name()) + " (presets ";
    const auto presets = f->preset_names();
    for (size_t i = 0; i < presets.size(); ++i) out += (i ? ", " : "") + presets[i];
    out += ")";
  }
  return out;
}

const Family& family(const std::string& name) {
  std::string known;
  for (const Family* f : families()) {
    if (name == f->name()) return *f;
    known += (known.empty() ? "" : ", ") + std::string(f->name());
  }
  TORCH_CHECK(false, "unknown model family '", name, "'; known: ", known);
}

ModelConfig::ModelConfig()
    : family_(families().front()), config_(families().front()->default_config()) {}

ModelConfig::ModelConfig(const Family& family, const TransformerConfig& config)
    : family_(&family), config_(config.clone()) {
  TORCH_CHECK(family.accepts(*config_), "ModelConfig: the config is not one of the '",
              family.name(), "' family");
}

ModelConfig::ModelConfig(const ModelConfig& other)
    : family_(other.family_), config_(other.config_->clone()) {}

ModelConfig& ModelConfig::operator=(const ModelConfig& other) {
  if (this != &other) {
    family_ = other.family_;
    config_ = other.config_->clone();
  }
  return *this;
}

ModelConfig ModelConfig::preset(const Family& family, const std::string& name) {
  return ModelConfig(family, *family.preset(name));
}

ModelConfig ModelConfig::preset(const std::string& family_name, const std::string& name) {
  return preset(models::family(family_name), name);
}

std::pair<at::Tensor, at::Tensor> ModelConfig::synthetic_batch(int64_t batch, int64_t seed,
                                                               int rank, int64_t step) const {
  validate();
  return synthetic_tokens(config_->vocab, config_->seq_len, batch, seed, rank, step);
}

}  // namespace models
}  // namespace flatshard
