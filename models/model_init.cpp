// flatshard/models/model_init.cpp — see model_init.h for the contract.
#include "models/model_init.h"

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>
#include <unordered_set>

namespace flatshard {
namespace models {

GlobalRngRestorer::GlobalRngRestorer() : gen_(at::detail::getDefaultCPUGenerator()) {
  std::lock_guard<std::mutex> lock(gen_.mutex());
  state_ = gen_.get_state();
}

GlobalRngRestorer::~GlobalRngRestorer() {
  try {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(state_);
  } catch (...) {  // never throw from a destructor; the RNG then merely stays advanced
  }
}

std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

}  // namespace models
}  // namespace flatshard
