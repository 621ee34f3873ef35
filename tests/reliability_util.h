// Small models and helpers shared by the reliability tests (tests/reliability_*_test.cpp).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <chrono>

#include "fsdp/call.h"

namespace flatshard_test {

// Two Linear units 'a' (4->4) and 'b' (4->b_width, then summed back) called in the order a, b —
// or b, a when `swap` — or b alone when `skip_a`: ways for ranks to disagree at run time.
struct TwoPathImpl : torch::nn::Module {
  explicit TwoPathImpl(bool swap = false, bool skip_a = false, int64_t b_width = 4)
      : a(register_module("a", torch::nn::Linear(4, 4))),
        b(register_module("b", torch::nn::Linear(4, b_width))),
        swap_(swap),
        skip_a_(skip_a) {}
  at::Tensor forward(const at::Tensor& x) {
    auto fb = [&](const at::Tensor& h) { return flatshard::call(b, h).narrow(1, 0, 4); };
    if (skip_a_) return fb(x);
    return swap_ ? flatshard::call(a, fb(x)) : fb(flatshard::call(a, x));
  }
  torch::nn::Linear a, b;
  bool swap_, skip_a_;
};
TORCH_MODULE(TwoPath);

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace flatshard_test
