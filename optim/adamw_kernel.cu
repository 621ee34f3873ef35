// flatshard/optim/adamw_kernel.cu — Note [One-pass AdamW kernel] (optim/adamw_kernel.h).
#include "optim/adamw_kernel.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace flatshard {
namespace kernels {

namespace {

template <KernelDtype D>
struct Storage {
  using T = uint16_t;  // bf16 and fp16: their bits
};
template <>
struct Storage<KernelDtype::kFloat32> {
  using T = float;
};

template <KernelDtype D>
__device__ __forceinline__ float to_float(typename Storage<D>::T x) {
  if constexpr (D == KernelDtype::kFloat32) {
    return x;
  } else if constexpr (D == KernelDtype::kBFloat16) {
    return __uint_as_float(static_cast<uint32_t>(x) << 16);  // exact
  } else {
    return __half2float(__ushort_as_half(x));
  }
}

// Round to nearest even, as ATen's casts do.
template <KernelDtype D>
__device__ __forceinline__ uint16_t from_float(float x) {
  if constexpr (D == KernelDtype::kBFloat16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  } else {
    return __half_as_ushort(__float2half_rn(x));
  }
}

// One element, as ATen's fused AdamW (ADAMW mode, no amsgrad, no maximize, no grad scale):
// float throughout; `bc1` and `bc2_sqrt` are the bias corrections of this step.
__device__ __forceinline__ void adamw(float& param, float grad, float& exp_avg, float& exp_avg_sq,
                                      const AdamwStep& s, float bc1, float bc2_sqrt) {
  if (s.weight_decay != 0) param -= s.lr * s.weight_decay * param;
  exp_avg = fmaf(s.beta1, exp_avg, fmaf(-s.beta1, grad, grad));
  const float g2 = grad * grad;
  exp_avg_sq = fmaf(s.beta2, exp_avg_sq, fmaf(-s.beta2, g2, g2));
  const float step_size = s.lr / bc1;
  const float denom = (sqrtf(exp_avg_sq) / bc2_sqrt) + s.eps;
  param -= step_size * exp_avg / denom;
}

template <typename T>
struct alignas(4 * sizeof(T)) Vec4 {
  T x[4];
};

// Four elements per thread with vector loads when `vec` (every pointer aligned to its 4-element
// vector), one otherwise; a grid-stride loop. kCopy false: no copy (`copy` is null). M: the
// moments' storage (fp32, or bf16: Note [Low-precision moments], optim/fused_adamw.h — read
// exactly as fp32, updated in fp32, rounded to nearest even when stored).
template <KernelDtype G, KernelDtype C, KernelDtype M, bool kCopy>
__global__ void adamw_kernel(float* __restrict__ param, const typename Storage<G>::T* __restrict__ grad,
                             typename Storage<M>::T* __restrict__ exp_avg,
                             typename Storage<M>::T* __restrict__ exp_avg_sq,
                             uint16_t* __restrict__ copy, int64_t n, AdamwStep s, bool vec) {
  using GT = typename Storage<G>::T;
  using MT = typename Storage<M>::T;
  auto store = [](float x) -> MT {
    if constexpr (M == KernelDtype::kFloat32) {
      return x;
    } else {
      return from_float<M>(x);
    }
  };
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // As ATen's: from the device's powf, per thread (a few instructions).
  const float bc1 = 1 - powf(s.beta1, s.step);
  const float bc2_sqrt = sqrtf(1 - powf(s.beta2, s.step));
  int64_t done = 0;
  if (vec) {
    const int64_t vecs = n / 4;
    for (int64_t i = first; i < vecs; i += stride) {
      Vec4<float> p = reinterpret_cast<const Vec4<float>*>(param)[i];
      const Vec4<GT> g = reinterpret_cast<const Vec4<GT>*>(grad)[i];
      Vec4<MT> m = reinterpret_cast<const Vec4<MT>*>(exp_avg)[i];
      Vec4<MT> v = reinterpret_cast<const Vec4<MT>*>(exp_avg_sq)[i];
      Vec4<uint16_t> c;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float mf = to_float<M>(m.x[k]), vf = to_float<M>(v.x[k]);
        adamw(p.x[k], to_float<G>(g.x[k]), mf, vf, s, bc1, bc2_sqrt);
        m.x[k] = store(mf);
        v.x[k] = store(vf);
        if constexpr (kCopy) c.x[k] = from_float<C>(p.x[k]);
      }
      reinterpret_cast<Vec4<float>*>(param)[i] = p;
      reinterpret_cast<Vec4<MT>*>(exp_avg)[i] = m;
      reinterpret_cast<Vec4<MT>*>(exp_avg_sq)[i] = v;
      if constexpr (kCopy) reinterpret_cast<Vec4<uint16_t>*>(copy)[i] = c;
    }
    done = vecs * 4;
  }
  for (int64_t i = done + first; i < n; i += stride) {
    float p = param[i], m = to_float<M>(exp_avg[i]), v = to_float<M>(exp_avg_sq[i]);
    adamw(p, to_float<G>(grad[i]), m, v, s, bc1, bc2_sqrt);
    param[i] = p;
    exp_avg[i] = store(m);
    exp_avg_sq[i] = store(v);
    if constexpr (kCopy) copy[i] = from_float<C>(p);
  }
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

size_t element_size(KernelDtype d) { return d == KernelDtype::kFloat32 ? 4 : 2; }

template <KernelDtype G, KernelDtype C, KernelDtype M, bool kCopy>
void launch(float* param, const void* grad, void* exp_avg, void* exp_avg_sq, void* copy,
            int64_t n, const AdamwStep& s, cudaStream_t stream) {
  using MT = typename Storage<M>::T;
  constexpr int kThreads = 256;
  // As the upcast kernel (flat_param/upcast_kernel.cu): at most 8 blocks per SM of a 132-SM
  // H200; the grid-stride loop covers the rest.
  constexpr int64_t kMaxBlocks = 132 * 8;
  const bool vec = aligned(param, 16) && aligned(exp_avg, 4 * element_size(M)) &&
                   aligned(exp_avg_sq, 4 * element_size(M)) &&
                   aligned(grad, 4 * element_size(G)) && aligned(copy, 8);
  const int64_t items = vec ? (n + 3) / 4 : n;
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>((items + kThreads - 1) / kThreads, kMaxBlocks));
  adamw_kernel<G, C, M, kCopy><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      param, static_cast<const typename Storage<G>::T*>(grad), static_cast<MT*>(exp_avg),
      static_cast<MT*>(exp_avg_sq), static_cast<uint16_t*>(copy), n, s, vec);
}

// The moments' dtype, then the copy's (or its absence), pick the instance for gradients of G.
template <KernelDtype G, KernelDtype M>
void launch_for_moments(float* param, const void* grad, void* exp_avg, void* exp_avg_sq,
                        void* copy, KernelDtype copy_dtype, int64_t n, const AdamwStep& s,
                        cudaStream_t stream) {
  if (copy == nullptr) {
    launch<G, KernelDtype::kBFloat16, M, false>(param, grad, exp_avg, exp_avg_sq, copy, n, s,
                                                stream);
  } else if (copy_dtype == KernelDtype::kBFloat16) {
    launch<G, KernelDtype::kBFloat16, M, true>(param, grad, exp_avg, exp_avg_sq, copy, n, s,
                                               stream);
  } else {
    launch<G, KernelDtype::kFloat16, M, true>(param, grad, exp_avg, exp_avg_sq, copy, n, s,
                                              stream);
  }
}

template <KernelDtype G>
void launch_for_grad(float* param, const void* grad, void* exp_avg, void* exp_avg_sq,
                     KernelDtype moment_dtype, void* copy, KernelDtype copy_dtype, int64_t n,
                     const AdamwStep& s, cudaStream_t stream) {
  if (moment_dtype == KernelDtype::kBFloat16) {
    launch_for_moments<G, KernelDtype::kBFloat16>(param, grad, exp_avg, exp_avg_sq, copy,
                                                  copy_dtype, n, s, stream);
  } else {
    launch_for_moments<G, KernelDtype::kFloat32>(param, grad, exp_avg, exp_avg_sq, copy,
                                                 copy_dtype, n, s, stream);
  }
}

}  // namespace

cudaError_t adamw_step_with_copy(float* param, const void* grad, KernelDtype grad_dtype,
                                 void* exp_avg, void* exp_avg_sq, KernelDtype moment_dtype,
                                 void* copy, KernelDtype copy_dtype, int64_t n,
                                 const AdamwStep& step, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  if (copy != nullptr && copy_dtype == KernelDtype::kFloat32) return cudaErrorInvalidValue;
  if (moment_dtype == KernelDtype::kFloat16) return cudaErrorInvalidValue;
  switch (grad_dtype) {
    case KernelDtype::kFloat32:
      launch_for_grad<KernelDtype::kFloat32>(param, grad, exp_avg, exp_avg_sq, moment_dtype, copy,
                                             copy_dtype, n, step, stream);
      break;
    case KernelDtype::kBFloat16:
      launch_for_grad<KernelDtype::kBFloat16>(param, grad, exp_avg, exp_avg_sq, moment_dtype,
                                              copy, copy_dtype, n, step, stream);
      break;
    case KernelDtype::kFloat16:
      launch_for_grad<KernelDtype::kFloat16>(param, grad, exp_avg, exp_avg_sq, moment_dtype, copy,
                                             copy_dtype, n, step, stream);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace kernels
}  // namespace flatshard
