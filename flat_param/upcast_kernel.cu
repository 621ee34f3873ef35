// flatshard/flat_param/upcast_kernel.cu — bf16 -> fp32 conversion of a reduced gradient shard.
//
// Note [Vectorized upcast]: ATen converts bf16 to fp32 with its generic casting copy (one
// element per load, no vector loads): on an H200 it ran at about 0.9 TB/s, 2.7 ms per step for
// the 1B GPT's gradient shards, on the reduce-scatter stream beside backward compute — three
// times slower than ATen's own fp32 -> bf16 path. This kernel moves 8 elements per thread with
// 16-byte loads and two 16-byte stores. The conversion is exact (a bf16 is the top half of an
// fp32). Called only through flat_param/upcast.h, which checks dtype, contiguity and alignment.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace flatshard {
namespace kernels {

namespace {

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits16) {
  return __uint_as_float(bits16 << 16);
}

__global__ void bf16_to_fp32_kernel(const uint16_t* __restrict__ in, float* __restrict__ out,
                                    int64_t n) {
  const int64_t vecs = n / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const uint4* in8 = reinterpret_cast<const uint4*>(in);
  float4* out4 = reinterpret_cast<float4*>(out);
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs;
       v += stride) {
    const uint4 p = in8[v];
    out4[2 * v] = make_float4(bf16_bits_to_float(p.x & 0xFFFFu), bf16_bits_to_float(p.x >> 16),
                              bf16_bits_to_float(p.y & 0xFFFFu), bf16_bits_to_float(p.y >> 16));
    out4[2 * v + 1] =
        make_float4(bf16_bits_to_float(p.z & 0xFFFFu), bf16_bits_to_float(p.z >> 16),
                    bf16_bits_to_float(p.w & 0xFFFFu), bf16_bits_to_float(p.w >> 16));
  }
  // Tail (< 8 elements), by the first threads.
  const int64_t t = vecs * 8 + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < n) out[t] = bf16_bits_to_float(in[t]);
}

}  // namespace

// Returns the launch error (cudaSuccess when launched).
cudaError_t bf16_to_fp32(const void* in, float* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t vecs = (n + 7) / 8;
  // At most 1056 blocks (8 per SM of a 132-SM H100/H200, fewer SMs just queue them); the
  // grid-stride loop covers the rest.
  constexpr int64_t kMaxBlocks = 132 * 8;
  const int64_t blocks = std::min<int64_t>((vecs + kThreads - 1) / kThreads, kMaxBlocks);
  bf16_to_fp32_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<const uint16_t*>(in), out, n);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace flatshard
