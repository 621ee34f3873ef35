// A small residual MLP "transformer" for core FSDP tests: an input Linear, L blocks of
// LayerNorm -> Linear -> GELU -> Linear (+ residual), and a head. Sizes are odd on purpose so
// flat parameters need padding at every world size. Children are entered via flatshard::call.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include "fsdp/call.h"

namespace flatshard_test {

struct TinyBlockImpl : torch::nn::Module {
  explicit TinyBlockImpl(int64_t d)
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        fc1(register_module("fc1", torch::nn::Linear(d, 2 * d + 1))),
        fc2(register_module("fc2", torch::nn::Linear(2 * d + 1, d))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = flatshard::call(ln, x);
    h = at::gelu(flatshard::call(fc1, h));
    return x + flatshard::call(fc2, h);
  }
  torch::nn::LayerNorm ln;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(TinyBlock);

struct TinyNetImpl : torch::nn::Module {
  // `repeat_first`: block 0 runs twice per forward (a unit called twice in one forward).
  // `with_unused`: an extra Linear that forward never calls (parameters unused in a step).
  TinyNetImpl(int64_t d_in, int64_t d, int64_t layers, bool repeat_first = false,
              bool with_unused = false)
      : inp(register_module("inp", torch::nn::Linear(d_in, d))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(d, 3))),
        repeat_first_(repeat_first) {
    for (int64_t i = 0; i < layers; ++i) {
      typed.emplace_back(d);
      blocks->push_back(typed.back());
    }
    if (with_unused) unused = register_module("unused", torch::nn::Linear(d, 2));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = flatshard::call(inp, x);
    for (size_t i = 0; i < typed.size(); ++i) {
      h = flatshard::call(typed[i], h);
      if (i == 0 && repeat_first_) h = flatshard::call(typed[i], h);
    }
    return flatshard::call(head, h);
  }
  torch::nn::Linear inp;
  torch::nn::ModuleList blocks;
  std::vector<TinyBlock> typed;
  torch::nn::Linear head;
  torch::nn::Linear unused{nullptr};
  bool repeat_first_;
};
TORCH_MODULE(TinyNet);

// Deterministic values for every parameter from `seed`, whatever the construction order.
inline void init_params(torch::nn::Module& m, uint64_t seed) {
  at::NoGradGuard ng;
  auto gen = at::detail::createCPUGenerator(seed);
  for (auto& p : m.named_parameters()) {
    auto v = at::randn(p.value().sizes(), gen).mul_(0.3);
    p.value().copy_(v);
  }
}

}  // namespace flatshard_test
