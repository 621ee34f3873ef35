// flatshard/flat_param/plans.cpp — the gather and reduce plans of flat_param/collective_plan.h
// (its Contract), their closed-form bytes and make_gather_plan / make_reduce_plan, which choose
// among them and the quantized gathers (flat_param/quantized_gather.h). Kept apart from
// collective_plan.cpp so that the headers these plans need (offload_state.h, quantized_gather.h,
// which include collective_plan.h) are included by no collective_plan file.
#include "flat_param/collective_plan.h"

#include "flat_param/offload.h"
#include "flat_param/offload_state.h"
#include "flat_param/quantized_gather.h"
#include "flat_param/upcast.h"

namespace flatshard {

namespace {

// --- gathers ---------------------------------------------------------------------------------

// Sharded plans: this rank's slot of full() is the all-gather's output slot. Each subclass writes
// its gather() whole, so a gather costs one virtual call.
class ShardedGather : public GatherPlan {
 public:
  ShardedGather(std::string name, GatherArgs args, const FlatLayout& layout,
                at::ScalarType param_dtype, Communicator& comm)
      : GatherPlan(std::move(name), std::move(args)),
        begin_(layout.shard_begin(comm.rank())),
        shard_numel_(layout.shard_numel),
        padded_numel_(layout.padded_numel),
        param_dtype_(param_dtype),
        comm_(comm),
        // A view shares full()'s storage, whose bytes come back at each gather (Note
        // [Unsharded buffer lifetime]).
        slot_(args_.full.narrow(0, begin_, shard_numel_)) {}
  int64_t bytes() const final { return shard_numel_ * c10::elementSize(param_dtype_); }

 protected:
  int64_t begin_, shard_numel_, padded_numel_;
  at::ScalarType param_dtype_;
  Communicator& comm_;
  const at::Tensor slot_;  // this rank's slot of full()
};

// Offload 0: cast the master into the slot (Note [Range copies]), gather in place.
class AllGather final : public ShardedGather {
 public:
  using ShardedGather::ShardedGather;
  void gather(c10::Stream stream) override {
    if (padded_numel_ == 0) return;
    RangeCopies cast(args_.full);
    cast.copy(begin_, args_.master);
    cast.run();
    comm_.all_gather(slot_, args_.full, stream);
  }
};

// Note [Kept compute shard] (collective_plan.h): the all-gather reads the kept compute-dtype
// shard, which an optimizer step writes in its pass; cast from the master only when it is not
// current.
class KeptShardAllGather final : public ShardedGather {
 public:
  KeptShardAllGather(GatherArgs args, const FlatLayout& layout, at::ScalarType param_dtype,
                     Communicator& comm)
      : ShardedGather("KeptShardAllGather", std::move(args), layout, param_dtype, comm),
        step_(args_, at::empty({shard_numel_}, args_.full.options())) {
    extras_.step = &step_;
  }
  void gather(c10::Stream stream) override {
    if (padded_numel_ == 0) return;
    if (!step_.current()) {
      RangeCopies cast(step_.tensor());  // Note [Range copies]
      cast.copy(0, args_.master);
      cast.run();
      step_.mark_current();
    }
    comm_.all_gather(step_.tensor(), args_.full, stream);
  }

 private:
  StepCopy step_;
};

// Note [CPU offload], level 1: the device keeps the shard in the compute dtype (the offload
// copy's resident shard), refreshed from the host master when its version changed; the
// all-gather reads it (no cast per gather).
class ResidentAllGather final : public ShardedGather {
 public:
  ResidentAllGather(GatherArgs args, const FlatLayout& layout, at::ScalarType param_dtype,
                    Communicator& comm)
      : ShardedGather("ResidentAllGather", std::move(args), layout, param_dtype, comm),
        copy_(args_, OffloadCopy::Kept::kResident) {
    extras_.offload = &copy_;
  }
  void gather(c10::Stream stream) override {
    if (padded_numel_ == 0) return;
    comm_.all_gather(copy_.update(stream), args_.full, stream);
  }

 private:
  OffloadCopy copy_;
};

// Note [CPU offload], level 2: nothing stays on the device; every gather uploads the master
// into the slot.
class UploadAllGather final : public ShardedGather {
 public:
  UploadAllGather(GatherArgs args, const FlatLayout& layout, at::ScalarType param_dtype,
                  Communicator& comm)
      : ShardedGather("UploadAllGather", std::move(args), layout, param_dtype, comm),
        copy_(args_, OffloadCopy::Kept::kNone) {
    extras_.offload = &copy_;
  }
  void gather(c10::Stream stream) override {
    if (padded_numel_ == 0) return;
    copy_.upload(slot_);
    comm_.all_gather(slot_, args_.full, stream);
  }

 private:
  OffloadCopy copy_;
};

// NO_SHARD, not offloaded: recast the master into full() when it changed since full() took it
// (nothing when full() is the master). full() persists, so it is the unit's step copy (Note
// [Compute copy in the step], optim/fused_adamw.h): a step that wrote it leaves nothing to recast.
class ReplicatedRecast final : public GatherPlan {
 public:
  // `recast` false: full() aliases the master (no step copy, nothing to do).
  ReplicatedRecast(GatherArgs args, bool recast)
      : GatherPlan("ReplicatedRecast", std::move(args)) {
    if (!recast) return;
    step_ = std::make_unique<StepCopy>(args_, args_.full);
    upload_to_device(args_.full, args_.master);  // same device: a plain copy_
    step_->mark_current();
    extras_.step = step_.get();
  }
  int64_t bytes() const override { return 0; }
  void gather(c10::Stream) override {
    if (!step_ || step_->current()) return;
    RangeCopies cast(args_.full);  // Note [Range copies]
    cast.copy(0, args_.master);
    cast.run();
    step_->mark_current();
  }
  bool gather_is_noop() const override { return !step_ || step_->current(); }

 private:
  std::unique_ptr<StepCopy> step_;  // null: full() aliases the master
};

// NO_SHARD, offloaded (level 2 acts as level 1, fsdp/resolve.h): full() stays on the device,
// uploaded from the host master when its version changed (or by the offload copy's refresh(),
// as level 1).
class ReplicatedUpload final : public GatherPlan {
 public:
  explicit ReplicatedUpload(GatherArgs args)
      : GatherPlan("ReplicatedUpload", std::move(args)), copy_(args_, OffloadCopy::Kept::kFull) {
    extras_.offload = &copy_;
  }
  int64_t bytes() const override { return 0; }
  void gather(c10::Stream stream) override { copy_.update(stream); }

 private:
  OffloadCopy copy_;
};

// --- reductions ------------------------------------------------------------------------------

// Reductions through the flat gradient: cast to the reduce dtype, collective(), upcast to
// fp32 (or not: Note [Low-precision master gradient]); accumulate_master_grad() sets or adds
// the result to the device master gradient.
class FlatGradReduce : public ReducePlan {
 public:
  FlatGradReduce(std::string name, at::ScalarType reduce_dtype, int64_t padded_numel)
      : ReducePlan(std::move(name)), reduce_dtype_(reduce_dtype), padded_numel_(padded_numel) {}
  bool needs_flat_grad() const final { return true; }
  int64_t bytes() const override { return padded_numel_ * c10::elementSize(reduce_dtype_); }
  // Note [Low-precision master gradient]: accumulate_master_grad() then takes the reduced
  // buffer as it is.
  void keep_reduce_dtype() { upcast_ = false; }
  ReduceResult reduce(const at::Tensor& flat_grad, c10::Stream stream) final {
    return reduce_as(flat_grad, stream, upcast_);
  }
  // `upcast` false: the result's `grad` is left undefined (the caller converts `reduced`).
  ReduceResult reduce_as(const at::Tensor& flat_grad, c10::Stream stream, bool upcast) {
    at::Tensor send =
        flat_grad.scalar_type() == reduce_dtype_ ? flat_grad : flat_grad.to(reduce_dtype_);
    at::Tensor reduced = collective(send, stream);
    at::Tensor grad = upcast ? to_float(reduced) : at::Tensor();
    return {std::move(grad), std::move(send), std::move(reduced)};
  }
  at::Tensor accumulate_master_grad(const ReduceResult& r, const BackwardGrads&,
                                    const at::Tensor& current) override {
    const at::Tensor& g = upcast_ ? r.grad : r.reduced;
    // Sharded: a fresh shard-sized buffer; replicated: the flat gradient itself.
    if (!current.defined()) return g;
    current.add_(g);
    return current;
  }
  // `send` (reduce dtype, the whole flat buffer) to this rank's mean over ranks, reduce dtype,
  // on `stream`: a fresh buffer allocated on `stream`, or `send` itself.
  virtual at::Tensor collective(const at::Tensor& send, c10::Stream stream) = 0;

 protected:
  at::ScalarType reduce_dtype_;
  int64_t padded_numel_;
  bool upcast_ = true;
};

class ReduceScatter final : public FlatGradReduce {
 public:
  ReduceScatter(at::ScalarType reduce_dtype, const FlatLayout& layout, Communicator& comm)
      : FlatGradReduce("ReduceScatter", reduce_dtype, layout.padded_numel),
        shard_numel_(layout.shard_numel),
        comm_(comm) {}
  at::Tensor collective(const at::Tensor& send, c10::Stream stream) override {
    at::Tensor reduced = at::empty({shard_numel_}, send.options());
    comm_.reduce_scatter(send, reduced, ReduceOp::kAvg, stream);
    return reduced;
  }

 private:
  int64_t shard_numel_;
  Communicator& comm_;
};

class AllReduce final : public FlatGradReduce {
 public:
  AllReduce(at::ScalarType reduce_dtype, const FlatLayout& layout, Communicator& comm)
      : FlatGradReduce("AllReduce", reduce_dtype, layout.padded_numel), comm_(comm) {}
  at::Tensor collective(const at::Tensor& send, c10::Stream stream) override {
    comm_.all_reduce(send, ReduceOp::kAvg, stream);
    return send;
  }

 private:
  Communicator& comm_;
};

// HSDP: the shard group's average (the wrapped reduction), averaged across replicas = the mean
// over all ranks. Same stream, so it starts as soon as the reduce-scatter ends and overlaps the
// backward compute just as that does. It reads and writes only the reduced buffer, which is
// either allocated on `stream` (freed there, stream-ordered) or `send`, which reduce_grad()
// returns: nothing new for Note [Reduce buffer lifetime].
class ReplicateAllReduce final : public FlatGradReduce {
 public:
  ReplicateAllReduce(std::unique_ptr<FlatGradReduce> inner, at::ScalarType reduce_dtype,
                     const FlatLayout& layout, bool sharded, Communicator& replicate)
      : FlatGradReduce("ReplicateAllReduce(" + inner->name() + ")", reduce_dtype,
                       layout.padded_numel),
        inner_(std::move(inner)),
        reduced_numel_(sharded ? layout.shard_numel : layout.padded_numel),
        replicate_(replicate) {}
  int64_t bytes() const override { return inner_->bytes(); }
  int64_t replicate_bytes() const override {
    return reduced_numel_ * c10::elementSize(reduce_dtype_);
  }
  at::Tensor collective(const at::Tensor& send, c10::Stream stream) override {
    at::Tensor reduced = inner_->collective(send, stream);
    replicate_.all_reduce(reduced, ReduceOp::kAvg, stream, Lane::kReduce);
    return reduced;
  }

 private:
  std::unique_ptr<FlatGradReduce> inner_;
  int64_t reduced_numel_;  // elements the wrapped reduction leaves on this rank
  Communicator& replicate_;
};

// Note [CPU offload]: the wrapped reduction runs as without offload; its result goes to the host
// (HostGrad, flat_param/offload_state.h) on the same stream, without blocking the host.
class HostGradDelivery final : public ReducePlan {
 public:
  HostGradDelivery(std::unique_ptr<FlatGradReduce> inner, c10::Device device)
      : ReducePlan("HostGradDelivery(" + inner->name() + ")"),
        inner_(std::move(inner)),
        host_(device) {
    host_grad_ = &host_;
  }
  bool needs_flat_grad() const override { return true; }
  int64_t bytes() const override { return inner_->bytes(); }
  int64_t replicate_bytes() const override { return inner_->replicate_bytes(); }
  ReduceResult reduce(const at::Tensor& flat_grad, c10::Stream stream) override {
    return inner_->reduce_as(flat_grad, stream, /*upcast=*/!host_.keeps_reduce_dtype());
  }
  // r.grad was allocated on this stream (or is upcast here, on it).
  at::Tensor accumulate_master_grad(const ReduceResult& r, const BackwardGrads&,
                                    const at::Tensor& current) override {
    return host_.deliver(r, current);
  }

 private:
  std::unique_ptr<FlatGradReduce> inner_;
  HostGrad host_;
};

// Note [One-rank reduction]
// With one rank in the group (and no replicas) the reduction is the identity, and the flat
// gradient exists only to feed it: reduce_grad() writes each parameter's gradient straight into
// its region of master().grad (one read of the compute-dtype gradient, one fp32 write: the
// upcast copy_), zeroes padding and regions no gradient reached, and allocates no flat
// gradient and no reduced buffer. Against the general path (copy into the flat gradient, the
// one-rank "reduce-scatter" copy, then the upcast) that saves two compute-dtype copies of the
// unit per step and two unit-sized buffers at the backward peak. Values are the same: the
// general path's reduction of one rank changes nothing, and its upcast is exact. Only when the
// reduce dtype rounds nothing (it is the compute dtype or fp32); a lower reduce dtype takes the
// general path, whose rounding is then the requested behaviour.
class OneRankReduce final : public ReducePlan {
 public:
  OneRankReduce(at::ScalarType reduce_dtype, at::ScalarType grad_dtype, const FlatLayout& layout)
      : ReducePlan("OneRankReduce"),
        reduce_dtype_(reduce_dtype),
        grad_dtype_(grad_dtype),
        padded_numel_(layout.padded_numel) {}
  bool needs_flat_grad() const override { return false; }
  // What the general path would send (the unit's counters count it the same).
  int64_t bytes() const override { return padded_numel_ * c10::elementSize(reduce_dtype_); }
  ReduceResult reduce(const at::Tensor&, c10::Stream) override { return {}; }  // no collective
  at::Tensor accumulate_master_grad(const ReduceResult&, const BackwardGrads& s,
                                    const at::Tensor& current) override {
    const FlatLayout& l = s.layout;
    if (current.defined()) {  // accumulating into an existing gradient: adds per parameter
      for (size_t i = 0; i < s.pending.size(); ++i) {
        at::Tensor src;
        if (s.pending[i].defined()) {
          src = s.pending[i].reshape({-1});
        } else if (s.flat_grad.defined() && s.written[i]) {
          src = s.flat_grad.narrow(0, l.offsets[i], l.numels[i]);
        }
        if (src.defined()) current.narrow(0, l.offsets[i], l.numels[i]).add_(src);
      }
      return current;
    }
    // A fresh gradient: Note [Range copies] (range_copy_kernel.h), one launch for the copies
    // (upcasts) and the zeros, or Note [Grouped gradient copies]'s two.
    at::Tensor mg = at::empty({s.master.numel()},
                              s.master.options().dtype(grad_dtype_).requires_grad(false));
    RangeCopies copies(mg);
    for (size_t i = 0; i < s.pending.size(); ++i) {
      if (s.pending[i].defined()) {
        copies.copy(l.offsets[i], s.pending[i]);
      } else if (s.flat_grad.defined() && s.written[i]) {
        copies.copy(l.offsets[i], s.flat_grad, l.offsets[i], l.numels[i]);
      } else {
        copies.zero(l.offsets[i], l.numels[i]);  // no gradient reached it: zero, as the general path
      }
    }
    for (const auto& [b, e] : s.padding) copies.zero(b, e - b);
    copies.run();
    return mg;
  }

 private:
  at::ScalarType reduce_dtype_;
  at::ScalarType grad_dtype_;  // Note [Low-precision master gradient]
  int64_t padded_numel_;
};

}  // namespace

int64_t all_gather_bytes(const FlatParamConfig& config, const FlatLayout& layout) {
  if (config.sharded && config.gather_dtype != GatherDtype::kParam)
    return quantized_gather_bytes(config, layout);
  return config.sharded ? layout.shard_numel * c10::elementSize(config.param_dtype) : 0;
}

int64_t kept_shard_bytes(const FlatParamConfig& config, const FlatLayout& layout) {
  const bool kept = config.offload == 1 || (config.offload == 0 && config.keep_compute_shard);
  return config.sharded && kept ? layout.shard_numel * c10::elementSize(config.param_dtype) : 0;
}

int64_t gather_all_reduces(const FlatParamConfig& config) {
  return config.sharded && config.gather_dtype == GatherDtype::kFp8 ? 1 : 0;
}

int64_t reduce_bytes(const FlatParamConfig& config, const FlatLayout& layout) {
  return layout.padded_numel * c10::elementSize(config.reduce_dtype);
}

int64_t replicate_bytes(const FlatParamConfig& config, const FlatLayout& layout, bool hybrid) {
  if (!hybrid) return 0;
  return (config.sharded ? layout.shard_numel : layout.padded_numel) *
         c10::elementSize(config.reduce_dtype);
}

namespace {

std::unique_ptr<GatherPlan> choose_gather_plan(const std::string& unit_name,
                                               const FlatParamConfig& config,
                                               const FlatLayout& layout, Communicator& comm,
                                               GatherArgs args) {
  if (config.sharded && config.gather_dtype != GatherDtype::kParam)
    return make_quantized_gather(unit_name, config, layout, comm, std::move(args));
  if (!config.sharded) {
    if (config.offload > 0) return std::make_unique<ReplicatedUpload>(std::move(args));
    return std::make_unique<ReplicatedRecast>(std::move(args), !full_aliases_master(config));
  }
  switch (config.offload) {
    case 1:
      return std::make_unique<ResidentAllGather>(std::move(args), layout, config.param_dtype,
                                                 comm);
    case 2:
      return std::make_unique<UploadAllGather>(std::move(args), layout, config.param_dtype, comm);
    default:
      if (config.keep_compute_shard)
        return std::make_unique<KeptShardAllGather>(std::move(args), layout, config.param_dtype,
                                                    comm);
      return std::make_unique<AllGather>("AllGather", std::move(args), layout, config.param_dtype,
                                         comm);
  }
}

std::unique_ptr<ReducePlan> choose_reduce_plan(const FlatParamConfig& config,
                                               const FlatLayout& layout, const Mesh& mesh) {
  Communicator& comm = mesh.shard();
  Communicator* replicate = mesh.replicate();  // nullptr: no HSDP
  const bool hybrid = replicate != nullptr;
  // Note [One-rank reduction]: the reduce dtype must round nothing.
  if (comm.world_size() == 1 && !hybrid && config.offload == 0 &&
      (config.reduce_dtype == config.param_dtype || config.reduce_dtype == at::kFloat))
    return std::make_unique<OneRankReduce>(config.reduce_dtype, config.grad_dtype(), layout);
  std::unique_ptr<FlatGradReduce> plan;
  if (config.sharded) {
    plan = std::make_unique<ReduceScatter>(config.reduce_dtype, layout, comm);
  } else {
    plan = std::make_unique<AllReduce>(config.reduce_dtype, layout, comm);
  }
  if (hybrid)
    plan = std::make_unique<ReplicateAllReduce>(std::move(plan), config.reduce_dtype, layout,
                                                config.sharded, *replicate);
  if (config.keep_low_precision_grads) plan->keep_reduce_dtype();
  if (config.offload > 0) return std::make_unique<HostGradDelivery>(std::move(plan), comm.device());
  return plan;
}

}  // namespace

std::unique_ptr<GatherPlan> make_gather_plan(const std::string& unit_name,
                                             const FlatParamConfig& config,
                                             const FlatLayout& layout, const Mesh& mesh,
                                             GatherArgs args) {
  config.validate(unit_name);
  auto plan = choose_gather_plan(unit_name, config, layout, mesh.shard(), std::move(args));
  TORCH_INTERNAL_ASSERT(plan->bytes() == all_gather_bytes(config, layout), "unit '", unit_name,
                        "': ", plan->name(), " sends ", plan->bytes(), " bytes, the closed form ",
                        all_gather_bytes(config, layout));
  return plan;
}

std::unique_ptr<ReducePlan> make_reduce_plan(const std::string& unit_name,
                                             const FlatParamConfig& config,
                                             const FlatLayout& layout, const Mesh& mesh) {
  config.validate(unit_name);
  auto plan = choose_reduce_plan(config, layout, mesh);
  TORCH_INTERNAL_ASSERT(
      plan->bytes() == reduce_bytes(config, layout) &&
          plan->replicate_bytes() == replicate_bytes(config, layout, mesh.hybrid()),
      "unit '", unit_name, "': ", plan->name(), " sends ", plan->bytes(), " + ",
      plan->replicate_bytes(), " bytes, the closed forms ", reduce_bytes(config, layout), " + ",
      replicate_bytes(config, layout, mesh.hybrid()));
  return plan;
}

}  // namespace flatshard
