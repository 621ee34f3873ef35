// flatshard/models/model_init.cpp — see model_init.h for the contract.
#include "models/model_init.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
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

std::vector<std::pair<std::string, at::Tensor>> unique_named_parameters(
    const torch::nn::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.named_parameters(/*recurse=*/true))
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) out.emplace_back(p.key(), p.value());
  return out;
}

std::vector<at::Tensor> unique_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (auto& [name, p] : unique_named_parameters(module)) out.push_back(std::move(p));
  return out;
}

void init_each_parameter(const torch::nn::Module& root,
                         const std::function<void(const std::string&, const at::Tensor&)>& init) {
  // The order does not matter (per-tensor determinism, model_init.h).
  for (const auto& [name, p] : unique_named_parameters(root)) init(name, p);
}

namespace {

// splitmix64's finaliser: nearby inputs give unrelated seeds.
uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Fills `flat` (contiguous CPU fp32, 1-D) chunk by chunk, the chunks in parallel.
void draw_normal(const at::Tensor& flat, double std, uint64_t seed) {
  const int64_t n = flat.numel();
  const int64_t chunks = (n + kDrawChunk - 1) / kDrawChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      // Private generator per chunk: no lock needed (the sampling kernels lock it themselves).
      at::Generator gen = at::detail::createCPUGenerator(chunk_seed(seed, k));
      flat.narrow(0, k * kDrawChunk, std::min(kDrawChunk, n - k * kDrawChunk))
          .normal_(0.0, std, gen);
    }
  });
}

}  // namespace

uint64_t tensor_seed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bits
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return mix(seed ^ h);
}

uint64_t chunk_seed(uint64_t tensor_seed, int64_t chunk) {
  return chunk == 0 ? tensor_seed
                    : mix(tensor_seed + 0x9e3779b97f4a7c15ull * static_cast<uint64_t>(chunk));
}

void normal_init(const at::Tensor& values, double std, uint64_t seed, const std::string& name) {
  if (values.is_meta()) return;
  at::NoGradGuard no_grad;
  const uint64_t s = tensor_seed(seed, name);
  if (values.is_cpu() && values.scalar_type() == at::kFloat && values.is_contiguous()) {
    // Detached: the worker threads of parallel_for do not inherit this thread's NoGradGuard,
    // and an in-place draw into a view of a parameter would then be refused.
    draw_normal(values.detach().view({-1}), std, s);
    return;
  }
  at::Tensor draw = at::empty({values.numel()}, at::TensorOptions().dtype(at::kFloat));
  draw_normal(draw, std, s);
  values.copy_(draw.view(values.sizes()));
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

TensorSite find_tensor_for_init(const torch::nn::Module& root, const std::string& name,
                                const at::Tensor& values, const char* who) {
  TensorSite site;
  const size_t dot = name.rfind('.');
  site.path = dot == std::string::npos ? "" : name.substr(0, dot);
  site.leaf = dot == std::string::npos ? name : name.substr(dot + 1);
  site.module = find_module(root, site.path);
  if (site.module) {
    const auto params = site.module->named_parameters(/*recurse=*/false);
    if (const at::Tensor* p = params.find(site.leaf)) {
      site.tensor = *p;
    } else {
      const auto buffers = site.module->named_buffers(/*recurse=*/false);
      if (const at::Tensor* b = buffers.find(site.leaf)) site.tensor = *b;
    }
  }
  TORCH_CHECK(site.tensor.defined(), who, ": the model has no parameter or buffer '", name, "'");
  TORCH_CHECK(values.sizes() == site.tensor.sizes(), who, ": '", name, "' is ",
              site.tensor.sizes(), ", got values of shape ", values.sizes());
  return site;
}

InitScheme InitScheme::of(const TransformerConfig& cfg, uint64_t seed,
                          std::vector<std::string> residual_paths, std::string head_weight,
                          std::string embedding_weight, const char* who) {
  InitScheme s;
  s.seed = seed;
  s.std = cfg.init_std;
  s.residual_std = cfg.residual_std();
  s.residual_paths = std::move(residual_paths);
  if (cfg.tie_embeddings) {
    s.tied_head = std::move(head_weight);
    s.tied_embedding = std::move(embedding_weight);
  }
  s.who = who;
  return s;
}

void init_transformer_tensor(const torch::nn::Module& root, const InitScheme& scheme,
                             const std::string& name, const at::Tensor& values,
                             const InitOther& other) {
  // A meta tensor (construction under flatshard::MetaInit) gets no values, so there is nothing
  // to look up: find_module copies each parent's children, so a lookup per parameter made
  // building an n-layer model on meta O(n^2) (flatshard-explain: 8192 layers took minutes).
  // Deferred init calls this again with real tensors, which checks the name and the shape.
  if (values.is_meta()) return;
  at::NoGradGuard no_grad;
  // A tied weight is one tensor with one init, whichever of its names the caller uses.
  const std::string& key =
      !scheme.tied_head.empty() && name == scheme.tied_head ? scheme.tied_embedding : name;
  const TensorSite site = find_tensor_for_init(root, key, values, scheme.who);
  const torch::nn::Module* m = site.module;
  if (site.leaf == "bias") {
    values.zero_();
  } else if (dynamic_cast<const torch::nn::LinearImpl*>(m)) {
    bool residual = false;
    for (const auto& suffix : scheme.residual_paths)
      residual = residual || path_ends_with(site.path, suffix);
    normal_init(values, residual ? scheme.residual_std : scheme.std, scheme.seed, key);
  } else if (dynamic_cast<const torch::nn::EmbeddingImpl*>(m)) {
    normal_init(values, scheme.std, scheme.seed, key);
  } else {
    TORCH_INTERNAL_ASSERT(other && other(site, values), scheme.who, ": '", name,
                          "' belongs to no known module type");
  }
}

}  // namespace models
}  // namespace flatshard
