// flatshard/flat_param/range_copy_kernel.cu — Note [Range copies] (range_copy_kernel.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "flat_param/range_copy_kernel.h"

namespace flatshard {
namespace kernels {

namespace {

// The ranges, and per range the index of its first block: range i has blocks
// [first_block[i], first_block[i + 1]), one per kChunk elements (Note [Range copies]'s blocks).
struct Ranges {
  RangeCopy r[kMaxRangesPerLaunch];
  int64_t first_block[kMaxRangesPerLaunch + 1];
  int count;
};

// Storage types: 16-bit values move as their bits.
template <KernelDtype D>
struct Store;
template <>
struct Store<KernelDtype::kFloat32> {
  using T = float;
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float v) { return v; }
};
template <>
struct Store<KernelDtype::kBFloat16> {
  using T = uint16_t;
  static __device__ __forceinline__ float to_float(uint16_t v) {
    return __uint_as_float(static_cast<uint32_t>(v) << 16);  // exact, as c10::BFloat16
  }
  static __device__ __forceinline__ uint16_t from_float(float v) {
    return __bfloat16_as_ushort(__float2bfloat16(v));  // c10::BFloat16(float) on sm_80+
  }
};
template <>
struct Store<KernelDtype::kFloat16> {
  using T = uint16_t;
  static __device__ __forceinline__ float to_float(uint16_t v) {
    return __half2float(__ushort_as_half(v));
  }
  static __device__ __forceinline__ uint16_t from_float(float v) {
    return __half_as_ushort(__float2half(v));  // c10::Half(float) on the device
  }
};

template <KernelDtype S, KernelDtype D>
__device__ __forceinline__ typename Store<D>::T convert(typename Store<S>::T v) {
  if constexpr (S == D) {
    return v;  // the bits, NaN payloads included (ATen's same-dtype copy is a memcpy)
  } else {
    return Store<D>::from_float(Store<S>::to_float(v));
  }
}

template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

constexpr int kThreads = 256;
constexpr int kVec = 4;
// Elements per block: 4 vectors per thread. Blocks are given to ranges by their size, so a
// unit's few large parameters get all the blocks they can use beside its many small ones. A
// grid of a fixed block count per range left the large ranges at ~2.7 blocks per SM: the 1B
// GPT's per-layer step spent 6.36 ms in this kernel, 4.11 ms with blocks by size (one H200, 4
// seq; benchmarks/RESULTS.md "Against PyTorch on one GPU").
constexpr int64_t kChunk = int64_t{kThreads} * kVec * 4;

// This block's part [begin, begin + n) of the range, kVec elements per thread when both
// pointers are aligned for it (a chunk starts kChunk elements after another: aligned alike).
template <KernelDtype S, KernelDtype D>
__device__ void copy_range(const RangeCopy& r, int64_t begin, int64_t n) {
  using ST = typename Store<S>::T;
  using DT = typename Store<D>::T;
  const ST* src = static_cast<const ST*>(r.src) + begin;
  DT* dst = static_cast<DT*>(r.dst) + begin;
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(src) % sizeof(Vec<ST, kVec>) == 0 &&
      reinterpret_cast<uintptr_t>(dst) % sizeof(Vec<DT, kVec>) == 0) {
    const int64_t vecs = n / kVec;
    const auto* s4 = reinterpret_cast<const Vec<ST, kVec>*>(src);
    auto* d4 = reinterpret_cast<Vec<DT, kVec>*>(dst);
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
      const Vec<ST, kVec> in = s4[i];
      Vec<DT, kVec> out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) out.v[k] = convert<S, D>(in.v[k]);
      d4[i] = out;
    }
    done = vecs * kVec;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) dst[i] = convert<S, D>(src[i]);
}

template <KernelDtype D>
__device__ void zero_range(const RangeCopy& r, int64_t begin, int64_t n) {
  using DT = typename Store<D>::T;
  DT* dst = static_cast<DT*>(r.dst) + begin;
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(dst) % sizeof(Vec<DT, kVec>) == 0) {
    const int64_t vecs = n / kVec;
    auto* d4 = reinterpret_cast<Vec<DT, kVec>*>(dst);
    const Vec<DT, kVec> zero{};
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) d4[i] = zero;
    done = vecs * kVec;
  }
  for (int64_t i = done + threadIdx.x; i < n; i += blockDim.x) dst[i] = DT(0);
}

template <KernelDtype S>
__device__ void copy_from(const RangeCopy& r, int64_t begin, int64_t n) {
  switch (r.dst_dtype) {
    case KernelDtype::kFloat32:
      return copy_range<S, KernelDtype::kFloat32>(r, begin, n);
    case KernelDtype::kBFloat16:
      return copy_range<S, KernelDtype::kBFloat16>(r, begin, n);
    case KernelDtype::kFloat16:
      return copy_range<S, KernelDtype::kFloat16>(r, begin, n);
  }
}

// Block b copies chunk b - first_block[i] of the range i whose blocks hold b.
__global__ void __launch_bounds__(kThreads) copy_ranges_kernel(const Ranges ranges) {
  const int64_t b = blockIdx.x;
  int i = 0;
  while (i + 1 < ranges.count && ranges.first_block[i + 1] <= b) ++i;
  const RangeCopy& r = ranges.r[i];
  const int64_t begin = (b - ranges.first_block[i]) * kChunk;
  const int64_t n = r.n - begin < kChunk ? r.n - begin : kChunk;
  if (r.src == nullptr) {
    switch (r.dst_dtype) {
      case KernelDtype::kFloat32:
        return zero_range<KernelDtype::kFloat32>(r, begin, n);
      case KernelDtype::kBFloat16:
        return zero_range<KernelDtype::kBFloat16>(r, begin, n);
      case KernelDtype::kFloat16:
        return zero_range<KernelDtype::kFloat16>(r, begin, n);
    }
    return;
  }
  switch (r.src_dtype) {
    case KernelDtype::kFloat32:
      return copy_from<KernelDtype::kFloat32>(r, begin, n);
    case KernelDtype::kBFloat16:
      return copy_from<KernelDtype::kBFloat16>(r, begin, n);
    case KernelDtype::kFloat16:
      return copy_from<KernelDtype::kFloat16>(r, begin, n);
  }
}

bool known(KernelDtype d) {
  return d == KernelDtype::kFloat32 || d == KernelDtype::kBFloat16 || d == KernelDtype::kFloat16;
}

}  // namespace

cudaError_t copy_ranges(const RangeCopy* ranges, int count, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  if (count > kMaxRangesPerLaunch) return cudaErrorInvalidValue;
  Ranges arg{};
  int used = 0;
  int64_t blocks = 0;
  for (int i = 0; i < count; ++i) {
    const RangeCopy& r = ranges[i];
    if (r.n < 0 || (r.n > 0 && r.dst == nullptr) || !known(r.dst_dtype) ||
        (r.src != nullptr && !known(r.src_dtype)))
      return cudaErrorInvalidValue;
    if (r.n == 0) continue;
    arg.r[used] = r;
    arg.first_block[used++] = blocks;
    blocks += (r.n + kChunk - 1) / kChunk;
  }
  if (used == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;  // 8.8e12 elements: not a unit
  arg.first_block[used] = blocks;
  arg.count = used;
  copy_ranges_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(arg);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace flatshard
