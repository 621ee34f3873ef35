// flatshard/models/model_init.h — what every reference model family needs to initialise itself
// deterministically and to count its parameters (models/gpt.h, models/llama.h).
//
// Contract
//   * GlobalRngRestorer: saves the global CPU generator's state on construction and restores it
//     on destruction. torch::nn::Linear/Embedding draw their default init from the global
//     generator; the families overwrite those values from a private generator anyway, and
//     restoring the state keeps "build a reference model, then draw data from the global RNG"
//     reproducible whether or not a model was built in between. Never throws from its
//     destructor (the RNG then merely stays advanced).
//   * unique_parameters(module): parameters() with tied tensors listed once (first occurrence
//     wins, registration order). LibTorch's parameters() does not deduplicate; use this for
//     optimizers and parameter counts.
//   * path_ends_with(path, suffix): whether a module path ends in `suffix` (how the families
//     find their residual projections at init).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <string>
#include <vector>

namespace flatshard {
namespace models {

class GlobalRngRestorer {
 public:
  GlobalRngRestorer();
  ~GlobalRngRestorer();
  GlobalRngRestorer(const GlobalRngRestorer&) = delete;
  GlobalRngRestorer& operator=(const GlobalRngRestorer&) = delete;

 private:
  at::Generator gen_;
  at::Tensor state_;
};

std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module);

inline bool path_ends_with(const std::string& path, const std::string& suffix) {
  return path.size() >= suffix.size() &&
         path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace models
}  // namespace flatshard
