// flatshard/optim/fused_adamw.h — AdamW whose step is one fused ATen kernel per device and dtype.
//
// Why: torch::optim::AdamW (the C++ API) updates one parameter at a time with about ten
// element-wise kernels each (decay, two moment updates, sqrt, divide, add, addcdiv), reading and
// writing every element several times: on the 1B GPT's fp32 master shards that is ~10 ms of a
// ~117 ms step on an H200 (benchmarks/history.md). ATen's `_fused_adamw_` (the kernel behind
// PyTorch's `AdamW(fused=True)`) reads parameter, gradient and both moments once and writes
// three of them once. flatshard's flat master shards make the lists short: one tensor per unit.
//
// Contract
// - A drop-in torch::optim::AdamW: same options, same AdamWParamState (so checkpoints, state_dict
//   and the optimizer checks see an AdamW), same update rule (decoupled weight decay, bias
//   correction), equal to AdamW's result up to float rounding.
// - step() groups the parameters that have a gradient by (device, dtype) within each parameter
//   group and calls `_fused_adamw_` once per group. The step count stays the int64 in
//   AdamWParamState; the kernel reads it from a float tensor made per step on the device.
// - Falls back to AdamW::step() for what the fused kernel does not do: amsgrad, sparse
//   gradients, closures.
// - Works on CPU and CUDA (ATen has both kernels).
// - Stepping part of the parameters early (Note [Offload step in backward],
//   fsdp/offload_step.h): step_params(ps) steps exactly `ps` (each must be one of the
//   optimizer's parameters) with their groups' options, as step() would, and marks them; the
//   next step() first runs the wait set by set_before_step() (the early steps still running on
//   another thread finish), then steps only the unmarked parameters and clears the marks. The
//   result is the same, bit for bit, as one step() over all: the kernel is element-wise, so
//   which list a tensor is in changes nothing. A marked parameter whose gradient was written
//   after its early step (clipping, unscaling: its version moved) makes step() throw, naming
//   it: that write came too late to count. step_params() and step() must not run concurrently.
// - A step captured now and run later (Note [Delayed offload step], fsdp/offload_step.h):
//   capture_step(ps) takes what a step of `ps` reads from state the caller may change next —
//   each tensor's gradient and its group's options (zero_grad, a scheduler's learning rate) —
//   and run_step() steps them with those, on any thread: the state map is locked while a step
//   finds or makes its entries, so run_step() may run beside step() and other run_step() calls
//   over other tensors. The result is step_params()'s.
// - Note [Host compute copy] (flat_param/collective_plan.h): a captured step may read a
//   gradient of a lower floating dtype than its parameter (bf16 straight from the device) and
//   write a compute-dtype copy of the updated parameter (what goes up to the device) in the
//   same step. On the CPU it runs per block of 4 Mi elements, three parallel passes each (the
//   gradient upcast into an fp32 scratch block kept between steps, the fused kernel, the cast
//   into the copy), the block still in the host's cache for the later passes: memory sees the
//   bf16 gradient read and the bf16 copy written instead of an fp32 gradient download and a
//   device cast. The values are those of stepping with the upcast gradient (exact) and casting
//   after: bit for bit (tests/fused_adamw_test.cpp). Elsewhere (CUDA tensors) the same,
//   unblocked. benchmarks/fused_adamw_bench.cpp times it against the fp32 step.
// - Note [Compute copy in the step]: a unit that keeps a compute-dtype copy of its master on the
//   device between gathers (a NO_SHARD unit below fp32: its full(); a sharded unit with
//   ShardingOptions::keep_compute_shard: its kept shard, Note [Kept compute shard],
//   flat_param/collective_plan.h; a StepCopy, its gather plan's extras().step) casts the master
//   into it only when the master changed since. set_compute_copies() hands this optimizer those
//   copies (flatshard::attach in optim/attach.h does, which ShardedModel::attach_optimizer
//   forwards to, unless FLATSHARD_STEP_COMPUTE_COPY=0): step() then writes each copy in the
//   same pass as its parameter's update — on CUDA flatshard's one-pass kernel (Note [One-pass AdamW kernel],
//   optim/adamw_kernel.h), elsewhere the fused kernel then a cast, per block on the CPU — when
//   its set's current() says the copies hold the parameters as they are before the step, and
//   calls the set's written() after; otherwise the copies are left for the gather to recast.
//   The copy is what the gather's cast would have written: bit for bit on CPU ranks
//   (tests/fused_adamw_test.cpp); on the GPU the kernel is checked against ATen's fused AdamW
//   and cast (tests/gpu_parity_test.cpp). A step that falls back to AdamW::step() (amsgrad,
//   sparse, a closure) writes no copy; the gather then recasts.
// - Note [Low-precision master gradient] (flat_param/collective_plan.h): a bf16 / fp16 gradient
//   of an fp32 parameter, with or without a copy, is read as it is — on CUDA by the one-pass
//   kernel (no fp32 gradient is made), elsewhere upcast per block as above — and the result is
//   the fp32 gradient's, bit for bit (the upcast is exact).
// - Note [Low-precision moments]: opt-in, set_moments_dtype(at::kBFloat16): the two AdamW
//   moments of fp32 parameters are stored in bf16 (8 B per parameter instead of 16; the step
//   reads and writes 8 B less per parameter). Each step reads them exactly as fp32, updates in
//   fp32 as ATen's fused AdamW does, and rounds them to nearest even when it stores them — on
//   CUDA inside the one-pass kernel, elsewhere by an upcast, ATen's fused step and a cast: the
//   same values bit for bit (tests/fused_adamw_test.cpp on CPU, tests/gpu_parity_test.cpp on
//   the device). Numerics: the moments carry 8 significant bits. The second moment's range is
//   fp32's (bf16 has its exponent), so nothing underflows that fp32 would keep, but each
//   update's relative change below 2^-9 rounds away; the first moment's averaging over ~1 /
//   (1 - beta1) steps likewise. Users of bf16 AdamW state (e.g. torchao's low-bit optimizers)
//   report loss curves within noise of fp32 state for LLM pre-training; flatshard-bench
//   --adamw-moments bf16 measures it against the fp32 default on the same model. State made
//   or loaded in another dtype is converted at the next step; checkpoints save the moments as
//   fp32 of equal value (checkpoint/optimizer_state.cpp), so a resumed run continues bit for bit
//   (tests/checkpoint_test.cpp). The parameter and the master stay fp32.
#pragma once

#include <torch/optim/adamw.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace flatshard {

class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;

  // Steps exactly `params` now (see the contract). Throws c10::Error for a tensor that is not
  // one of this optimizer's parameters, and where step() would fall back (amsgrad, sparse).
  void step_params(const std::vector<at::Tensor>& params);
  // Note [Low-precision moments] (see the contract): kFloat (default) or kBFloat16, for the
  // moments of fp32 parameters from the next step on. Throws c10::Error for another dtype.
  void set_moments_dtype(at::ScalarType dtype);
  at::ScalarType moments_dtype() const { return moments_dtype_; }
  // Called at the start of every step() (empty: nothing), e.g. to wait for early steps.
  void set_before_step(std::function<void()> wait) { before_step_ = std::move(wait); }

  struct CapturedStep {
    struct Group {
      torch::optim::AdamWOptions options;
      std::vector<at::Tensor> params, grads;  // params with a gradient, in group order
      std::vector<int64_t> versions;          // each gradient's version when captured
      // Empty, or per param: where the step writes its updated value in the compute dtype
      // (undefined: nowhere). Note [Host compute copy].
      std::vector<at::Tensor> copies;
    };
    std::vector<Group> groups;
  };
  // Same checks as step_params().
  CapturedStep capture_step(const std::vector<at::Tensor>& params) const;
  // A parameter with the index of its group in param_groups(); located() finds them once, so
  // capture_located() costs the listed tensors only, not a walk over every group (it runs per
  // unit per step, on the thread that issues the device's work).
  struct Located {
    size_t group;
    at::Tensor param;
  };
  std::vector<Located> located(const std::vector<at::Tensor>& params) const;
  // capture_step() of located(params)'s result, in group order (as located() returns it).
  // `grad_of` (optional) gives the gradient a parameter steps with instead of its .grad (a
  // floating dtype no wider than the parameter's; undefined: the parameter is not stepped),
  // `copy_of` (optional) the tensor its compute-dtype copy goes to (Note [Host compute copy]).
  using TensorOf = std::function<at::Tensor(const at::Tensor& param)>;
  CapturedStep capture_located(const std::vector<Located>& params, const TensorOf& grad_of = {},
                               const TensorOf& copy_of = {}) const;
  void run_step(const CapturedStep& step);
  // After run_step(step), as step_params() does: marks its tensors stepped early, so the next
  // step() skips them and throws if a gradient's version moved since the capture by more than
  // `own_writes` (in-place writes the caller itself made to each since: a staged addition).
  void mark_stepped_early(const CapturedStep& step, int64_t own_writes);

  // Note [Compute copy in the step] (see the contract). One set per unit.
  struct ComputeCopies {
    // (one of this optimizer's parameters, or a tensor it may hold; its copy: same element
    // count and device, a floating dtype narrower than the parameter's).
    std::vector<std::pair<at::Tensor, at::Tensor>> tensors;
    std::function<bool()> current;  // the copies hold their parameters' values as they are now
    std::function<void()> written;  // a step wrote them: they hold the new values
  };
  // Replaces the sets given before. Throws c10::Error for a pair that does not match.
  void set_compute_copies(std::vector<ComputeCopies> sets);

 private:
  // One fused pass over the parameters of each group that have a gradient and for which
  // `take` (nullptr: all) returns true.
  void fused_step(const std::function<bool(const at::Tensor&)>& take);
  // One fused pass per (device, dtype) over `params` (each with its gradient in `grads`).
  // `copies`: empty, or per param (Note [Host compute copy], Note [Compute copy in the step]).
  void step_lists(const torch::optim::AdamWOptions& o, const std::vector<at::Tensor>& params,
                  const std::vector<at::Tensor>& grads,
                  const std::vector<at::Tensor>& copies = {});

  // The moments' dtype for parameter `p`: moments_dtype_ for fp32, else p's own.
  at::ScalarType moments_dtype_for(const at::Tensor& p) const;
  at::ScalarType moments_dtype_ = at::kFloat;
  // Parameters stepped by step_params() since the last step(), with their gradient's version
  // at that moment.
  std::unordered_map<const c10::TensorImpl*, int64_t> stepped_early_;
  std::function<void()> before_step_;
  std::mutex state_mu_;  // state_'s lookups and insertions (run_step() beside step())
  // Note [Host compute copy]: the fp32 block an upcast gradient goes through, kept between
  // steps (a fresh 16 MiB allocation per unit per step would fault its pages in each time).
  at::Tensor mixed_scratch_;
  std::mutex scratch_mu_;
  // Note [Compute copy in the step]: the sets, and per parameter its set and copy.
  std::vector<ComputeCopies> copy_sets_;
  std::unordered_map<const c10::TensorImpl*, std::pair<size_t, at::Tensor>> copy_of_;
};

}  // namespace flatshard
