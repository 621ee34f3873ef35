#include "fsdp/runtime.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>

#include "collectives/env.h"
#include "fsdp/order_check.h"

namespace flatshard {

namespace {

c10::Stream side_stream(c10::Device device) {
  if (device.is_cpu()) return c10::Stream(c10::Stream::DEFAULT, device);
  // A high-priority pool stream so collectives are scheduled ahead of queued compute.
  return c10::impl::getDeviceGuardImpl(device.type())
      ->getStreamFromGlobalPool(device, /*isHighPriority=*/true);
}

}  // namespace

Runtime::Runtime(Communicator& comm, ShardingOptions options, Communicator* replicate)
    : comm_(comm),
      replicate_(replicate),
      options_(std::move(options)),
      all_gather_stream_(side_stream(comm.device())),
      reduce_scatter_stream_(side_stream(comm.device())) {
  TORCH_CHECK(options_.forward_prefetch >= 0 && options_.backward_prefetch >= 0,
              "flatshard: prefetch depths must be >= 0 (forward_prefetch=",
              options_.forward_prefetch, ", backward_prefetch=", options_.backward_prefetch, ")");
  tracer_ = Tracer::create(options_, comm_, all_gather_stream_, reduce_scatter_stream_);
  debug_order_ = env::debug();
}

c10::Stream Runtime::compute_stream() const { return comm_.current_stream(); }

void Runtime::prefetch(const std::vector<Unit*>& order, size_t from, int depth,
                       bool for_backward) {
  for (size_t i = from; i < order.size() && depth > 0; ++i, --depth) order[i]->unshard(for_backward);
}

void Runtime::on_pre_forward(Unit& unit) {
  if (debug_order_) check_unit_order(comm_, unit_names(), unit.index(), "forward", forward_order_.size());
  forward_order_.push_back(&unit);
  if (options_.forward_prefetch == 0 || last_forward_order_.empty()) return;
  auto it = std::find(last_forward_order_.begin(), last_forward_order_.end(), &unit);
  if (it == last_forward_order_.end()) return;
  const size_t pos = static_cast<size_t>(it - last_forward_order_.begin());
  // Only prefetch units that the previous step entered after this one and that this step has
  // not entered yet (they would be resharded already or gathered anyway).
  int depth = options_.forward_prefetch;
  for (size_t i = pos + 1; i < last_forward_order_.size() && depth > 0; ++i, --depth) {
    Unit* next = last_forward_order_[i];
    if (!next->called_in_forward()) next->unshard(/*for_backward=*/false);
  }
}

void Runtime::on_root_enter() {
  if (!backward_active_ && !pending_backward_ && forward_order_.empty())
    step_guard_.on_step_start(units_, comm_.rank());
  // A forward that armed no backward (eval, no_grad) left its step state behind: close it, so
  // this forward starts a fresh step. Two forwards before one backward keep accumulating.
  if (backward_active_ || pending_backward_ || forward_order_.empty()) return;
  for (auto& u : units_) {
    u->reshard();
    u->reset_step_state();
  }
  last_forward_order_ = std::move(forward_order_);
  forward_order_.clear();
}

void Runtime::on_pre_backward(Unit& unit) {
  if (!backward_active_) {
    backward_active_ = true;
    backward_order_.clear();
    for (auto it = forward_order_.rbegin(); it != forward_order_.rend(); ++it)
      if (!(*it)->is_root()) backward_order_.push_back(*it);
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize_backward(); });
  }
  if (options_.backward_prefetch == 0) return;
  size_t from = 0;
  if (!unit.is_root()) {
    auto it = std::find(backward_order_.begin(), backward_order_.end(), &unit);
    if (it == backward_order_.end()) return;
    from = static_cast<size_t>(it - backward_order_.begin()) + 1;
  }
  prefetch(backward_order_, from, options_.backward_prefetch, /*for_backward=*/true);
}

std::vector<std::string> Runtime::unit_names() const {
  std::vector<std::string> names;
  for (const auto& u : units_) names.push_back(u->name());
  return names;
}

void Runtime::hold_reduce_buffers(std::vector<at::Tensor> buffers, const StreamEvent* done) {
  TORCH_INTERNAL_ASSERT(reduce_buffers_.empty(), "release_reduce_buffers() not called first");
  reduce_buffers_ = std::move(buffers);
  reduce_buffers_done_ = done;
}

void Runtime::release_reduce_buffers() {
  if (reduce_buffers_done_ != nullptr) {
    TraceScope trace(tracer(), TraceKind::kWaitReduce, nullptr);
    reduce_buffers_done_->block(compute_stream());
  }
  reduce_buffers_.clear();
  reduce_buffers_done_ = nullptr;
}

void Runtime::finalize_backward() {
  // Units whose gradients were not all produced (unused parameters, units not entered, outputs
  // that did not reach the loss) reduce now, in plan order, so every rank issues the same
  // collectives in the same order and every planned parameter gets a (possibly zero) gradient.
  for (auto& u : units_) {
    if (!u->post_backward_done()) u->post_backward();
  }
  // The optimizer reads the master gradients on the compute stream: wait for the last
  // reduction (reductions run in order on one stream, so the last one covers all).
  release_reduce_buffers();
  for (auto& u : units_) {
    u->reshard();
    u->reset_step_state();
  }
  last_forward_order_ = std::move(forward_order_);
  forward_order_.clear();
  backward_active_ = false;
  pending_backward_ = false;
  step_guard_.on_backward_end(units_, requires_grad_sync_, comm_.rank());
  trace_step_end(tracer());
}

}  // namespace flatshard
