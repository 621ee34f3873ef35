#include "fsdp/unit.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <unordered_set>

#include "flat_param/collective_plan.h"
#include "fsdp/offload_step.h"
#include "fsdp/tensor_parallel.h"
#include "optim/attach.h"
#include "wrap_policies/policy.h"

namespace flatshard {

UnitCounters& UnitCounters::operator+=(const UnitCounters& o) {
  forward_all_gathers += o.forward_all_gathers;
  backward_all_gathers += o.backward_all_gathers;
  reduce_scatters += o.reduce_scatters;
  all_reduces += o.all_reduces;
  replicate_all_reduces += o.replicate_all_reduces;
  gather_all_reduces += o.gather_all_reduces;
  bytes += o.bytes;
  replicate_bytes += o.replicate_bytes;
  host_forward_ns += o.host_forward_ns;
  host_backward_ns += o.host_backward_ns;
  return *this;
}

namespace {
thread_local int hook_clock_depth = 0;
}  // namespace

HookClock::HookClock(Unit& unit, bool backward)
    : unit_(hook_clock_depth == 0 ? &unit : nullptr), backward_(backward) {
  if (unit_) start_ = std::chrono::steady_clock::now();  // nested: no clock read at all
  ++hook_clock_depth;
}

HookClock::~HookClock() {
  --hook_clock_depth;
  if (unit_)
    unit_->add_host_ns(backward_, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                      std::chrono::steady_clock::now() - start_)
                                      .count());
}

namespace {

// Runs after parameter `index`'s AccumulateGrad: moves its gradient into the flat buffer (or
// leaves that to the reduction) and counts the unit's parameters whose gradient is in. Purely
// unit-local: the unit reduces itself when the last one is in; the runtime is not involved.
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

// Note [Frozen parameters]
// A parameter with requires_grad false when fully_shard runs stays in its unit's flat buffer:
// the forward reads it, so it is gathered like the others, but autograd computes no gradient
// for it and it has no AccumulateGrad node, so the unit waits only for its trainable ones.
// - A unit with no trainable parameter never reduces, prepares no flat gradient, and its master
//   does not require grad (ShardedModel::parameters() leaves it out). Its backward still reads
//   the parameters when its inputs require grad (a gradient for the layers before it); with no
//   AccumulateGrad to tell when that backward is over, the runtime wraps those inputs in an
//   identity (FrozenInput, fsdp/runtime.cpp) whose backward runs once the input's gradient is
//   complete: after the last one the unit post-backwards and reshards at once instead of staying
//   gathered to the end of backward (FSDP's "reshard-only" post-backward hook, same reason). A
//   unit entered through flatshard::enter (no inputs to wrap) reshards at the end of backward.
// - A unit mixing frozen and trainable parameters can have its last trainable gradient in
//   before its backward is over: a frozen module that runs first in the unit's forward (a frozen
//   norm at the head of a Block) still computes its input's gradient, reading its weight, after
//   every trainable AccumulateGrad ran. So its inputs are wrapped too, and it post-backwards
//   when both its trainable gradients and its inputs' gradients are in (resharding on the first
//   alone made that norm's backward read a guarded parameter: "read while the unit is sharded").
// - A unit mixing frozen and trainable parameters reduces its whole flat gradient in one
//   reduce-scatter, the frozen ranges as zeros (like padding). Why not reduce the trainable
//   ranges only: every rank's shard is a contiguous range of the flat buffer, so a trainable-
//   only reduction needs either a second flat layout (and copies between the two per step) or
//   one collective per trainable range — the per-tiny-tensor collectives the design removes. The
//   price is the frozen fraction of the unit's reduce bytes; for a unit that is mostly frozen
//   (adapters beside a frozen base layer), make the trainable modules units of their own.
// - Frozen values never change: no gradient reaches them and no optimizer holds them
//   (parameters() gives a mixed unit's trainable shard views, not its master: Note
//   [Original-parameter views], flat_param/flat_param.h), so weight decay cannot move them.
// - Fixed at setup: the fingerprint compares requires_grad across ranks (a rank that froze
//   something else would skip a reduce-scatter the others issue), and a change afterwards is an
//   error at the next step's start (check_trainable_unchanged), not silent.

Unit::Unit(int index, UnitSpec spec, const ResolvedUnit& settings,
           std::vector<const torch::nn::Module*> members, std::vector<ParamRef> params,
           const UnitContext& context, const std::function<void()>& fill,
           const FlatParam::RangeFill& load_ranges)
    : index_(index),
      spec_(std::move(spec)),
      strategy_(settings.strategy),
      reshard_after_forward_(settings.reshard_after_forward),
      recompute_(settings.recompute),
      members_(std::move(members)),
      ctx_(context) {
  flat_ = std::make_unique<FlatParam>(spec_.name, std::move(params), ctx_.mesh, settings.flat,
                                      fill, load_ranges);
  // FlatParam derives its layout's world size from config.sharded; explain() takes it from the
  // resolver (fsdp/resolve.h). They must be the same rule.
  TORCH_INTERNAL_ASSERT(flat_->layout().world_size == settings.layout_world_size, "unit '",
                        spec_.name, "': layout over ", flat_->layout().world_size,
                        " ranks, resolved ", settings.layout_world_size);
  trace_info_ = TraceUnit{index_,
                          spec_.name,
                          strategy_,
                          reshard_after_forward_,
                          flat_->layout().padded_numel,
                          flat_->gather_plan().bytes(),
                          flat_->reduce_plan().bytes()};
  // As a policy writes the type ("Linear", not "torch::nn::LinearImpl"): one name everywhere.
  trace_info_.kind = spec_.is_root || members_.empty()
                         ? "<root>"
                         : policy_type_name(members_.front()->name());
  state_ = flat_->is_unsharded() ? UnitState::kUnsharded : UnitState::kSharded;
  // After set_data (dtype may have changed), so these are the accumulators autograd will use.
  hook_grad_accumulators();
  // Note [Recompute]: the same tensors (parameter views never change, Note [Unsharded buffer
  // lifetime]) for every step, so they are listed once.
  if (recompute_) {
    for (const torch::nn::Module* m : members_) {
      std::vector<at::Tensor> leaves;
      std::unordered_set<const c10::TensorImpl*> seen;
      for (const at::Tensor& p : m->parameters(/*recurse=*/true))
        if (seen.insert(p.unsafeGetTensorImpl()).second) leaves.push_back(p);
      recompute_leaves_.push_back(std::move(leaves));
    }
  }
  // Last, once nothing here can throw: Note [CPU offload]'s lifecycle keeps the flat parameter.
  if (ctx_.offload) ctx_.offload->add_unit(*flat_, index_);
}

const std::vector<at::Tensor>& Unit::recompute_leaves(const torch::nn::Module* member) const {
  for (size_t k = 0; k < members_.size(); ++k)
    if (members_[k] == member && k < recompute_leaves_.size()) return recompute_leaves_[k];
  static const std::vector<at::Tensor> kNone;
  return kNone;
}

// Note [Frozen parameters]: a frozen parameter has no AccumulateGrad node; the unit's gradients
// are in when every trainable one's has run.
void Unit::hook_grad_accumulators() {
  for (size_t i = 0; i < flat_->params().size(); ++i) {
    const ParamRef& p = flat_->params()[i];
    if (!flat_->trainable(i)) continue;
    auto acc = torch::autograd::impl::grad_accumulator(p.param);
    TORCH_INTERNAL_ASSERT(acc, "unit '", spec_.name, "': no grad accumulator for '", p.name, "'");
    hook_keys_.push_back(acc->add_post_hook(std::make_unique<GradReadyHook>(this, i)));
    grad_accumulators_.push_back(std::move(acc));
  }
}

void Unit::rehook_grad_accumulators() {
  for (size_t i = 0; i < grad_accumulators_.size(); ++i)
    grad_accumulators_[i]->del_post_hook(hook_keys_[i]);
  grad_accumulators_.clear();  // autograd caches them weakly: now they die, unless in a graph
  hook_keys_.clear();
  hook_grad_accumulators();
}

Unit::~Unit() {
  for (size_t i = 0; i < grad_accumulators_.size(); ++i)
    grad_accumulators_[i]->del_post_hook(hook_keys_[i]);
}

void Unit::unshard(bool for_backward) {
  if (state_ == UnitState::kUnsharded) return;
  const c10::Stream ag = ctx_.all_gather_stream;
  // The master shard may have just been updated by the optimizer on the compute stream.
  stream_wait_stream(ag, ctx_.compute_stream(), scratch_);
  TraceScope trace(ctx_.tracer, TraceKind::kAllGather, &trace_info_);
  device_sleep(ag, ctx_.debug_sleep_before_all_gather_cycles);
  // Guarded until the unit is entered (Note [Guarded sharded parameters]): a prefetched unit's
  // parameters become readable only once the compute stream waits for this gather.
  flat_->unshard(ag, /*attach=*/false);
  all_gather_done_.record(ag);
  all_gather_pending_ = true;
  state_ = UnitState::kUnsharded;
  if (has_collectives() && strategy_ != ShardingStrategy::kNoShard) {
    (for_backward ? counters_.backward_all_gathers : counters_.forward_all_gathers) += 1;
    counters_.bytes += flat_->gather_plan().bytes();
    counters_.gather_all_reduces += gather_all_reduces(flat_->config());
  }
}

void Unit::wait_unsharded() {
  if (!all_gather_pending_) return;
  TraceScope trace(ctx_.tracer, TraceKind::kWaitAllGather, &trace_info_);
  all_gather_done_.block(ctx_.compute_stream());
  all_gather_pending_ = false;
}

void Unit::reshard() {
  if (strategy_ == ShardingStrategy::kNoShard || state_ == UnitState::kSharded) return;
  TraceScope trace(ctx_.tracer, TraceKind::kReshard, &trace_info_);
  // Note [Free by event ordering]: the gathered buffer came from the all-gather stream's pool.
  // Making that stream wait for the compute work queued so far means any later all-gather that
  // reuses the freed block runs after the last read of it. No recordStream, no host sync.
  compute_done_.record(ctx_.compute_stream());
  compute_done_.block(ctx_.all_gather_stream);
  flat_->reshard();
  state_ = UnitState::kSharded;
}

bool Unit::mark_called_in_forward() {
  if (called_in_forward_) return false;
  called_in_forward_ = true;
  return true;
}

bool Unit::mark_pre_backward() {
  if (pre_backward_done_) return false;
  pre_backward_done_ = true;
  return true;
}

void Unit::pre_forward(const torch::nn::Module*) {
  if (strategy_ == ShardingStrategy::kNoShard) {
    // Re-cast the master into the compute copy (no collective), unless it is current (the fp32
    // master itself, or written by the step: Note [Compute copy in the step]) — then there is
    // nothing to order either.
    if (member_calls_ % static_cast<int64_t>(members_.size()) == 0 && !flat_->gather_is_noop()) {
      state_ = UnitState::kSharded;
      unshard(/*for_backward=*/false);
    }
  } else {
    unshard(/*for_backward=*/false);
  }
  wait_unsharded();
  flat_->attach_params();
}

void Unit::post_forward(const torch::nn::Module*, bool grad_enabled) {
  ++member_calls_;
  const bool last_member = member_calls_ % static_cast<int64_t>(members_.size()) == 0;
  if (last_member && (reshard_after_forward_ || !grad_enabled)) reshard();
}

void Unit::pre_backward() {
  unshard(/*for_backward=*/true);
  wait_unsharded();
  flat_->attach_params();
  // With sync on, this backward reduces the unit: the gradient copies can wait for the reduce
  // stream (Note [Flat gradient without zero-fill] in flat_param.cpp).
  if (!flat_->any_trainable()) return;  // frozen: the backward only reads the parameters
  flat_->set_defer_grad_copies(requires_grad_sync_);
  // (With one rank the reduction reads the gradients directly: Note [One-rank reduction].)
  if (!(requires_grad_sync_ && !flat_->reduce_plan().needs_flat_grad())) flat_->prepare_grad();
}

void Unit::on_frozen_input(bool backward) {
  HookClock clock(*this, backward);
  if (!backward) {
    ++frozen_inputs_pending_;
    return;
  }
  // The last input's gradient is out: the unit's backward is done with its parameters (a mixed
  // unit: once its trainable gradients are in too).
  if (--frozen_inputs_pending_ == 0 && pre_backward_done_ &&
      grads_ready_ == static_cast<int64_t>(grad_accumulators_.size()))
    post_backward();
}

void Unit::check_trainable_unchanged(int rank) const {
  for (size_t i = 0; i < flat_->params().size(); ++i) {
    const ParamRef& p = flat_->params()[i];
    TORCH_CHECK(p.param.requires_grad() == flat_->trainable(i), "flatshard: parameter '",
                p.name, "' of unit '", spec_.name, "' (rank ", rank, ") was ",
                flat_->trainable(i) ? "trainable" : "frozen",
                " when fully_shard ran and now has requires_grad=", p.param.requires_grad(),
                ". Which parameters train is fixed at setup (it decides the unit's reduction "
                "and its optimizer parameters): set requires_grad before fully_shard");
  }
}

void Unit::on_grad_accumulated(size_t param_index) {
  HookClock clock(*this, /*backward=*/true);
  flat_->accept_grad(param_index);
  // Note [Frozen parameters]: a mixed unit also waits for its wrapped inputs' gradients.
  if (++grads_ready_ == static_cast<int64_t>(grad_accumulators_.size()) &&
      frozen_inputs_pending_ == 0)
    post_backward();
}

void Unit::post_backward() {
  if (post_backward_done_) return;
  HookClock clock(*this, /*backward=*/true);  // also from the runtime's finalize_backward
  post_backward_done_ = true;
  trace_end(ctx_.tracer, TraceKind::kBackward, trace_info_);
  if (requires_grad_sync_) {
    if (has_collectives() && flat_->any_trainable()) {
      const c10::Stream rs = ctx_.reduce_scatter_stream;
      // Note [Reduce buffer lifetime] (fsdp/reduce_buffers.h): the previous reduction's buffers
      // go back to the allocator once compute has waited for it; ours are held until the next.
      ctx_.reduce_buffers.release(ctx_.compute_stream(), ctx_.tracer);
      stream_wait_stream(rs, ctx_.compute_stream(), scratch_);  // the gradients are computed
      TraceScope trace(ctx_.tracer, TraceKind::kReduce, &trace_info_);
      device_sleep(rs, ctx_.debug_sleep_before_reduce_cycles);
      // Note [Delayed offload step]: the unit's last step no longer reads its host gradient.
      if (ctx_.offload) ctx_.offload->before_reduction(*flat_);
      auto in_use = flat_->reduce_grad(rs);
      reduce_done_.record(rs);
      ctx_.reduce_buffers.hold(std::move(in_use), &reduce_done_);
      // Note [Offload step in backward]: the host master steps as soon as its gradient lands.
      if (ctx_.offload) ctx_.offload->after_reduction(*flat_, rs);
      if (strategy_ == ShardingStrategy::kNoShard) {
        counters_.all_reduces += 1;  // one all-ranks all-reduce, in two hops with HSDP
      } else {
        counters_.reduce_scatters += 1;
        if (ctx_.mesh.hybrid()) counters_.replicate_all_reduces += 1;
      }
      const ReducePlan& plan = flat_->reduce_plan();
      counters_.bytes += plan.bytes() + plan.replicate_bytes();
      counters_.replicate_bytes += plan.replicate_bytes();
    } else {
      flat_->drop_grad();
    }
  }
  reshard();
}

UnitInfo Unit::info() const {
  const FlatLayout& l = flat_->layout();
  return UnitInfo{name(),         strategy_,     reshard_after_forward_,
                  l.used_numel,   l.padded_numel, flat_->master().numel(),
                  flat_->params().size(),
                  flat_->gather_plan().extras().step != nullptr};
}

std::vector<at::Tensor> Unit::optimizer_params() const {
  std::vector<at::Tensor> out;
  const FlatParam& f = *flat_;
  if (f.layout().padded_numel == 0 || !f.any_trainable()) return out;
  if (f.all_trainable()) {
    out.push_back(f.master());
    return out;
  }
  for (size_t i = 0; i < f.params().size(); ++i)
    if (f.trainable(i) && f.shard_views()[i].numel() > 0) out.push_back(f.shard_views()[i].tensor);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> Unit::named_shard_views() {
  flat_->set_views_active(true);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < flat_->params().size(); ++i)
    out.emplace_back(flat_->params()[i].name, flat_->shard_views()[i].tensor);
  return out;
}

void Unit::grad_norm_sq(const at::Tensor& out, const TensorParallel* tp) {
  flat_->absorb_view_grads();  // zero_grad on the views since the reduction
  const at::Tensor& g = flat_->master().grad();
  if (!g.defined()) return;
  // A replicated unit's gradient is identical on every rank: count it on rank 0 only.
  const bool no_shard = strategy_ == ShardingStrategy::kNoShard;
  const int rank = ctx_.mesh.shard().rank();
  if (no_shard && rank != 0) return;
  // Note [Low-precision master gradient]: a bf16 / fp16 gradient's norm in fp32.
  const at::Tensor g32 = g.to(at::kFloat);  // g if fp32
  if (tp == nullptr || tp->tp_rank() == 0) {
    out.copy_(g32.pow(2).sum());
    return;
  }
  // Other tp ranks: only the split parameters' parts of this rank's shard.
  const FlatLayout& layout = flat_->layout();
  const int64_t begin = no_shard ? 0 : layout.shard_begin(rank);
  const int64_t end = begin + g32.numel();
  for (size_t j = 0; j < flat_->params().size(); ++j) {
    if (!tp->is_split(flat_->params()[j].param)) continue;
    const int64_t lo = std::max(begin, layout.offsets[j]);
    const int64_t hi = std::min(end, layout.offsets[j] + layout.numels[j]);
    if (hi > lo) out.add_(g32.narrow(0, lo - begin, hi - lo).pow(2).sum());
  }
}

void Unit::scale_grad(double coef) {
  at::Tensor g = flat_->master().grad();
  if (!g.defined()) return;
  if (g.scalar_type() == at::kFloat) {
    g.mul_(coef);
  } else {  // Note [Low-precision master gradient]: scaled in fp32, rounded once
    g.copy_(g.to(at::kFloat).mul_(coef));
  }
}

void Unit::gather_full(bool grads, std::vector<std::pair<std::string, at::Tensor>>& out) {
  FlatParam& f = *flat_;
  if (grads) f.absorb_view_grads();  // zero_grad on the views since the reduction
  const FlatLayout& l = f.layout();
  at::Tensor local = f.master();
  if (grads)
    local = f.master().grad().defined()
                ? f.master().grad()
                : at::zeros_like(local, local.options().dtype(f.config().grad_dtype()));
  const at::Tensor full = f.gather_whole(local);
  for (size_t i = 0; i < f.params().size(); ++i)
    out.emplace_back(f.params()[i].name,
                     full.narrow(0, l.offsets[i], l.numels[i]).view(l.shapes[i]).clone());
}

void Unit::offer_to(AttachTarget& target) const { target.units.push_back(flat_.get()); }

void Unit::reset_step_state() {
  member_calls_ = 0;
  called_in_forward_ = false;
  pre_backward_done_ = false;
  grads_ready_ = 0;
  post_backward_done_ = false;
  frozen_inputs_pending_ = 0;
}

}  // namespace flatshard
