// flatshard/flat_param/quantize_kernel.cu — see quantize_kernel.h (Note [Quantize kernels],
// quantized_gather.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>

#include "flat_param/quantize_kernel.h"

namespace flatshard {
namespace kernels {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float max_nan(float a, float b) {
  if (a != a) return a;  // NaN wins, as ATen's amax
  if (b != b) return b;
  return a > b ? a : b;
}

// quantized_gather.h's scales_from_amax.
__device__ __forceinline__ float scale_of(float amax, float qmax) {
  float s = amax / qmax;
  if (s < FLT_MIN) s = FLT_MIN;  // false for NaN: a NaN stays
  return amax == 0.0f ? 1.0f : s;
}

__device__ __forceinline__ void store(void* out, int64_t i, float v, KernelDtype d) {
  switch (d) {
    case KernelDtype::kFloat32:
      static_cast<float*>(out)[i] = v;
      break;
    case KernelDtype::kBFloat16:
      static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16(v);
      break;
    case KernelDtype::kFloat16:
      static_cast<__half*>(out)[i] = __float2half(v);
      break;
  }
}

__global__ void int8_quantize_kernel(const float* x, int64_t n, float* scales, int8_t* q) {
  __shared__ float amax_of[kThreads];
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kQuantBlock + threadIdx.x;
  const float v = i < n ? x[i] : 0.0f;
  amax_of[threadIdx.x] = fabsf(v);
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride)
      amax_of[threadIdx.x] = max_nan(amax_of[threadIdx.x], amax_of[threadIdx.x + stride]);
    __syncthreads();
  }
  const float s = scale_of(amax_of[0], 127.0f);
  if (threadIdx.x == 0) scales[blockIdx.x] = s;
  if (i < n) q[i] = static_cast<int8_t>(fminf(fmaxf(rintf(v / s), -127.0f), 127.0f));
}

__global__ void int8_dequantize_kernel(const uint8_t* wire, int64_t wire_bytes, int64_t n,
                                       int64_t blocks, void* out, KernelDtype d) {
  const int64_t r = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kQuantBlock + threadIdx.x;
  if (i >= n) return;
  const uint8_t* part = wire + r * wire_bytes;
  const float s = reinterpret_cast<const float*>(part)[blockIdx.x];
  const int8_t v = reinterpret_cast<const int8_t*>(part + 4 * blocks)[i];
  store(out, r * n + i, static_cast<float>(v) * s, d);
}

__global__ void fp8_quantize_kernel(const float* x, int64_t n, const float* scale, uint8_t* q) {
  const float s = *scale;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = fminf(fmaxf(x[i] / s, -448.0f), 448.0f);
    q[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
  }
}

__global__ void fp8_dequantize_kernel(const uint8_t* q, int64_t n, const float* scale, void* out,
                                      KernelDtype d) {
  const float s = *scale;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(q[i]), __NV_E4M3);
    store(out, i, __half2float(__half(h)) * s, d);  // fp8 -> fp16 is exact, fp16 -> fp32 too
  }
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

}  // namespace

cudaError_t int8_quantize(const float* x, int64_t n, float* scales, int8_t* q,
                          cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  int8_quantize_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(x, n, scales, q);
  return cudaGetLastError();
}

cudaError_t int8_dequantize(const uint8_t* wire, int64_t wire_bytes, int64_t n, int world,
                            void* out, KernelDtype out_dtype, cudaStream_t stream) {
  if (n == 0 || world == 0) return cudaSuccess;
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(world));
  int8_dequantize_kernel<<<grid, kThreads, 0, stream>>>(wire, wire_bytes, n, blocks, out,
                                                        out_dtype);
  return cudaGetLastError();
}

cudaError_t fp8_quantize(const float* x, int64_t n, const float* scale, uint8_t* q,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  fp8_quantize_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n, scale, q);
  return cudaGetLastError();
}

cudaError_t fp8_dequantize(const uint8_t* q, int64_t n, const float* scale, void* out,
                           KernelDtype out_dtype, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  fp8_dequantize_kernel<<<grid_for(n), kThreads, 0, stream>>>(q, n, scale, out, out_dtype);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace flatshard
