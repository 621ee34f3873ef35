// flatshard/fsdp/cuda_graph.cpp — see cuda_graph.h; Note [CUDA graph step] is there.
#include "fsdp/cuda_graph.h"

#include <optional>
#include <sstream>

#include "collectives/env.h"
#include "fsdp/runtime.h"
#include "fsdp/sharded_model.h"
#include "fsdp/unit_entry.h"
#include "support/dtype_name.h"

#if FLATSHARD_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "collectives/nccl_communicator.h"
#endif

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

namespace flatshard {

namespace {

// The runtime driving `model`'s units, found through the registry flatshard::call uses (any
// unit's member leads to it), so ShardedModel's public surface does not grow for this one user.
[[maybe_unused]] Runtime& runtime_of(const ShardedModel& model) {
  Runtime* rt = nullptr;
  for (size_t i = 0; i < model.num_units() && rt == nullptr; ++i)
    for (const torch::nn::Module* m : model.unit(i).members())
      if ((rt = detail::find_unit(m).runtime) != nullptr) break;
  TORCH_INTERNAL_ASSERT(rt != nullptr,
                        "CudaGraphStep: no registered unit member leads to the "
                        "model's runtime");
  return *rt;
}

[[maybe_unused]] std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes() << " " << t.scalar_type() << " on " << t.device();
  return s.str();
}

}  // namespace

std::string cuda_graph_step_refusal(const ShardedModel& model) {
  std::ostringstream why;
  auto refuse = [&why](const auto&... parts) {
    why << "  - ";
    (why << ... << parts);
    why << "\n";
  };
  const Communicator& comm = model.comm();
  if (!comm.device().is_cuda())
    refuse("the model is on ", comm.device(), ": a CUDA graph needs a CUDA device (shard the ",
           "model over an NCCL communicator on cuda:N)");
  const int world = model.mesh().global_size();
  if (world != 1)
    refuse("the mesh has ", world, " ranks: only world 1 is supported (capturing NCCL ",
           "collectives across ranks is possible but out of scope here)");
  const ShardingOptions& o = model.options();
  if (o.offload_step != OffloadStep::kAfterBackward)
    refuse("offload_step is not after_backward: its CPU optimizer steps on a host thread during ",
           "backward, which a graph cannot replay");
  if (o.mixed_precision.gather_dtype != GatherDtype::kParam)
    refuse("gather_dtype is ", gather_dtype_name(o.mixed_precision.gather_dtype),
           ": its finiteness check reads the scales on the host (a sync); use the param dtype");
  if (model.tracer() != nullptr)
    refuse("tracing is on (ShardingOptions::trace / FLATSHARD_TRACE): the tracer queries its ",
           "events on the host; unset it");
  if (env::debug())
    refuse("FLATSHARD_DEBUG is on: its cross-rank unit-order check copies to the host each ",
           "step; unset it");
#if FLATSHARD_WITH_CUDA
  if (const auto* nccl = dynamic_cast<const NcclCommunicator*>(&comm))
    if (nccl->options().watchdog)
      refuse("the NCCL watchdog is on: it polls completion events from its own thread, which ",
             "a capture forbids; set FLATSHARD_NCCL_WATCHDOG=0 (NcclOptions::watchdog = false)");
#endif
  for (size_t i = 0; i < model.num_units(); ++i) {
    const Unit& u = model.unit(i);
    const FlatParam& f = u.flat();
    if (f.config().offload > 0)
      refuse("unit '", u.name(), "' is offloaded (level ", f.config().offload,
             "): host copies are not capturable; offload 0");
    if (f.any_trainable() && !f.all_trainable())
      refuse("unit '", u.name(), "' mixes frozen and trainable parameters: their gradient ",
             "views are host-side bookkeeping per step; put frozen parameters in units of ",
             "their own");
    if (u.recompute())
      refuse("unit '", u.name(), "' recomputes its forward in backward: it saves and restores the ",
             "RNG state on the host (Note [Recompute]), which a replay would not redo; not ",
             "supported with a CUDA graph yet");
    if (f.views_active())
      refuse("named_parameters() was called (unit '", u.name(), "'): its per-parameter ",
             "gradient views are re-pointed on the host every step; build the optimizer on ",
             "parameters()");
  }
  return why.str();
}

struct CudaGraphStep::Impl {
  Impl(ShardedModel& m, LossFn fn, CudaGraphOptions o)
      : model(m), loss_fn(std::move(fn)), options(o) {}
  ShardedModel& model;
  LossFn loss_fn;
  CudaGraphOptions options;
  std::vector<at::Tensor> static_inputs;  // what the graph reads; run() copies into them
  int steps = 0;
  bool captured = false;
  std::string failed;  // why the capture failed: later run() calls repeat it
#if FLATSHARD_WITH_CUDA
  // The graph's own stream: warmup, capture and replays run there (a capture cannot be on the
  // default stream), ordered after the caller's stream and joined back to it.
  std::optional<c10::cuda::CUDAStream> stream;
  // before: the caller's stream -> `stream` (input copies, the last optimizer step);
  // after: `stream` -> the caller's; fork/join_ag/join_rs: the runtime's side streams into and
  // out of the capture (Note [CUDA graph step], "Streams").
  cudaEvent_t before = nullptr, after = nullptr, fork = nullptr, join_ag = nullptr,
              join_rs = nullptr;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  at::Tensor static_loss;          // the graph's loss output
  std::vector<at::Tensor> params;  // model.parameters(): the master shards
  std::vector<at::Tensor> grads;   // their gradients, as the graph writes them
#endif
};

#if FLATSHARD_WITH_CUDA

namespace {

void wait(cudaEvent_t ev, const c10::cuda::CUDAStream& producer,
          const c10::cuda::CUDAStream& waiter) {
  C10_CUDA_CHECK(cudaEventRecord(ev, producer.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter.stream(), ev, 0));
}

void check_loss(const at::Tensor& loss, int step) {
  TORCH_CHECK(loss.defined() && loss.numel() == 1 && loss.requires_grad(), "CudaGraphStep (step ",
              step,
              "): the loss function must return a one-element "
              "tensor that requires grad; got ",
              loss.defined() ? shape_of(loss) + (loss.requires_grad() ? "" : " without grad")
                             : std::string("an undefined tensor"));
}

}  // namespace

CudaGraphStep::CudaGraphStep(ShardedModel& model, const std::vector<at::Tensor>& example_inputs,
                             LossFn loss, CudaGraphOptions options)
    : impl_(std::make_unique<Impl>(model, std::move(loss), options)) {
  const std::string why = cuda_graph_step_refusal(model);
  TORCH_CHECK(why.empty(), "CudaGraphStep (rank ", model.comm().rank(),
              "): this model's step cannot be captured as a CUDA graph (Note [CUDA graph step], "
              "fsdp/cuda_graph.h):\n",
              why);
  TORCH_CHECK(options.warmup_steps >= 1, "CudaGraphStep: warmup_steps must be >= 1, got ",
              options.warmup_steps);
  TORCH_CHECK(impl_->loss_fn, "CudaGraphStep: the loss function is empty");
  const c10::Device dev = model.comm().device();
  for (size_t i = 0; i < example_inputs.size(); ++i) {
    const at::Tensor& t = example_inputs[i];
    TORCH_CHECK(t.defined() && t.device() == dev, "CudaGraphStep: input ", i, " must be a ",
                "tensor on ", dev, " (the model's device); got ",
                t.defined() ? shape_of(t) : std::string("an undefined tensor"));
    impl_->static_inputs.push_back(t.detach().clone());
  }
  c10::cuda::CUDAGuard guard(dev);
  impl_->stream.emplace(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, dev.index()));
  // Note [CUDA graph step], "Streams": the parameters' AccumulateGrad nodes run on the stream
  // current when they were made (fully_shard's, usually the default stream, which a capture
  // cannot touch): make them anew on the graph's stream.
  // A node an earlier step's live graph still holds keeps its stream: warned (not refused: the
  // capture itself is the judge, and its error then follows this warning).
  {
    c10::cuda::CUDAStreamGuard on_graph_stream(*impl_->stream);
    std::string stale;
    for (size_t i = 0; i < model.num_units(); ++i) {
      Unit& u = model.unit(i);
      u.rehook_grad_accumulators();
      const FlatParam& f = u.flat();
      for (size_t k = 0; k < f.params().size() && stale.empty(); ++k) {
        if (!f.trainable(k)) continue;
        const auto acc = torch::autograd::impl::grad_accumulator(f.params()[k].param);
        const c10::Stream on = acc->input_metadata(0).stream();
        if (on != c10::Stream(*impl_->stream)) {
          std::ostringstream m;
          m << "'" << f.params()[k].name << "' (unit '" << u.name() << "') accumulates on " << on;
          stale = m.str();
        }
      }
    }
    if (!stale.empty())
      TORCH_WARN("CudaGraphStep: the gradient of ", stale, ", not on the graph's stream ",
                 c10::Stream(*impl_->stream), ": an autograd graph of an earlier step may still ",
                 "be alive (a loss or an output kept with its graph); the capture will likely ",
                 "fail. Drop such tensors before building the CudaGraphStep");
  }
  for (cudaEvent_t* ev :
       {&impl_->before, &impl_->after, &impl_->fork, &impl_->join_ag, &impl_->join_rs})
    C10_CUDA_CHECK(cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
  impl_->params = model.parameters();
}

CudaGraphStep::~CudaGraphStep() {
  try {  // no throw from destructors (CONTRIBUTING.md 5): a failed destroy only leaks an event
    if (!impl_) return;
    impl_->graph.reset();
    for (cudaEvent_t ev :
         {impl_->before, impl_->after, impl_->fork, impl_->join_ag, impl_->join_rs})
      if (ev != nullptr) (void)cudaEventDestroy(ev);
  } catch (...) {
  }
}

at::Tensor CudaGraphStep::run(const std::vector<at::Tensor>& inputs) {
  Impl& s = *impl_;
  const int step = s.steps;
  TORCH_CHECK(s.failed.empty(), "CudaGraphStep (step ", step, "): the capture failed earlier, ",
              "so this object cannot run: ", s.failed);
  TORCH_CHECK(inputs.size() == s.static_inputs.size(), "CudaGraphStep (step ", step,
              "): ", inputs.size(), " inputs given, the graph was built for ",
              s.static_inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    const at::Tensor& want = s.static_inputs[i];
    TORCH_CHECK(t.defined() && t.sizes() == want.sizes() && t.scalar_type() == want.scalar_type() &&
                    t.device() == want.device(),
                "CudaGraphStep (step ", step, "): input ", i, " is ",
                t.defined() ? shape_of(t) : std::string("undefined"), " but the graph ",
                s.captured ? "was captured" : "is built", " for ", shape_of(want),
                ": a CUDA graph replays fixed shapes (Note [CUDA graph step]); build another "
                "CudaGraphStep for this shape, or pad the batch to it");
  }
  TORCH_CHECK(runtime_of(s.model).requires_grad_sync(), "CudaGraphStep (step ", step,
              "): gradient sync is off (set_requires_gradient_sync(false)); a captured step "
              "sets the gradients and cannot accumulate them: turn sync on");
  const c10::Device dev = s.model.comm().device();
  c10::cuda::CUDAGuard device_guard(dev);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(dev.index());
  const c10::cuda::CUDAStream graph_stream = *s.stream;
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < inputs.size(); ++i)
      if (!inputs[i].is_same(s.static_inputs[i]))
        s.static_inputs[i].copy_(inputs[i], /*non_blocking=*/true);  // on the caller's stream
  }
  wait(s.before, caller, graph_stream);
  at::Tensor out;
  {
    c10::cuda::CUDAStreamGuard on_graph_stream(graph_stream);
    if (step < s.options.warmup_steps) {
      at::Tensor loss = s.loss_fn(s.static_inputs);
      check_loss(loss, step);
      loss.backward();
      out = loss.detach();
    } else {
      if (!s.captured) capture();
      s.graph->replay();
      // The optimizer may have set the gradients to none (zero_grad): point them at the
      // buffers the graph wrote again.
      for (size_t i = 0; i < s.params.size(); ++i) s.params[i].mutable_grad() = s.grads[i];
      out = s.static_loss;
    }
  }
  wait(s.after, graph_stream, caller);
  // A warmup loss was allocated on the graph's stream: make a copy that belongs to the caller's.
  if (!s.captured) out = out.clone();
  ++s.steps;
  return out;
}

void CudaGraphStep::capture() {
  Impl& s = *impl_;
  Runtime& rt = runtime_of(s.model);
  const c10::cuda::CUDAStream graph_stream = *s.stream;
  const c10::cuda::CUDAStream ag(rt.all_gather_stream());
  const c10::cuda::CUDAStream rs(rt.reduce_scatter_stream());
  // Note [CUDA graph step], "Gradients": the captured reduction writes fresh master gradients.
  for (at::Tensor& p : s.params) p.mutable_grad() = at::Tensor();
  // Outside the capture, no wait of the captured step may name an event recorded before it: a
  // gather left pending by the last eager step is waited for now (a no-op when none is).
  for (size_t i = 0; i < s.model.num_units(); ++i) s.model.unit(i).wait_unsharded();
  // The eager steps' cached blocks go back to the device: the graph's private pool cannot reuse
  // them, and the peak would otherwise hold both (a device sync, once, outside the capture).
  c10::cuda::CUDACachingAllocator::emptyCache();
  s.graph = std::make_unique<at::cuda::CUDAGraph>();
  bool begun = false;
  try {
    s.graph->capture_begin();
    begun = true;
    wait(s.fork, graph_stream, ag);  // the side streams join the capture before their first op
    wait(s.fork, graph_stream, rs);
    at::Tensor loss = s.loss_fn(s.static_inputs);
    check_loss(loss, s.steps);
    loss.backward();
    s.static_loss = loss.detach();
    wait(s.join_ag, ag, graph_stream);  // and rejoin it at its end
    wait(s.join_rs, rs, graph_stream);
    begun = false;
    s.graph->capture_end();
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    if (begun) {
      try {  // ends the (invalidated) capture so the stream is usable again
        s.graph->capture_end();
      } catch (...) {  // the capture's own error is the one to report
      }
    }
    s.graph.reset();
    s.failed = c10_error ? c10_error->what_without_backtrace() : e.what();
    TORCH_CHECK(false, "CudaGraphStep (rank ", s.model.comm().rank(), ", step ", s.steps,
                "): capturing forward + backward as a CUDA graph failed. A captured step must "
                "not synchronize with the host (.item(), a copy to the CPU, a "
                "data-dependent shape) nor use work outside the capture (Note [CUDA graph "
                "step], fsdp/cuda_graph.h). The error: ",
                s.failed);
  }
  s.grads.clear();
  for (const at::Tensor& p : s.params) s.grads.push_back(p.grad());
  s.captured = true;
}

#else  // no CUDA in this build

CudaGraphStep::CudaGraphStep(ShardedModel& model, const std::vector<at::Tensor>&, LossFn loss,
                             CudaGraphOptions options)
    : impl_(std::make_unique<Impl>(model, std::move(loss), options)) {
  const std::string why = cuda_graph_step_refusal(model);
  TORCH_CHECK(false, "CudaGraphStep (rank ", model.comm().rank(), "): this model's step cannot ",
              "be captured as a CUDA graph: this build of flatshard has no CUDA ",
              "(FLATSHARD_WITH_CUDA=0)", why.empty() ? "" : "; and:\n", why);
}

CudaGraphStep::~CudaGraphStep() = default;

at::Tensor CudaGraphStep::run(const std::vector<at::Tensor>&) {
  TORCH_CHECK(false, "CudaGraphStep: this build of flatshard has no CUDA");
}

void CudaGraphStep::capture() {}

#endif

bool CudaGraphStep::captured() const { return impl_->captured; }
int CudaGraphStep::steps() const { return impl_->steps; }

}  // namespace flatshard
