// flatshard/flat_param/quantized_gather.h — low-precision all-gathers: fp8 and int8 weights on
// the wire (FlatParamConfig::gather_dtype), and their wire formats as plain functions.
//
// Contract
// - A quantized gather is a GatherPlan (flat_param/collective_plan.h) chosen by
//   make_gather_plan() for a sharded, not offloaded unit whose gather_dtype is kFp8,
//   kFp8Delayed or kInt8.
//   gather() quantizes this rank's fp32 master shard into a byte buffer (the wire), all-gathers
//   it as ONE uint8 collective on the shard group, and dequantizes every rank's part into full()
//   in param_dtype. Forward and backward gathers are the same call; reductions are unchanged.
//   The master stays fp32 (optimizer, checkpoints and offload never see the wire).
// - fp8 (float8_e4m3fn, max 448): one fp32 scale per ORIGINAL parameter from its amax, the max
//   of |x| over the whole parameter, i.e. over its shards: one all-reduce(max) of a float vector
//   [number of parameters of the unit] on the shard group per gather (lane kAllGather), before
//   the all-gather. Every rank then holds every scale, so the wire carries the fp8 bytes only.
//   (fp8_delayed: Note [Delayed fp8 amax] below.)
// - Note [Delayed fp8 amax] (opt-in, gather dtype fp8_delayed; torchao's delayed scaling with
//   a history of one, made collective-free): the same fp8 format, but the scales come from
//   the amax the unit's PREVIOUS gather saw, so no all-reduce is needed: each rank sends its
//   local amax per parameter in front of its fp8 bytes, per rank [amax: 4 B per parameter |
//   fp8 data: shard_numel B | 0-3 B to a multiple of 4], and the max over the ranks of the
//   gathered amaxes is the next gather's (the same on every rank). The unit's first gather has
//   none yet: it all-reduces its amax as fp8 does (that one all-reduce is not in the closed
//   forms below, which are the steady state). A forward gather thus uses the amax of the
//   master before the last optimizer step (the previous backward's gather), a backward gather
//   the forward's (the master unchanged since: exact). A value above the amax used saturates
//   at +-448 * scale (the clamp), as with torchao's delayed scaling; a master that shrank keeps
//   the coarser scale for one gather. After a checkpoint load the first gather still uses the
//   last amax before it. The non-finite check reads the gathered amaxes (this gather's).
// - int8: block-wise symmetric (DeepSpeed ZeRO++ qwZ): the shard is cut into blocks of
//   kInt8BlockSize elements (the last one shorter), one fp32 scale per block. Per rank the wire
//   is [scales: 4 B per block | int8 data: shard_numel B | 0-3 B to a multiple of 4], so every
//   rank's scales start 4-byte aligned in the gathered buffer.
// - Formulas (the reference test, tests/quantized_gather_test.cpp, recomputes them in Python
//   with torch's own casts and checks bit for bit):
//     s = amax / Q, where Q = 448 (fp8) or 127 (int8), in fp32; s = 1 where amax == 0, and
//         s = FLT_MIN (2^-126) where amax / Q is below it (denormal amax: no subnormal or zero
//         scale, which flush-to-zero hardware would turn into inf; such values quantize
//         relative to FLT_MIN, their absolute error stays below FLT_MIN * Q / 2).
//     fp8:  q = clamp(x / s, -448, 448).to(float8_e4m3fn)
//     int8: q = clamp(round(x / s), -127, 127).to(int8)   (round half to even)
//     dequantized: (q.to(fp32) * s).to(param_dtype)
//   Padding (master zeros) goes on the wire as zeros and comes out as zeros.
// - Non-finite masters (inf or nan): an error, never a silent NaN spread into an optimizer
//   step. fp8: a non-finite local amax is sent as +inf, so after the all-reduce every rank sees
//   the same non-finite scale and throws the same c10::Error naming the unit and the
//   parameter. int8: the check reads the GATHERED scales, so every rank throws the same error,
//   naming the rank, the block and the parameters in it. On the CPU the check reads them on
//   the host and throws from the gather (unshard()).
// - Note [Deferred gather check]: on a device a host read per gather would be a stream
//   synchronisation per gather. There the gather instead records, on its own stream, the
//   first non-finite value's index and the count in a device tensor (the first gather that
//   saw one keeps it), copies it asynchronously into pinned host memory and records an event.
//   The plan is the unit's GatherCheck (flat_param/collective_plan.h; FlatParam::
//   gather_plan().extras().check): at the end of every backward pass the runtime (fsdp/runtime.cpp,
//   finalize_backward, after the step's state is closed) calls verify(), which waits for the
//   last gather's event (the all-gather stream up to that gather, not the device: one host
//   wait per backward pass instead of one per gather) and throws the same error, on every
//   rank, out of backward() — before the optimizer step. Until then the gathered buffer holds
//   what the wire made of the non-finite values (NaN or 0), and the forward, the backward and
//   the reductions of that step run on it. Gathers without a backward (evaluation under
//   no_grad) report at the next backward's end. After a report the record starts afresh.
// - Note [Quantize kernels]: on a CUDA master (flatshard built with nvcc,
//   FLATSHARD_WITH_CUDA_KERNELS) the quantize and dequantize are quantize_kernel.h's kernels,
//   enqueued on the gather's stream (the all-gather stream, as the rest of the plan): int8 one
//   launch each way, fp8 one per parameter part. The formulas above stay the one definition:
//   the kernels compute them rounding as ATen does (true fp32 division, rintf, RNE casts), and
//   the ATen ops below (the CPU path) are their reference, bit for bit (the GPU tests:
//   tests/gpu_quantized_gather_test.cpp compares a CUDA GPT's gathered buffers with the same
//   model's on CPU ranks, tests/quantize_kernel_check.py the kernels alone). fp8's amax stays an
//   ATen reduction per parameter part.
// - The fp8 plan keeps its last gather's per-parameter scales (GatherExtras::fp8_scales): an
//   fp8 matmul requantizes a gathered weight with its own scale and gets the wire's bytes back
//   (flat_param/gathered_scale.h).
// - Bytes: quantized_gather_bytes() is what one gather sends from this rank (the all-gather's
//   wire, plus fp8's amax all-reduce), the closed form the plan's bytes() equals
//   (make_gather_plan checks) and explain counts.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>

#include "flat_param/flat_param_config.h"
#include "flat_param/layout.h"

namespace flatshard {

class Communicator;
class GatherPlan;
struct GatherArgs;

constexpr int64_t kInt8BlockSize = 256;  // elements per int8 scale (qwZ uses 256 too)
constexpr double kFp8Max = 448.0;        // largest finite float8_e4m3fn
constexpr double kInt8Max = 127.0;       // symmetric: -128 is never used

// --- the wire formats, on 1-D fp32 tensors (CPU or the device) -------------------------------

// Scales from amax (fp32, any shape) for a format whose largest code is `qmax`: amax / qmax,
// 1 where amax is 0, FLT_MIN where amax / qmax is below it; non-finite amax stays non-finite.
at::Tensor scales_from_amax(const at::Tensor& amax, double qmax);
// fp8: `x` (fp32, 1-D) with one scale `s` (fp32, one element) -> float8_e4m3fn.
at::Tensor fp8_quantize(const at::Tensor& x, const at::Tensor& s);
// Back to `dtype`.
at::Tensor fp8_dequantize(const at::Tensor& q, const at::Tensor& s, at::ScalarType dtype);
// int8 blocks of `x` (fp32, 1-D, n elements): ceil(n / kInt8BlockSize).
int64_t int8_num_blocks(int64_t n);
// The block scales of `x` (fp32 [int8_num_blocks(n)]).
at::Tensor int8_block_scales(const at::Tensor& x);
// `x` with its block scales -> int8 [n].
at::Tensor int8_quantize(const at::Tensor& x, const at::Tensor& scales);
// Back to `dtype`, [n].
at::Tensor int8_dequantize(const at::Tensor& q, const at::Tensor& scales, at::ScalarType dtype);

// --- the plan ------------------------------------------------------------------------------

// Bytes one gather of a unit configured as `config` (a quantized gather_dtype, sharded) over
// `layout` sends from this rank; 0 for kParam (plans.cpp's all_gather_bytes counts it).
int64_t quantized_gather_bytes(const FlatParamConfig& config, const FlatLayout& layout);

// Device bytes one gather of such a unit allocates for its wire while it runs, every rank's
// part (0 for kParam): fp8 padded_numel; int8 world * its per-rank wire; fp8_delayed world *
// its per-rank wire plus padded_numel (the ranks' fp8 parts copied into one flat buffer).
// Besides these, a few bytes per parameter or block (amax, scales). One gather's at a time:
// the gathers run in order on the all-gather stream, which frees each wire as the next
// allocates. explain's memory breakdown counts the largest unit's (MemoryEstimate::wire_bytes).
int64_t quantized_wire_buffer_bytes(const FlatParamConfig& config, const FlatLayout& layout);

// The plan (named "Fp8AllGather" or "Int8AllGather") over `comm`, the shard group.
std::unique_ptr<GatherPlan> make_quantized_gather(const std::string& unit_name,
                                                  const FlatParamConfig& config,
                                                  const FlatLayout& layout, Communicator& comm,
                                                  GatherArgs args);

}  // namespace flatshard
