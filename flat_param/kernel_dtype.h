// flatshard/flat_param/kernel_dtype.h — the element types flatshard's CUDA kernels take (plain
// C++, no torch: included by the .cu files; flat_param/upcast.h maps at::ScalarType to it).
#pragma once

namespace flatshard {
namespace kernels {

enum class KernelDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

}  // namespace kernels
}  // namespace flatshard
