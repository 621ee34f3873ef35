// flatshard/models/fp8_linear.h — fp8 matmuls for a Linear (opt-in): torchao's "tensorwise"
// float8 training recipe through at::_scaled_mm, fed by the unit's fp8 gather when there is one.
//
//   y = models::call_linear(fc, x, cfg.fp8);   // instead of  y = flatshard::call(fc, x);
//
// Contract
// - fp8_linear(x, weight, bias): x [..., in], weight [out, in], bias [out] or undefined, all of
//   one floating dtype (the unit's param dtype: bf16 on GPUs) -> [..., out] in that dtype. One
//   autograd node (Fp8Matmul) for x W^T, the bias added outside it (torchao does the same):
//     forward   x  -> e4m3 with its own dynamic per-tensor scale  s_x = amax|x| / 448
//               W  -> e4m3 with s_w (below);  y = _scaled_mm(x8, W8^T, s_x, s_w)
//     backward  dy -> e5m2 with s_g = amax|dy| / 57344
//               dx = _scaled_mm(dy8, W8, s_g, s_w)      (W8 requantized: nothing kept)
//               dW = _scaled_mm(dy8^T, x8, s_g, s_x)    (x8 and s_x kept from forward)
//   Scales follow scales_from_amax (flat_param/quantized_gather.h: amax 0 -> 1, tiny -> FLT_MIN);
//   q = clamp(v / s, -max, max).to(float8). Outputs and gradients are in the tensors' dtype;
//   dW goes to `weight` as any Linear's gradient does (AccumulateGrad, then the unit's usual
//   master gradient). Non-finite values are not checked (a host sync per matmul): they give
//   non-finite outputs, as a bf16 matmul would.
// - The weight's scale s_w: when `weight` is a parameter its unit gathers in fp8
//   (gather dtype fp8), the gather's own scale (gathered_fp8_scale, flat_param/gathered_scale.h):
//   the module sees the dequantized weight, and requantizing it with that scale gives the wire's
//   fp8 bytes back exactly, so the matmul runs on what was sent. Otherwise (another gather dtype,
//   an unsharded model) the weight's own dynamic scale amax|W| / 448 — which for an fp32 weight
//   equal to the master is the fp8 gather's scale, so an unsharded fp32 model runs the same
//   recipe with the same scales as a sharded one gathering fp8.
// - Devices: on CPU at::_scaled_mm runs (torch 2.11: it dequantizes and multiplies in fp32, then
//   rounds to the output dtype), any sizes. On CUDA it needs compute capability 8.9 or newer
//   (Ada, Hopper): below that a c10::Error names the device and its capability; in, out and the
//   number of rows of x (batch x tokens) must be multiples of 16 (cuBLASLt's fp8 rule), else a
//   c10::Error names the sizes.
// - call_linear(m, x, fp8): fp8 false is flatshard::call(m, x). True, the same unit-aware call
//   (gather, mixed-precision input cast, tensor-parallel entry and exit, recompute) with
//   fp8_linear over m's weight and bias instead of m->forward. Embeddings and output heads
//   should stay in the param dtype (the model families keep them so, as torchao does).
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

namespace flatshard {
namespace models {

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias = {});

// What flatshard::call takes for an fp8 call of a Linear: the module (for the unit and tensor
// parallel registries, which key on it) and a forward that is fp8_linear over its parameters.
class Fp8LinearCall {
 public:
  explicit Fp8LinearCall(torch::nn::LinearImpl* m) : m_(m) {}
  torch::nn::LinearImpl* get() const { return m_; }
  const Fp8LinearCall* operator->() const { return this; }
  at::Tensor forward(const at::Tensor& x) const { return fp8_linear(x, m_->weight, m_->bias); }

 private:
  torch::nn::LinearImpl* m_;  // the model owns it
};

at::Tensor call_linear(torch::nn::Linear& m, const at::Tensor& x, bool fp8);

}  // namespace models
}  // namespace flatshard
