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

uint64_t tensor_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bits
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  uint64_t z = seed ^ h;  // splitmix64's finaliser: nearby seeds give unrelated streams
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void normal_init(const at::Tensor& values, double std, uint64_t seed, const std::string& name) {
  if (values.is_meta()) return;
  at::NoGradGuard no_grad;
  // Private generator: no lock needed (the sampling kernels lock it themselves).
  at::Generator gen = at::detail::createCPUGenerator(tensor_seed(seed, name));
  if (values.is_cpu() && values.scalar_type() == at::kFloat && values.is_contiguous()) {
    values.normal_(0.0, std, gen);
    return;
  }
  at::Tensor draw = at::empty(values.sizes(), at::TensorOptions().dtype(at::kFloat));
  draw.normal_(0.0, std, gen);
  values.copy_(draw);
}

const torch::nn::Module* find_module(const torch::nn::Module& root, const std::string& path) {
  const torch::nn::Module* m = &root;
  size_t begin = 0;
  while (m != nullptr && begin < path.size()) {
    size_t end = path.find('.', begin);
    if (end == std::string::npos) end = path.size();
    const auto children = m->named_children();
    const auto* child = children.find(path.substr(begin, end - begin));
    m = child ? child->get() : nullptr;
    begin = end + 1;
  }
  return m;
}

}  // namespace models
}  // namespace flatshard
