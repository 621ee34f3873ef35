// flatshard/fsdp/cuda_graph.h — the forward and backward of a training step as one CUDA graph.
//
//   flatshard::CudaGraphStep step(*fsdp, {x0, y0}, [&](const std::vector<at::Tensor>& in) {
//     return flatshard::enter(model, [&] { return model->loss(in[0], in[1]); });
//   });
//   for (...) {
//     opt.zero_grad();
//     at::Tensor loss = step.run({x, y});  // copies x, y in; forward + backward
//     opt.step();                          // eager, as always
//   }
//
// Note [CUDA graph step]
// With per-leaf units a step is hundreds of hooks whose host time, not the GPU, sets the pace at
// small batches (issue 54: 64-86 us per leaf unit on an H200). A CUDA graph replays the whole
// forward + backward — every kernel and every stream dependency the hooks queued — with one
// launch and none of the host work. What is captured and what is not:
// - Captured: the closure (forward and loss) and loss.backward(): the gathers (none at world 1:
//   in place), the gradients' reduction into the fp32 master gradients, the reshards, the
//   end-of-backward wait. The optimizer is NOT captured: it runs eagerly after run(), so its
//   step count, learning rate and schedulers stay host values that change every step (a captured
//   FusedAdamW would freeze them). Clipping likewise runs eagerly after run()
//   (clip_grad_norm_'s host read of the norm stays outside the graph). A gradient scaler
//   (fsdp/grad_scaler.h) does not fit: its scale multiplies the loss inside the captured
//   backward, so every replay would use the scale of the capture (flatshard-bench refuses
//   --cuda-graph with fp16).
// - Warmup: the first `warmup_steps` run() calls are ordinary eager steps, on the graph's side
//   stream (cuBLAS workspaces and the runtime's first-step state exist before the capture, as
//   PyTorch's torch.cuda.graph requires); the next run() captures, then replays at once; every
//   later run() only replays. Every call is a real step: same values as eager.
// - Inputs: the tensors passed to the constructor become the graph's static inputs (cloned);
//   run() copies its inputs into them, after checking each against the captured shape, dtype
//   and device (a graph replays fixed shapes: a different shape is an error naming the input
//   and both shapes; build a new CudaGraphStep for it).
// - Gradients: the capture starts with every master gradient unset, so the captured reduction
//   writes a fresh master gradient (never adds): each run() SETS the gradients, as after
//   zero_grad(). Accumulating over several run() calls is not supported. After each replay the
//   master gradients are pointed at the graph's output buffers again, so zero_grad() in either
//   form (set to none or zero-filled) between steps works.
// - Streams: the capture stream forks the runtime's all-gather and reduce streams at its start
//   and joins them at its end (CUDA refuses a capture with side-stream work not joined back:
//   the reshards' waits on the all-gather stream would be such work). The graph runs on that
//   side stream, ordered after the caller's current stream (the input copies, the last
//   optimizer step) and the caller's stream waits for it before run() returns: no host sync.
//   Autograd runs an AccumulateGrad node on the stream current when the node was made, and the
//   units keep their parameters' nodes alive from fully_shard on (usually made on the default
//   stream, which a capture may not touch: PyTorch warns of exactly this mismatch), so the
//   constructor has every unit make them anew on the graph's stream
//   (Unit::rehook_grad_accumulators), warning naming a parameter whose node a live
//   graph of an earlier step still holds on another stream.
// - Host state: the hooks run once, during the capture, and leave the runtime at the end of a
//   step (units resharded, step state reset) — exactly where every replay leaves the device.
//   Replays therefore need no notification to the runtime. Per-unit counters (collectives,
//   hook host time) count only the eager and captured steps: a replay runs no hook.
// - After the capture the model must run only through this object: an eager forward through it
//   would wait on events recorded inside the capture.
//
// Guards (cuda_graph_step_refusal(): every reason at once, each with its value and the fix):
// CUDA device; world 1 (the mesh's global size: capturing NCCL collectives across ranks is
// possible but out of scope); no CPU offload and offload_step = after_backward (host copies and
// a CPU optimizer are not capturable); no tracing (it queries events on the host); the NCCL
// watchdog off (FLATSHARD_NCCL_WATCHDOG=0: it polls completion events from its own thread,
// which a capture forbids); FLATSHARD_DEBUG off (its order check talks to the other ranks on
// the host); every unit wholly trainable and named_parameters() views unused (their gradients
// are host-side bookkeeping per step); no recompute unit (its RNG state is saved and restored on
// the host); gradient sync on at each run(). A host sync inside the
// closure (.item(), a CPU copy) makes the capture fail: the error says so and names the CUDA
// error.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace flatshard {

class ShardedModel;

struct CudaGraphOptions {
  // Eager steps before the capture (PyTorch's recipe uses 3; 1 is enough for the runtime's
  // prefetch order, which is recorded from the previous step). Must be >= 1.
  int warmup_steps = 2;
};

// The reasons `model` cannot be captured ("" if none): every failed guard of Note [CUDA graph
// step], one per line. Pure host checks, CPU-testable.
std::string cuda_graph_step_refusal(const ShardedModel& model);

class CudaGraphStep {
 public:
  // The closure computes the loss (a one-element tensor that requires grad) from the static
  // inputs it is handed, entering the model as usual (flatshard::enter / call). Throws, naming
  // every failed guard, if the model cannot be captured (cuda_graph_step_refusal), or if the
  // build has no CUDA. `model` must outlive this object.
  using LossFn = std::function<at::Tensor(const std::vector<at::Tensor>& inputs)>;
  CudaGraphStep(ShardedModel& model, const std::vector<at::Tensor>& example_inputs, LossFn loss,
                CudaGraphOptions options = {});
  ~CudaGraphStep();
  CudaGraphStep(const CudaGraphStep&) = delete;
  CudaGraphStep& operator=(const CudaGraphStep&) = delete;

  // One step's forward and backward on `inputs` (same count, shapes, dtypes and devices as the
  // example inputs): warmup, capture + replay, or replay (Note [CUDA graph step]). Returns the
  // loss, detached; after a capture it is the graph's output buffer, overwritten by the next
  // run() (copy it to keep it). Gradients are in the master shards' .grad when it returns, in
  // stream order on the caller's current stream.
  at::Tensor run(const std::vector<at::Tensor>& inputs);

  bool captured() const;
  int steps() const;  // run() calls so far

 private:
  void capture();  // the step after warmup: capture, then the caller replays
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace flatshard
