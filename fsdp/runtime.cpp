#include "fsdp/runtime.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <ATen/SequenceNumber.h>

#include <algorithm>

#include "collectives/env.h"
#include "flat_param/collective_plan.h"  // GatherCheck
#include "fsdp/offload_step.h"
#include "fsdp/order_check.h"

namespace flatshard {

namespace {

c10::Stream side_stream(c10::Device device) {
  if (device.is_cpu()) return c10::Stream(c10::Stream::DEFAULT, device);
  // A high-priority pool stream so collectives are scheduled ahead of queued compute.
  return c10::impl::getDeviceGuardImpl(device.type())
      ->getStreamFromGlobalPool(device, /*isHighPriority=*/true);
}

// Identity on a unit's outputs whose backward runs before any of the unit's own backward ops:
// the place to gather the unit's parameters again (the pre-backward hook). It enters the
// runtime, which decides about prefetch and the end of backward before the unit unshards.
struct PreBackward : public torch::autograd::Function<PreBackward> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                int64_t runtime_ptr, int64_t unit_ptr,
                                                at::TensorList xs) {
    ctx->saved_data["runtime"] = runtime_ptr;
    ctx->saved_data["unit"] = unit_ptr;
    ctx->set_materialize_grads(false);
    return xs.vec();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* runtime = reinterpret_cast<Runtime*>(ctx->saved_data["runtime"].toInt());
    auto* unit = reinterpret_cast<Unit*>(ctx->saved_data["unit"].toInt());
    runtime->pre_backward(*unit);
    torch::autograd::variable_list out;
    out.reserve(grads.size() + 2);
    out.emplace_back();  // no gradient for the runtime pointer
    out.emplace_back();  // nor for the unit pointer
    for (auto& g : grads) out.push_back(std::move(g));
    return out;
  }
};

// Identity on an input of a frozen unit (Note [Frozen parameters]): its backward runs once the
// gradient for that input is complete, i.e. when the unit's backward no longer needs its
// parameters, and reports it. Its node carries an AnchorHook (below), so the unit pointer is
// only followed while the ShardedModel lives.
struct FrozenInput : public torch::autograd::Function<FrozenInput> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, int64_t unit_ptr,
                            const at::Tensor& x) {
    ctx->saved_data["unit"] = unit_ptr;
    ctx->set_materialize_grads(false);
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    reinterpret_cast<Unit*>(ctx->saved_data["unit"].toInt())->on_frozen_input(true);
    return {at::Tensor(), grads[0]};
  }
};

// Runs before a FrozenInput node's backward: an error naming the unit when the ShardedModel is
// gone (as LeaseHook for the outputs), instead of following a dangling unit pointer.
struct AnchorHook : public torch::autograd::FunctionPreHook {
  AnchorHook(std::weak_ptr<Runtime*> a, const std::string& unit, int rank)
      : anchor(std::move(a)), unit_name(unit), rank(rank) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    TORCH_CHECK(!anchor.expired(), "flatshard: backward through unit '", unit_name, "' (rank ",
                rank, ") after its ShardedModel was destroyed; the ShardedModel must outlive "
                "every forward and backward through the model");
    return grads;
  }
  std::weak_ptr<Runtime*> anchor;
  std::string unit_name;
  int rank;
};

}  // namespace

// Note [Forward without backward]
// A forward in grad mode keeps what backward needs: the root and SHARD_GRAD_OP units stay
// gathered until the end of backward. When no backward comes (an eval loop that forgot
// NoGradGuard), nothing used to free them before the next step. The rule: a step's forward
// state lives as long as the autograd graph it built. Every PreBackward node of the step holds
// the step's lease (a pre-hook it owns, LeaseHook); when the last node is destroyed — the user
// dropped every output — and no backward began, the step closes: every unit reshards and the
// next forward starts a new step. While a backward is possible (any output alive, or two
// forwards summed before one backward) the step stays open. A release inside a
// flatshard::call (an output dropped mid-forward) is deferred until the outermost call
// returns, so no unit is resharded while it runs. A forward that hooked nothing (NoGradGuard,
// or outputs that do not require grad) closes its step when the root's call returns. The
// lease finds the runtime through a weak anchor: a graph may outlive the ShardedModel.
struct StepLease {
  StepLease(std::weak_ptr<Runtime*> r, uint64_t s) : runtime(std::move(r)), step(s) {}
  ~StepLease() {
    try {
      if (auto rt = runtime.lock()) (*rt)->on_step_graph_released(step);
    } catch (...) {  // no throw from destructors (CONTRIBUTING.md 5); resharding does not throw
    }
  }
  std::weak_ptr<Runtime*> runtime;
  uint64_t step;
};

namespace {

// Owned by a PreBackward node: holds the step's lease as long as the node. Runs before the
// node's backward, which would otherwise follow a dangling runtime pointer when the
// ShardedModel was destroyed before this backward: that is an error naming the unit instead.
struct LeaseHook : public torch::autograd::FunctionPreHook {
  LeaseHook(std::shared_ptr<StepLease> l, const std::string& unit, int rank)
      : lease(std::move(l)), unit_name(unit), rank(rank) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    TORCH_CHECK(!lease->runtime.expired(), "flatshard: backward through unit '", unit_name,
                "' (rank ", rank, ") after its ShardedModel was destroyed; the ShardedModel "
                "must outlive every forward and backward through the model");
    return grads;
  }
  std::shared_ptr<StepLease> lease;
  std::string unit_name;
  int rank;
};

// Note [Pre-backward hook]
// A unit's pre-backward (gather for backward, prefetch, the end-of-backward callback) must run
// before any backward op of the unit, once its outputs' gradients are complete. The first
// design wrapped the outputs in a PreBackward identity (an autograd Function per unit call: a
// node, its saved_data dictionary, new output tensors), which was most of the host time of a
// unit's post-forward hook (benchmarks/RESULTS.md "Host time per unit"). The outputs' own nodes
// already run exactly then: their pre-hooks fire when their gradients are complete, before they
// run. So, where every differentiable output's node was created inside this call (its sequence
// number is at least the one when the call entered: not a tensor passed through from outside,
// whose node belongs to code that runs later in backward), the unit adds one PreBackwardHook
// per distinct node instead. A node already hooked by a unit of this runtime in this forward
// (an inner unit's output returned as is by an enclosing one) takes the enclosing unit at the
// front of its list: the enclosing unit's pre-backward runs first, as its PreBackward node ran
// first. The hook holds the step's lease as the node did (Note [Forward without backward]) and
// fails, naming the unit, if the ShardedModel is gone. Otherwise (a leaf or a passed-through
// output, or FLATSHARD_PRE_BACKWARD_HOOK=0) the PreBackward identity, as before. Same calls in
// the same order either way (tests/fsdp_test.cpp runs both).
struct PreBackwardHook : public torch::autograd::FunctionPreHook {
  PreBackwardHook(std::shared_ptr<StepLease> l, Unit* unit, int rank)
      : lease(std::move(l)), units{unit}, rank(rank) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    auto rt = lease->runtime.lock();
    TORCH_CHECK(rt != nullptr, "flatshard: backward through unit '", unit_name_, "' (rank ", rank,
                ") after its ShardedModel was destroyed; the ShardedModel must outlive every "
                "forward and backward through the model");
    for (Unit* u : units) (*rt)->pre_backward(*u);
    return grads;
  }
  std::shared_ptr<StepLease> lease;
  std::vector<Unit*> units;  // outermost first
  int rank;
  std::string unit_name_;  // units.front()'s, for the error (the pointers may dangle then)
};

}  // namespace

Runtime::~Runtime() {
  self_handle_.reset();  // leases alive in graphs now find nothing
  // The stepper's worker reads the units and writes the tracer, both destroyed before it.
  if (offload_) {
    try {
      offload_->wait();
    } catch (...) {  // an error no wait reported: nothing to do about it in a destructor
    }
  }
}

Runtime::Runtime(const Mesh& mesh, ShardingOptions options)
    : mesh_(mesh),
      comm_(mesh_.shard()),
      options_(std::move(options)),
      all_gather_stream_(side_stream(mesh_.device())),
      reduce_scatter_stream_(side_stream(mesh_.device())) {
  TORCH_CHECK(options_.forward_prefetch >= 0 && options_.backward_prefetch >= 0,
              "flatshard: prefetch depths must be >= 0 (forward_prefetch=",
              options_.forward_prefetch, ", backward_prefetch=", options_.backward_prefetch, ")");
  tracer_ = Tracer::create(options_, comm_, all_gather_stream_, reduce_scatter_stream_);
  std::shared_ptr<OffloadStepper> stepper;  // Note [Offload step in backward]
  if (options_.offload_step != OffloadStep::kAfterBackward)
    stepper = std::make_shared<OffloadStepper>(
        comm_.rank(), side_stream(mesh_.device()), options_.offload_step == OffloadStep::kDelayed,
        tracer_.get());
  offload_ = std::make_unique<OffloadLifecycle>(comm_.rank(), std::move(stepper));
  ctx_.emplace(UnitContext{mesh_, all_gather_stream_, reduce_scatter_stream_,
                           tracer_.get(), reduce_buffers_,
                           options_.debug_sleep_before_all_gather_cycles,
                           options_.debug_sleep_before_reduce_cycles, offload_.get()});
  debug_order_ = env::debug();
  env_pre_backward_hook_ = env::pre_backward_hook();
  self_handle_ = std::make_shared<Runtime*>(this);
}

c10::Stream Runtime::compute_stream() const { return comm_.current_stream(); }

void Runtime::set_requires_grad_sync(bool v) {
  requires_grad_sync_ = v;
  for (auto& u : units_) u->set_requires_grad_sync(v);
}

void Runtime::pre_forward(Unit& unit, const torch::nn::Module* member) {
  HookClock clock(unit, /*backward=*/false);
  TraceScope trace(tracer(), TraceKind::kPreForward, &unit.trace_info());
  if (unit.is_root()) {
    call_depth_ = 0;  // the outermost call (frames left by a forward that threw are gone)
    on_root_enter();
  }
  ++call_depth_;
  // Note [Pre-backward hook]: nodes created from here on belong to this call.
  if (unit.is_root()) call_first_node_.clear();
  call_first_node_.push_back(at::sequence_number::peek());
  if (unit.mark_called_in_forward()) on_first_forward_entry(unit);  // may prefetch later units
  unit.pre_forward(member);
}

void Runtime::post_forward(Unit& unit, const torch::nn::Module* member,
                           std::vector<at::Tensor>& outputs) {
  HookClock clock(unit, /*backward=*/false);
  trace_end(tracer(), TraceKind::kForward, unit.trace_info());
  const bool grad = at::GradMode::is_enabled();
  // Outputs that require no grad arm no backward: the unit reshards as under NoGradGuard.
  const uint64_t first_node = call_first_node_.empty() ? 0 : call_first_node_.back();
  if (!call_first_node_.empty()) call_first_node_.pop_back();
  const bool hooked = grad && hook_outputs(unit, outputs, first_node);
  if (hooked) pending_backward_ = true;
  unit.post_forward(member, hooked);
  if (call_depth_ > 0) --call_depth_;
  // Note [Forward without backward]: the step's graph is gone already, or there never was one.
  if (call_depth_ == 0 && !backward_active_ &&
      (release_deferred_ || (unit.is_root() && lease_.expired())))
    end_step();
}

void Runtime::on_step_graph_released(uint64_t step) {
  if (step != step_.load() || backward_active_) return;  // that step ended (its backward ran)
  if (call_depth_ > 0) {
    release_deferred_ = true;
    return;
  }
  end_step();
}

void Runtime::end_step() {
  for (auto& u : units_) {
    u->reshard();
    u->reset_step_state();
  }
  // The next forward prefetches in this order; a step with no forward (a second backward over a
  // retained graph) keeps the last one's.
  if (!forward_order_.empty()) last_forward_order_ = std::move(forward_order_);
  forward_order_.clear();
  backward_active_ = false;
  pending_backward_ = false;
  release_deferred_ = false;
  lease_.reset();
  step_.fetch_add(1);  // this step's lease, when its graph is freed, finds its step ended
}

bool Runtime::hook_outputs(Unit& unit, std::vector<at::Tensor>& outputs, uint64_t first_node) {
  std::vector<size_t> idx;
  std::vector<at::Tensor> diff;
  bool own_nodes = env_pre_backward_hook_;  // Note [Pre-backward hook]
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].defined() && outputs[i].requires_grad()) {
      idx.push_back(i);
      diff.push_back(outputs[i]);
      const auto& fn = outputs[i].grad_fn();
      own_nodes = own_nodes && fn != nullptr && fn->sequence_nr() >= first_node &&
                  fn->sequence_nr() != UINT64_MAX;
    }
  }
  if (diff.empty()) return false;
  // Note [Forward without backward]: the node (or the hook) holds the step's lease.
  std::shared_ptr<StepLease> lease = lease_.lock();
  if (!lease) {
    lease = std::make_shared<StepLease>(self_handle_, step_.load());
    lease_ = lease;
  }
  if (own_nodes) {
    std::vector<const torch::autograd::Node*> seen;
    for (const at::Tensor& t : diff) {
      torch::autograd::Node* node = t.grad_fn().get();
      if (std::find(seen.begin(), seen.end(), node) != seen.end()) continue;
      seen.push_back(node);
      auto& hooks = node->pre_hooks();
      auto* last = hooks.empty() ? nullptr : dynamic_cast<PreBackwardHook*>(hooks.back().get());
      if (last != nullptr && last->lease == lease) {  // an inner unit's node: enclosing first
        last->units.insert(last->units.begin(), &unit);
        last->unit_name_ = unit.name();  // the error names the first to run, as the identity did
        continue;
      }
      auto hook = std::make_unique<PreBackwardHook>(lease, &unit, comm_.rank());
      hook->unit_name_ = unit.name();
      node->add_pre_hook(std::move(hook));
    }
    return true;
  }
  auto wrapped = PreBackward::apply(reinterpret_cast<int64_t>(this),
                                    reinterpret_cast<int64_t>(&unit), at::TensorList(diff));
  wrapped.front().grad_fn()->add_pre_hook(
      std::make_unique<LeaseHook>(std::move(lease), unit.name(), comm_.rank()));
  for (size_t k = 0; k < idx.size(); ++k) outputs[idx[k]] = wrapped[k];
  return true;
}

at::Tensor Runtime::wrap_input(Unit& unit, const at::Tensor& t) {
  // Note [Frozen parameters] (fsdp/unit.cpp): units holding any frozen parameter.
  if (unit.flat().all_trainable() || !t.defined() || !t.requires_grad() ||
      !at::GradMode::is_enabled())
    return t;
  unit.on_frozen_input(/*backward=*/false);
  at::Tensor out = FrozenInput::apply(reinterpret_cast<int64_t>(&unit), t);
  out.grad_fn()->add_pre_hook(
      std::make_unique<AnchorHook>(self_handle_, unit.name(), comm_.rank()));
  return out;
}

void Runtime::pre_backward(Unit& unit) {
  HookClock clock(unit, /*backward=*/true);
  TraceScope trace(tracer(), TraceKind::kPreBackward, &unit.trace_info());
  if (unit.mark_pre_backward()) on_first_pre_backward(unit);  // prefetches the next units
  unit.pre_backward();
}

void Runtime::prefetch(const std::vector<Unit*>& order, size_t from, int depth,
                       bool for_backward) {
  for (size_t i = from; i < order.size() && depth > 0; ++i, --depth) order[i]->unshard(for_backward);
}

void Runtime::on_first_forward_entry(Unit& unit) {
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
  offload_->on_root_entry(backward_active_);  // Note [Offload step in backward]
  if (!backward_active_ && !pending_backward_ && forward_order_.empty()) {
    step_guard_.on_step_start(units_, comm_.rank());
    for (const auto& u : units_) {
      u->check_trainable_unchanged(comm_.rank());
      u->flat().release_cleared_grad();  // Note [Original-parameter views]: zero_grad on views
    }
  }
  // A forward that armed no backward left its step state behind (its root call did not
  // return: it threw): close it, so this forward starts a fresh step. Two forwards before one
  // backward keep accumulating.
  if (backward_active_ || pending_backward_ || forward_order_.empty()) return;
  end_step();
}

void Runtime::on_first_pre_backward(Unit& unit) {
  if (!backward_active_) {
    // Note [Offload step in backward]: checks, then waits for the last backward's CPU steps.
    offload_->on_backward_start(requires_grad_sync_, !forward_order_.empty());
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

void Runtime::finalize_backward() {
  // Units whose gradients were not all produced (unused parameters, units not entered, outputs
  // that did not reach the loss) reduce now, in plan order, so every rank issues the same
  // collectives in the same order and every planned parameter gets a (possibly zero) gradient.
  for (auto& u : units_) {
    if (!u->post_backward_done()) u->post_backward();
  }
  // The optimizer reads the master gradients on the compute stream: wait for the last
  // reduction (reductions run in order on one stream, so the last one covers all).
  reduce_buffers_.release(compute_stream(), tracer());
  // Note [CPU offload] (flat_param/offload.h): the step's one host sync (offload_step = after
  // backward), before the CPU optimizer reads the host gradients.
  offload_->on_backward_end(requires_grad_sync_, compute_stream());
  end_step();
  const bool stepped = offload_->take_stepped();
  step_guard_.on_backward_end(units_, requires_grad_sync_, stepped, comm_.rank(),
                              offload_->delayed());
  trace_step_end(tracer());
  // Note [Deferred gather check] (flat_param/collective_plan.h): what this step's gathers
  // found (a quantized gather's non-finite master) throws here, out of backward(), on every
  // rank alike and before the optimizer step; last, so the step's state is already closed.
  for (auto& u : units_)
    if (GatherCheck* check = u->flat().gather_plan().extras().check) check->verify();
}

}  // namespace flatshard
