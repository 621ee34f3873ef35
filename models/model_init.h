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
//   * Per-tensor determinism (Note [Deferred initialization], fsdp/deferred_init.h): a family
//     initialises each parameter from its own CPU generator, seeded with tensor_seed(seed,
//     name) — FNV-1a of the name mixed with the seed by splitmix64, stable across builds and
//     platforms (std::hash is not) — so a tensor's values depend on (seed, name, shape) only,
//     not on what was initialised before it. Eager construction and fully_shard's deferred
//     init call the same per-tensor routine and get the same values.
//   * normal_init(values, std, seed, name): values ~ N(0, std), drawn on the CPU in chunks of
//     kDrawChunk elements (of the flattened tensor), chunk k from a generator seeded with
//     chunk_seed(tensor_seed(seed, name), k), the chunks in parallel (at::parallel_for): a
//     6.7B-parameter model is drawn on all host cores, and the values depend neither on the
//     thread count nor on the order of the chunks. Drawn in place into a contiguous CPU fp32
//     tensor (a fresh parameter, or its region of a flat buffer: the same kernel path per
//     chunk, the same bits); any other tensor (a GPU one, another dtype, non-contiguous) gets
//     the same draw made into a CPU fp32 tensor and copied in. A meta tensor (under
//     flatshard::MetaInit) is left alone.
//   * find_module(root, path): the module at `path` below `root` ("" = root itself), or null.
//   * unique_named_parameters(module): named_parameters() with tied tensors listed once, under
//     their first name (what unique_parameters() returns, with names).
//   * find_tensor_for_init(root, name, values, who): where a family's init_tensor(name, values)
//     writes — the owning module, its path and the leaf name, and the parameter (else buffer)
//     itself; throws c10::Error prefixed by `who` when `name` is neither, or when `values` has
//     another shape.
//   * init_each_parameter(root, init): init(name, tensor) once per distinct parameter (a tied
//     one under its first name): a family's eager init over its own init_tensor().
//   * init_transformer_tensor(root, scheme, name, values, other): the init walk every
//     transformer family shares, for one parameter or buffer: a tied head weight resolves to the
//     embedding's name (one tensor, one init), biases 0, Linear weights ~ N(0, scheme.std) —
//     those of the residual projections (a module path ending in one of
//     scheme.residual_paths) ~ N(0, scheme.residual_std) —, Embedding weights ~ N(0, std), each
//     drawn per (seed, name) by normal_init; anything else goes to other(site, values), which
//     initialises a family's own modules (norms, rotary tables) and returns whether it knew the
//     module (false: an internal error naming the parameter).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "models/transformer.h"

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
std::vector<std::pair<std::string, at::Tensor>> unique_named_parameters(
    const torch::nn::Module& module);

constexpr int64_t kDrawChunk = int64_t{1} << 20;
uint64_t tensor_seed(uint64_t seed, const std::string& name);
uint64_t chunk_seed(uint64_t tensor_seed, int64_t chunk);
void normal_init(const at::Tensor& values, double std, uint64_t seed, const std::string& name);
const torch::nn::Module* find_module(const torch::nn::Module& root, const std::string& path);

struct TensorSite {
  std::string path, leaf;                     // "blocks.0.attn.qkv", "weight"
  const torch::nn::Module* module = nullptr;  // the module at `path`
  at::Tensor tensor;                          // the parameter or buffer
};
TensorSite find_tensor_for_init(const torch::nn::Module& root, const std::string& name,
                                const at::Tensor& values, const char* who);
void init_each_parameter(const torch::nn::Module& root,
                         const std::function<void(const std::string&, const at::Tensor&)>& init);

struct InitScheme {
  uint64_t seed = 0;
  double std = 0.02, residual_std = 0.02;
  std::vector<std::string> residual_paths;  // "attn.proj", "mlp.proj"
  // Tied embeddings: the head's weight name and the embedding's it aliases; empty: untied.
  std::string tied_head, tied_embedding;
  const char* who = "init_tensor";          // error prefix: "GPT::init_tensor"

  // A config's scheme (models/transformer.h): its init_std and residual_std(), and the tied
  // names only when cfg.tie_embeddings.
  static InitScheme of(const TransformerConfig& cfg, uint64_t seed,
                       std::vector<std::string> residual_paths, std::string head_weight,
                       std::string embedding_weight, const char* who);
};
using InitOther = std::function<bool(const TensorSite&, const at::Tensor&)>;
void init_transformer_tensor(const torch::nn::Module& root, const InitScheme& scheme,
                             const std::string& name, const at::Tensor& values,
                             const InitOther& other);

inline bool path_ends_with(const std::string& path, const std::string& suffix) {
  return path.size() >= suffix.size() &&
         path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace models
}  // namespace flatshard
