// flatshard/flat_param/range_copy_kernel.cu — Note [Range copies] (range_copy_kernel.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "flat_param/range_copy_kernel.h"

namespace flatshard {
namespace kernels {

namespace {

struct Ranges {
  RangeCopy r[kMaxRangesPerLaunch];
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

// Blocks blockIdx.x of gridDim.x stride over the range's elements, kVec per thread when both
// pointers are aligned for it.
template <KernelDtype S, KernelDtype D>
__device__ void copy_range(const RangeCopy& r) {
  using ST = typename Store<S>::T;
  using DT = typename Store<D>::T;
  const ST* src = static_cast<const ST*>(r.src);
  DT* dst = static_cast<DT*>(r.dst);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(src) % sizeof(Vec<ST, kVec>) == 0 &&
      reinterpret_cast<uintptr_t>(dst) % sizeof(Vec<DT, kVec>) == 0) {
    const int64_t vecs = r.n / kVec;
    const auto* s4 = reinterpret_cast<const Vec<ST, kVec>*>(src);
    auto* d4 = reinterpret_cast<Vec<DT, kVec>*>(dst);
    for (int64_t i = first; i < vecs; i += stride) {
      const Vec<ST, kVec> in = s4[i];
      Vec<DT, kVec> out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) out.v[k] = convert<S, D>(in.v[k]);
      d4[i] = out;
    }
    done = vecs * kVec;
  }
  for (int64_t i = done + first; i < r.n; i += stride) dst[i] = convert<S, D>(src[i]);
}

template <KernelDtype D>
__device__ void zero_range(const RangeCopy& r) {
  using DT = typename Store<D>::T;
  DT* dst = static_cast<DT*>(r.dst);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(dst) % sizeof(Vec<DT, kVec>) == 0) {
    const int64_t vecs = r.n / kVec;
    auto* d4 = reinterpret_cast<Vec<DT, kVec>*>(dst);
    const Vec<DT, kVec> zero{};
    for (int64_t i = first; i < vecs; i += stride) d4[i] = zero;
    done = vecs * kVec;
  }
  for (int64_t i = done + first; i < r.n; i += stride) dst[i] = DT(0);
}

template <KernelDtype S>
__device__ void copy_from(const RangeCopy& r) {
  switch (r.dst_dtype) {
    case KernelDtype::kFloat32:
      return copy_range<S, KernelDtype::kFloat32>(r);
    case KernelDtype::kBFloat16:
      return copy_range<S, KernelDtype::kBFloat16>(r);
    case KernelDtype::kFloat16:
      return copy_range<S, KernelDtype::kFloat16>(r);
  }
}

// blockIdx.y: the range; every range's blocks exit once its elements are done.
__global__ void __launch_bounds__(kThreads) copy_ranges_kernel(const Ranges ranges) {
  const RangeCopy& r = ranges.r[blockIdx.y];
  if (r.src == nullptr) {
    switch (r.dst_dtype) {
      case KernelDtype::kFloat32:
        return zero_range<KernelDtype::kFloat32>(r);
      case KernelDtype::kBFloat16:
        return zero_range<KernelDtype::kBFloat16>(r);
      case KernelDtype::kFloat16:
        return zero_range<KernelDtype::kFloat16>(r);
    }
    return;
  }
  switch (r.src_dtype) {
    case KernelDtype::kFloat32:
      return copy_from<KernelDtype::kFloat32>(r);
    case KernelDtype::kBFloat16:
      return copy_from<KernelDtype::kBFloat16>(r);
    case KernelDtype::kFloat16:
      return copy_from<KernelDtype::kFloat16>(r);
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
  int64_t most = 0;
  int used = 0;
  for (int i = 0; i < count; ++i) {
    const RangeCopy& r = ranges[i];
    if (r.n < 0 || (r.n > 0 && r.dst == nullptr) || !known(r.dst_dtype) ||
        (r.src != nullptr && !known(r.src_dtype)))
      return cudaErrorInvalidValue;
    if (r.n == 0) continue;
    arg.r[used++] = r;
    most = std::max(most, r.n);
  }
  if (used == 0) return cudaSuccess;
  // Enough blocks for the largest range at kVec elements per thread, at most ~8 per SM of a
  // 132-SM H200 over all ranges (the grid-stride loops cover the rest).
  const int64_t want = (most + kThreads * kVec - 1) / (kThreads * kVec);
  const int64_t cap = std::max<int64_t>(8, (132 * 8) / used);
  const dim3 grid(static_cast<unsigned>(std::min(want, cap)), static_cast<unsigned>(used));
  copy_ranges_kernel<<<grid, kThreads, 0, stream>>>(arg);
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace flatshard
