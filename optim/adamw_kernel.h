// flatshard/optim/adamw_kernel.h — the one-pass AdamW CUDA kernel's interface (plain C++, no
// torch: included by optim/adamw_kernel.cu and optim/fused_adamw.cpp, which checks the tensors).
//
// Note [One-pass AdamW kernel]: ATen's `_fused_adamw_` updates an fp32 master and its two
// moments in one pass, but the compute-dtype copy a unit gathers from is a second pass over the
// master (read 4 B, write 2 B per element). ATen has no kernel that writes a copy. Measured on
// one H200 (benchmarks/RESULTS.md "Against PyTorch on one GPU", the 1B GPT as NO_SHARD units, 1
// seq): ATen's fused step 7.63 ms, plus 1.5 ms for a separate cast; this kernel, copy included,
// 7.53 ms. So this one writes it (Note [Compute copy in the step],
// optim/fused_adamw.h): it reads the gradient in its own dtype (fp32, bf16 or fp16), updates the
// master and both moments, and writes the copy — or no copy: ATen's fused step of a sharded
// unit's fp32 master (fp32 gradient, nothing else to write) took 7.74 ms for the 1B GPT per
// layer at 1 seq, this kernel 6.8 (RESULTS.md "Against PyTorch on one GPU"), so FusedAdamW
// sends every CUDA fp32 tensor of 1 Mi elements or more here (optim/fused_adamw.cpp). Per element it does what ATen's fused AdamW of
// torch 2.11 does, in its order and precision: all in float (the options rounded to float),
// the moments as two nested fused multiply-adds, the bias corrections from the device's powf of
// the float step count. Its results are then those of ATen's kernel followed by the cast, bit
// for bit (tests/gpu_parity_test.cpp checks it on the device; a first version with the moments
// in double differed in ~1% of elements by one ulp). A torch upgrade that changes ATen's order
// shows there, and FLATSHARD_ADAMW_KERNEL=0 is the fallback.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "flat_param/kernel_dtype.h"

namespace flatshard {
namespace kernels {

struct AdamwStep {
  float lr, beta1, beta2, weight_decay, eps;  // the group's options, rounded to float
  float step;                                 // the step count after this step
};

// One tensor of n elements: param fp32; exp_avg, exp_avg_sq of `moment_dtype` (fp32, or bf16:
// Note [Low-precision moments], optim/fused_adamw.h); grad of `grad_dtype`; copy of
// `copy_dtype` (bf16 or fp16), or null: no copy (a bf16 / fp16 gradient read as it is, Note
// [Low-precision master gradient], flat_param/collective_plan.h). Enqueued on `stream`; returns
// the launch error.
cudaError_t adamw_step_with_copy(float* param, const void* grad, KernelDtype grad_dtype,
                                 void* exp_avg, void* exp_avg_sq, KernelDtype moment_dtype,
                                 void* copy, KernelDtype copy_dtype, int64_t n,
                                 const AdamwStep& step, cudaStream_t stream);

}  // namespace kernels
}  // namespace flatshard
