// flatshard/models/fp8_linear.cpp — see fp8_linear.h for the contract.
#include "models/fp8_linear.h"

#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <string>

#include "flat_param/gathered_scale.h"
#include "flat_param/quantized_gather.h"
#include "fsdp/call.h"

#if FLATSHARD_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace flatshard {
namespace models {

namespace {

constexpr double kE5m2Max = 57344.0;  // largest finite float8_e5m2

struct Quantized {
  at::Tensor q;      // float8, v's shape
  at::Tensor scale;  // fp32 [1]: v ~ q * scale
};

at::Tensor amax_of(const at::Tensor& v) { return v.abs().amax().to(at::kFloat).view({1}); }

// Dynamic per-tensor e4m3: the fp8 gather's formula (flat_param/quantized_gather.h).
Quantized e4m3(const at::Tensor& v, at::Tensor scale = {}) {
  if (!scale.defined()) scale = scales_from_amax(amax_of(v), kFp8Max);
  return {fp8_quantize(v.reshape({-1}).to(at::kFloat), scale).view(v.sizes()), scale};
}

Quantized e5m2(const at::Tensor& v) {
  const at::Tensor s = scales_from_amax(amax_of(v), kE5m2Max);
  return {at::clamp(v.to(at::kFloat) / s, -kE5m2Max, kE5m2Max).to(at::kFloat8_e5m2), s};
}

// The weight with its unit's fp8 gather scale when it has one, else its own dynamic one.
Quantized weight_e4m3(const at::Tensor& w) {
  at::Tensor s = gathered_fp8_scale(w);
  // The gather's scale is a one-element view into the unit's scale vector (4 B apart); cuBLASLt
  // refuses such a scale pointer on CUDA (CUBLAS_STATUS_NOT_SUPPORTED on an H100, 2026-12-06:
  // the first fp8 matmul of the 1B GPT with fp8 gathers), so the matmul gets its own copy.
  if (s.defined() && s.is_cuda()) s = s.clone();
  return e4m3(w, s);
}

// `b` as a column-major matrix (what _scaled_mm wants for its second operand).
at::Tensor column_major(const at::Tensor& b) { return b.t().contiguous().t(); }

void check_device(const at::Tensor& x, int64_t m, int64_t k, int64_t n) {
  if (!x.is_cuda()) return;
#if FLATSHARD_WITH_CUDA
  // Attributes, not cudaGetDeviceProperties (milliseconds a call): this runs per matmul.
  const int idx = x.device().index();
  int major = 0, minor = 0;
  TORCH_CHECK(
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, idx) == cudaSuccess &&
          cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, idx) == cudaSuccess,
      "fp8_linear: cannot read the compute capability of ", x.device());
  if (major < 8 || (major == 8 && minor < 9)) {
    cudaDeviceProp prop{};
    const bool named = cudaGetDeviceProperties(&prop, idx) == cudaSuccess;
    TORCH_CHECK(false,
                "fp8_linear: fp8 matmuls (at::_scaled_mm) need a GPU of compute capability 8.9 "
                "or newer (Ada, Hopper); ",
                x.device(), " (", named ? prop.name : "unnamed", ") has ", major, ".", minor,
                ". Run without fp8 matmuls (--fp8 / the model "
                "config's fp8)");
  }
#endif
  TORCH_CHECK(m % 16 == 0 && k % 16 == 0 && n % 16 == 0,
              "fp8_linear: on CUDA, fp8 matmuls need the rows of the input (batch x tokens), in "
              "and out to be multiples of 16; got rows ",
              m, ", in ", k, ", out ", n, ". Change the sizes or run without fp8 matmuls");
}

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct Fp8Matmul : torch::autograd::Function<Fp8Matmul> {
  // x [M, K], weight [N, K] -> [M, N]
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight) {
    const Quantized xq = e4m3(x);
    const Quantized wq = weight_e4m3(weight);
    const at::Tensor y =
        at::_scaled_mm(xq.q, wq.q.t(), xq.scale, wq.scale, {}, {}, weight.scalar_type());
    ctx->save_for_backward({xq.q, xq.scale, weight});
    // Backward looks the gather's scale up again: it must find one iff forward did.
    ctx->saved_data["gathered"] = gathered_fp8_scale(weight).defined();
    return y;
  }

  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x8 = saved[0], &sx = saved[1], &weight = saved[2];
    const Quantized g = e5m2(grads[0].contiguous());
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) {
      // The weight is gathered again for backward (the unit's pre-backward): the same master,
      // so the same scale and bytes as in forward.
      const Quantized wq = weight_e4m3(weight);
      TORCH_INTERNAL_ASSERT(
          gathered_fp8_scale(weight).defined() == ctx->saved_data["gathered"].toBool(),
          "fp8_linear: the weight's fp8 gather scale was found in forward but not in "
          "backward, or the other way round");
      dx = at::_scaled_mm(g.q, column_major(wq.q), g.scale, wq.scale, {}, {}, weight.scalar_type());
    }
    if (ctx->needs_input_grad(1))
      dw = at::_scaled_mm(g.q.t().contiguous(), column_major(x8), g.scale, sx, {}, {},
                          weight.scalar_type());
    return {dx, dw};
  }
};

}  // namespace

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(weight.dim() == 2, "fp8_linear: weight must be [out, in], got ", weight.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "fp8_linear: input ", x.sizes(),
              " does not end in the weight's in = ", weight.size(1));
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "fp8_linear: input dtype ", x.scalar_type(),
              " differs from the weight's ", weight.scalar_type(),
              " (the unit's param dtype: enter the module through flatshard::call, which casts "
              "its inputs)");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "fp8_linear: needs a floating dtype, got ",
              x.scalar_type());
  const int64_t k = weight.size(1), n = weight.size(0);
  const at::Tensor x2 = x.reshape({-1, k}).contiguous();
  check_device(x2, x2.size(0), k, n);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  at::Tensor y = Fp8Matmul::apply(x2, weight).view(out_sizes);
  if (bias.defined()) y = y + bias;
  return y;
}

at::Tensor call_linear(torch::nn::Linear& m, const at::Tensor& x, bool fp8) {
  if (!fp8) return flatshard::call(m, x);
  Fp8LinearCall handle(m.get());
  return flatshard::call(handle, x);
}

}  // namespace models
}  // namespace flatshard
