#include "fsdp/unit.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "fsdp/runtime.h"
#include "fsdp/trace.h"

namespace flatshard {

UnitCounters& UnitCounters::operator+=(const UnitCounters& o) {
  forward_all_gathers += o.forward_all_gathers;
  backward_all_gathers += o.backward_all_gathers;
  reduce_scatters += o.reduce_scatters;
  all_reduces += o.all_reduces;
  replicate_all_reduces += o.replicate_all_reduces;
  bytes += o.bytes;
  replicate_bytes += o.replicate_bytes;
  return *this;
}

namespace {

// Identity on a unit's outputs whose backward runs before any of the unit's own backward ops:
// the place to gather the unit's parameters again (the pre-backward hook).
struct PreBackward : public torch::autograd::Function<PreBackward> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                int64_t unit_ptr, at::TensorList xs) {
    ctx->saved_data["unit"] = unit_ptr;
    ctx->set_materialize_grads(false);
    return xs.vec();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* unit = reinterpret_cast<Unit*>(ctx->saved_data["unit"].toInt());
    unit->pre_backward();
    torch::autograd::variable_list out;
    out.reserve(grads.size() + 1);
    out.emplace_back();  // no gradient for the unit pointer
    for (auto& g : grads) out.push_back(std::move(g));
    return out;
  }
};

// Runs after parameter `index`'s AccumulateGrad: moves its gradient into the flat buffer (or
// leaves that to the reduction) and counts the unit's parameters whose gradient is in.
struct GradReadyHook : public torch::autograd::FunctionPostHook {
  GradReadyHook(Unit* u, size_t i) : unit(u), index(i) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    unit->on_grad_accumulated(index);
    return outputs;
  }
  Unit* unit;
  size_t index;
};

}  // namespace

Unit::Unit(int index, UnitSpec spec, ShardingStrategy strategy, bool reshard_after_forward,
           std::vector<const torch::nn::Module*> members, std::vector<ParamRef> params,
           Runtime& runtime, const FlatParamConfig& flat_config)
    : index_(index),
      spec_(std::move(spec)),
      strategy_(strategy),
      reshard_after_forward_(reshard_after_forward && strategy == ShardingStrategy::kFullShard),
      members_(std::move(members)),
      rt_(runtime) {
  flat_ = std::make_unique<FlatParam>(spec_.name, std::move(params), rt_.comm(), flat_config,
                                      rt_.replicate());
  state_ = flat_->is_unsharded() ? UnitState::kUnsharded : UnitState::kSharded;
  // After set_data (dtype may have changed), so these are the accumulators autograd will use.
  for (size_t i = 0; i < flat_->params().size(); ++i) {
    const ParamRef& p = flat_->params()[i];
    auto acc = torch::autograd::impl::grad_accumulator(p.param);
    TORCH_INTERNAL_ASSERT(acc, "unit '", spec_.name, "': no grad accumulator for '", p.name, "'");
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<GradReadyHook>(this, i)));
    grad_accumulators_.push_back(std::move(acc));
  }
}

Unit::~Unit() {
  for (size_t i = 0; i < grad_accumulators_.size(); ++i)
    grad_accumulators_[i]->del_post_hook(hook_keys_[i]);
}

void Unit::unshard(bool for_backward) {
  if (state_ == UnitState::kUnsharded) return;
  const c10::Stream ag = rt_.all_gather_stream();
  // The master shard may have just been updated by the optimizer on the compute stream.
  stream_wait_stream(ag, rt_.compute_stream(), scratch_);
  TraceScope trace(rt_.tracer(), TraceKind::kAllGather, this);
  device_sleep(ag, rt_.options().debug_sleep_before_all_gather_cycles);
  flat_->unshard(ag);
  all_gather_done_.record(ag);
  all_gather_pending_ = true;
  state_ = UnitState::kUnsharded;
  if (has_collectives() && strategy_ != ShardingStrategy::kNoShard) {
    (for_backward ? counters_.backward_all_gathers : counters_.forward_all_gathers) += 1;
    counters_.bytes += flat_->all_gather_bytes();
  }
}

void Unit::wait_unsharded() {
  if (!all_gather_pending_) return;
  TraceScope trace(rt_.tracer(), TraceKind::kWaitAllGather, this);
  all_gather_done_.block(rt_.compute_stream());
  all_gather_pending_ = false;
}

void Unit::reshard() {
  if (strategy_ == ShardingStrategy::kNoShard || state_ == UnitState::kSharded) return;
  TraceScope trace(rt_.tracer(), TraceKind::kReshard, this);
  // Note [Free by event ordering]: the gathered buffer came from the all-gather stream's pool.
  // Making that stream wait for the compute work queued so far means any later all-gather that
  // reuses the freed block runs after the last read of it. No recordStream, no host sync.
  compute_done_.record(rt_.compute_stream());
  compute_done_.block(rt_.all_gather_stream());
  flat_->reshard();
  state_ = UnitState::kSharded;
}

void Unit::pre_forward(const torch::nn::Module*) {
  TraceScope trace(rt_.tracer(), TraceKind::kPreForward, this);
  if (is_root()) rt_.on_root_enter();
  if (!called_in_forward_) {
    called_in_forward_ = true;
    rt_.on_pre_forward(*this);  // records order; may prefetch later units
  }
  if (strategy_ == ShardingStrategy::kNoShard) {
    if (member_calls_ % static_cast<int64_t>(members_.size()) == 0) {
      state_ = UnitState::kSharded;  // re-cast the master into the compute copy (no collective)
      unshard(/*for_backward=*/false);
    }
  } else {
    unshard(/*for_backward=*/false);
  }
  wait_unsharded();
}

void Unit::post_forward(const torch::nn::Module*, std::vector<at::Tensor>& outputs) {
  trace_end(rt_.tracer(), TraceKind::kForward, *this);
  ++member_calls_;
  const bool grad = at::GradMode::is_enabled();
  if (grad) {
    std::vector<size_t> idx;
    std::vector<at::Tensor> diff;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad()) {
        idx.push_back(i);
        diff.push_back(outputs[i]);
      }
    }
    if (!diff.empty()) {
      auto wrapped = PreBackward::apply(reinterpret_cast<int64_t>(this), at::TensorList(diff));
      for (size_t k = 0; k < idx.size(); ++k) outputs[idx[k]] = wrapped[k];
      rt_.on_outputs_hooked();
    }
  }
  const bool last_member = member_calls_ % static_cast<int64_t>(members_.size()) == 0;
  if (last_member && (reshard_after_forward_ || !grad)) reshard();
}

void Unit::pre_backward() {
  TraceScope trace(rt_.tracer(), TraceKind::kPreBackward, this);
  if (!pre_backward_done_) {
    pre_backward_done_ = true;
    rt_.on_pre_backward(*this);  // queues end-of-backward; prefetches the next units
  }
  unshard(/*for_backward=*/true);
  wait_unsharded();
  // With sync on, this backward reduces the unit: the gradient copies can wait for the reduce
  // stream (Note [Flat gradient without zero-fill] in flat_param.cpp).
  flat_->set_defer_grad_copies(rt_.requires_grad_sync());
  flat_->prepare_grad();
}

void Unit::on_grad_accumulated(size_t param_index) {
  flat_->accept_grad(param_index);
  if (++grads_ready_ == static_cast<int64_t>(grad_accumulators_.size())) post_backward();
}

void Unit::post_backward() {
  if (post_backward_done_) return;
  post_backward_done_ = true;
  trace_end(rt_.tracer(), TraceKind::kBackward, *this);
  if (rt_.requires_grad_sync()) {
    if (has_collectives()) {
      const c10::Stream rs = rt_.reduce_scatter_stream();
      rt_.release_reduce_buffers();
      stream_wait_stream(rs, rt_.compute_stream(), scratch_);  // the gradients are computed
      TraceScope trace(rt_.tracer(), TraceKind::kReduce, this);
      device_sleep(rs, rt_.options().debug_sleep_before_reduce_cycles);
      auto in_use = flat_->reduce_grad(rs);
      reduce_done_.record(rs);
      rt_.hold_reduce_buffers(std::move(in_use), &reduce_done_);
      if (strategy_ == ShardingStrategy::kNoShard) {
        counters_.all_reduces += 1;  // one all-ranks all-reduce, in two hops with HSDP
      } else {
        counters_.reduce_scatters += 1;
        if (flat_->hybrid()) counters_.replicate_all_reduces += 1;
      }
      counters_.bytes += flat_->reduce_bytes() + flat_->replicate_reduce_bytes();
      counters_.replicate_bytes += flat_->replicate_reduce_bytes();
    } else {
      flat_->drop_grad();
    }
  }
  reshard();
}

void Unit::reset_step_state() {
  member_calls_ = 0;
  called_in_forward_ = false;
  pre_backward_done_ = false;
  grads_ready_ = 0;
  post_backward_done_ = false;
}

}  // namespace flatshard
