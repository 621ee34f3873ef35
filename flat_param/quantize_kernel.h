// flatshard/flat_param/quantize_kernel.h — CUDA kernels for the quantized gathers' wire
// (flat_param/quantized_gather.h): quantize the fp32 master shard into the wire and dequantize
// every rank's part out of it into the gathered buffer, one launch each instead of ATen's
// chain of ops (abs, amax, div, clamp, round, cast; then cast, mul, cast). Plain C++, no torch
// (as range_copy_kernel.h).
//
// Used by Fp8AllGather / Int8AllGather on CUDA masters (Note [Quantize kernels],
// quantized_gather.h), which keep ATen's ops as the CPU path and the reference: the GPU tests
// (tests/gpu_quantized_gather_test.cpp, tests/quantize_kernel_check.py; tools/gpu_check.sh
// steps gpu_tests and quant) hold them bit for bit equal to it; the one-GPU issue measures
// them. The formulas are quantized_gather.h's, written to round as ATen does on the device: true
// fp32 division (nvcc's default -prec-div=true), rintf for round-half-even, __nv_cvt_float_to_fp8
// (round to nearest even, saturating: the value is clamped to +-448 first anyway), a
// NaN-propagating amax so a non-finite block keeps a non-finite scale for the plan's check.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "flat_param/kernel_dtype.h"

namespace flatshard {
namespace kernels {

constexpr int kQuantBlock = 256;  // = kInt8BlockSize (quantized_gather.h); one CUDA block each

// int8, this rank's part of the wire: `x` [n] fp32 -> scales [ceil(n / 256)] fp32 at `scales`
// and int8 data [n] at `q` (the wire slot's two regions). Returns the launch error.
cudaError_t int8_quantize(const float* x, int64_t n, float* scales, int8_t* q, cudaStream_t stream);
// int8, every rank's part: rank r's scales at wire + r * wire_bytes, its data 4 * blocks bytes
// after them; out + r * n (of out_dtype) gets q * scale.
cudaError_t int8_dequantize(const uint8_t* wire, int64_t wire_bytes, int64_t n, int world,
                            void* out, KernelDtype out_dtype, cudaStream_t stream);
// fp8 e4m3fn, one range with one scale (device pointer): q = clamp(x / *scale, +-448).
cudaError_t fp8_quantize(const float* x, int64_t n, const float* scale, uint8_t* q,
                         cudaStream_t stream);
// out (of out_dtype) = q * *scale.
cudaError_t fp8_dequantize(const uint8_t* q, int64_t n, const float* scale, void* out,
                           KernelDtype out_dtype, cudaStream_t stream);

}  // namespace kernels
}  // namespace flatshard
