// flatshard/flat_param/gathered_scale.h — the fp8 scale a gathered parameter was dequantized
// with: what an fp8 matmul (models/fp8_linear.h) requantizes a unit's weight with, so that it
// computes on the wire's own fp8 bytes.
//
// Contract
// - gathered_fp8_scale(param): `param` is a module's parameter handle (the tensor a unit gave
//   the module: the same TensorImpl as FlatParam's ParamRef). When it belongs to a live
//   FlatParam whose gather plan is Fp8AllGather (gather dtype fp8, flat_param/quantized_gather.h)
//   and that unit is gathered and attached, the result is the fp32 scale (one element, on the
//   unit's device) its last gather dequantized it with: param = (q * s).to(param_dtype), and
//   fp8_quantize(param.to(fp32), s) gives q back bit for bit (param_dtype fp32 or bf16: the
//   bf16 rounding moves a value by at most 2^-8 of itself, less than half an e4m3 step, >= 2^-5;
//   only a scale of FLT_MIN — a parameter whose amax is a denormal, Note in quantized_gather.h —
//   can lose codes to bf16 denormals). Undefined otherwise: not such a parameter, or its unit
//   sharded now (the parameter is guarded: reading its data throws the guard's message).
// - The tensor is the plan's own (a view of it): read it on the current stream while the unit
//   is gathered and do not keep it past that (the next gather replaces it; its memory belongs
//   to the all-gather stream, Note [Free by event ordering]). Copy it to keep it.
// - FlatParam registers its parameters at construction when its plan gathers fp8 and removes
//   them in its destructor. Thread-safe (ranks as threads); without a live fp8 unit a lookup is
//   one atomic load.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace flatshard {

at::Tensor gathered_fp8_scale(const at::Tensor& param);

namespace detail {
// FlatParam's side (flat_param.cpp): `params` (its parameters' TensorImpls, in order) are
// answered by `scale_of(param, i)`, the i-th one's scale or undefined, until unregistered under
// the same `owner`. Keyed by TensorImpl, so this file needs no FlatParam (flat_param.cpp
// includes it, not the other way round).
using Fp8ScaleLookup = std::function<at::Tensor(const at::Tensor& param, size_t i)>;
void register_fp8_params(const void* owner, const std::vector<const c10::TensorImpl*>& params,
                         Fp8ScaleLookup scale_of);
// Every parameter `owner` registered. Never throws (called from FlatParam's destructor).
void unregister_fp8_params(const void* owner) noexcept;
}  // namespace detail

}  // namespace flatshard
