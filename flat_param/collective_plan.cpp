#include "flat_param/collective_plan.h"

#include <c10/core/Event.h>

#include <atomic>
#include <optional>

#include "flat_param/offload.h"
#include "flat_param/upcast.h"

namespace flatshard {

int64_t GatherArgs::master_version() const { return master_version_of(master, views); }

bool full_aliases_master(const FlatParamConfig& config) {
  return !config.sharded && config.param_dtype == at::kFloat && config.offload == 0;
}

namespace {

// --- gathers ---------------------------------------------------------------------------------

// Sharded plans: this rank's slot of full() is the all-gather's output slot. Each subclass writes
// its gather() whole, so a gather costs one virtual call.
class ShardedGather : public GatherPlan {
 public:
  ShardedGather(std::string name, const FlatLayout& layout, at::ScalarType param_dtype,
                Communicator& comm)
      : GatherPlan(std::move(name)),
        begin_(layout.shard_begin(comm.rank())),
        shard_numel_(layout.shard_numel),
        padded_numel_(layout.padded_numel),
        param_dtype_(param_dtype),
        comm_(comm) {}
  int64_t bytes() const final { return shard_numel_ * c10::elementSize(param_dtype_); }

 protected:
  // This rank's slot of `full` (always the unit's FlatParam::full()), built once: a view shares
  // full()'s storage, whose bytes come back at each gather (Note [Unsharded buffer lifetime]).
  const at::Tensor& slot(const at::Tensor& full) {
    if (slot_base_ != full.unsafeGetTensorImpl()) {
      slot_ = full.narrow(0, begin_, shard_numel_);
      slot_base_ = full.unsafeGetTensorImpl();
    }
    return slot_;
  }

  int64_t begin_, shard_numel_, padded_numel_;
  at::ScalarType param_dtype_;
  Communicator& comm_;

 private:
  at::Tensor slot_;
  const c10::TensorImpl* slot_base_ = nullptr;
};

// Offload 0: cast the master into the slot (Note [Range copies]), gather in place.
class AllGather final : public ShardedGather {
 public:
  using ShardedGather::ShardedGather;
  void gather(const GatherArgs& a, c10::Stream stream) override {
    if (padded_numel_ == 0) return;
    RangeCopies cast(a.full);
    cast.copy(begin_, a.master);
    cast.run();
    comm_.all_gather(slot(a.full), a.full, stream);
  }
};

// The copy of the master an offloaded plan keeps on the device (level 1's shard, an offloaded
// NO_SHARD unit's full()): which master version it holds, the refresh() a gather must wait for,
// and Note [Delayed offload step]'s hold (the copy then changes only by refresh()).
class KeptCopy {
 public:
  // Before a gather on `stream`: orders it after the last refresh's upload; true when the copy
  // must be uploaded from the master now.
  bool stale(const GatherArgs& a, c10::Stream stream) {
    if (refreshed_) {  // refresh() uploaded on its own stream: the gather reads after it
      refreshed_->block(stream);
      refreshed_.reset();
    }
    return !held_ && changed(a);
  }
  bool changed(const GatherArgs& a) const { return a.master_version() != version_; }
  void taken(const GatherArgs& a) { version_ = a.master_version(); }
  // taken() by an upload on `stream`, which the next gather waits for.
  void refreshed(const GatherArgs& a, c10::Stream stream) {
    taken(a);
    if (stream.device_type() == c10::DeviceType::CPU) return;
    refreshed_.emplace(stream.device_type());
    refreshed_->record(stream);
  }
  void hold(bool h) { held_ = h; }

 private:
  int64_t version_ = -1;                 // master_version() the copy last took
  std::optional<c10::Event> refreshed_;  // recorded by refreshed(); the next gather waits
  bool held_ = false;
};

// Note [Host compute copy] (collective_plan.h): the compute-dtype copy of the master a CPU step
// writes, kept in host memory with the master version it holds; allocated when the stepper asks
// for it (attach, FLATSHARD_OFFLOAD_HOST_COPY=1), unused until then. Its version is read by the
// gathers on the main thread and written by the stepper's thread, never at once for a unit
// (Note [Offload step in backward]'s waits); atomic so that holds without reasoning.
class HostCopy {
 public:
  at::Tensor buffer(const GatherArgs& a) {
    if (a.full.scalar_type() == at::kFloat) return {};
    if (!host_.defined()) host_ = host_empty(a.master.numel(), a.full.scalar_type(), a.full.device());
    return host_;
  }
  bool current(const GatherArgs& a) const {
    return host_.defined() && version_.load() == a.master_version();
  }
  void prepare(const GatherArgs& a) {
    if (!host_.defined() || current(a)) return;
    host_.copy_(a.master);  // a host pass, rare: the first step, or after a load
    version_ = a.master_version();
  }
  void written(const GatherArgs& a) {
    if (host_.defined()) version_ = a.master_version();
  }
  // `dst` (compute dtype, the device) from the copy, on the current stream, without blocking
  // the host (pinned on CUDA: an asynchronous DMA of the bytes as they are).
  void upload(const at::Tensor& dst) const {
    dst.copy_(host_, /*non_blocking=*/dst.device() != host_.device());
  }

 private:
  at::Tensor host_;  // pinned on CUDA; undefined until the stepper asks for it
  std::atomic<int64_t> version_{-1};
};

// Beside backward, whose peak a refresh must not raise: 64 MiB of fp32 staging at a time.
constexpr int64_t kRefreshChunk = int64_t{16} << 20;

// Note [CPU offload], level 1: the device keeps the shard in the compute dtype, refreshed from
// the host master when its version changed; the all-gather reads it (no cast per gather).
class ResidentAllGather final : public ShardedGather {
 public:
  using ShardedGather::ShardedGather;
  int64_t resident_bytes() const override {
    return resident_.defined() ? static_cast<int64_t>(resident_.nbytes()) : 0;
  }
  void prepare(const GatherArgs&) override {  // uploaded at the first gather
    resident_ =
        at::empty({shard_numel_}, at::TensorOptions().dtype(param_dtype_).device(comm_.device()));
  }
  void gather(const GatherArgs& a, c10::Stream stream) override {
    if (padded_numel_ == 0) return;
    if (copy_.stale(a, stream)) {
      if (host_.current(a)) {
        host_.upload(resident_);
      } else {
        upload_to_device(resident_, a.master);
      }
      copy_.taken(a);
    }
    comm_.all_gather(resident_, a.full, stream);
  }
  // The upload the next gather would do, done now on `stream` (`stream` is current: FlatParam).
  // Writing resident_ here is safe: this unit's last gather read it before the unit's backward,
  // which came before the reduction the caller waited for.
  void refresh(const GatherArgs& a, c10::Stream stream, bool hold) override {
    if (padded_numel_ == 0) return;
    copy_.hold(hold);
    if (!copy_.changed(a)) return;
    if (host_.current(a)) {
      host_.upload(resident_);
    } else {
      upload_to_device_chunked(resident_, a.master, kRefreshChunk);
    }
    copy_.refreshed(a, stream);
  }
  void release_hold() override { copy_.hold(false); }
  at::Tensor host_copy(const GatherArgs& a) override { return host_.buffer(a); }
  void prepare_host_copy(const GatherArgs& a) override { host_.prepare(a); }
  void host_copy_written(const GatherArgs& a) override { host_.written(a); }

 private:
  at::Tensor resident_;  // compute-dtype shard on the device
  KeptCopy copy_;
  HostCopy host_;
};

// Note [CPU offload], level 2: nothing stays on the device; every gather uploads the master
// into the slot.
class UploadAllGather final : public ShardedGather {
 public:
  using ShardedGather::ShardedGather;
  void gather(const GatherArgs& a, c10::Stream stream) override {
    if (padded_numel_ == 0) return;
    const at::Tensor& mine = slot(a.full);
    if (host_.current(a)) {
      host_.upload(mine);
    } else {
      upload_to_device(mine, a.master);
    }
    comm_.all_gather(mine, a.full, stream);
  }
  at::Tensor host_copy(const GatherArgs& a) override { return host_.buffer(a); }
  void prepare_host_copy(const GatherArgs& a) override { host_.prepare(a); }
  void host_copy_written(const GatherArgs& a) override { host_.written(a); }

 private:
  HostCopy host_;
};

// NO_SHARD, not offloaded: recast the master into full() when it changed since full() took it
// (nothing when full() is the master). full() persists, so it is the unit's step copy (Note
// [Compute copy in the step], optim/fused_adamw.h): a step that wrote it leaves nothing to recast.
class ReplicatedRecast final : public GatherPlan {
 public:
  explicit ReplicatedRecast(bool recast) : GatherPlan("ReplicatedRecast"), recast_(recast) {}
  int64_t bytes() const override { return 0; }
  void prepare(const GatherArgs& a) override {
    if (!recast_) return;
    upload_to_device(a.full, a.master);  // same device: a plain copy_
    version_ = a.master_version();
  }
  void gather(const GatherArgs& a, c10::Stream) override {
    if (!recast_) return;
    const int64_t version = a.master_version();
    if (version == version_) return;
    RangeCopies cast(a.full);  // Note [Range copies]
    cast.copy(0, a.master);
    cast.run();
    version_ = version;
  }
  bool gather_is_noop(const GatherArgs& a) const override {
    return !recast_ || version_ == a.master_version();
  }
  at::Tensor step_copy(const GatherArgs& a) const override {
    return recast_ ? a.full : at::Tensor();
  }
  bool step_copy_current(const GatherArgs& a) const override {
    return recast_ && version_ == a.master_version();
  }
  void step_copy_written(const GatherArgs& a) override {
    if (recast_) version_ = a.master_version();
  }

 private:
  bool recast_;            // false: full() aliases the master
  int64_t version_ = -1;   // master_version() full() last took
};

// NO_SHARD, offloaded (level 2 acts as level 1, fsdp/resolve.h): full() stays on the device,
// uploaded from the host master when its version changed (or by refresh(), as level 1).
class ReplicatedUpload final : public GatherPlan {
 public:
  ReplicatedUpload() : GatherPlan("ReplicatedUpload") {}
  int64_t bytes() const override { return 0; }
  void prepare(const GatherArgs& a) override {
    upload_to_device(a.full, a.master);
    copy_.taken(a);
  }
  void gather(const GatherArgs& a, c10::Stream stream) override {
    if (copy_.stale(a, stream)) {  // Note [CPU offload]
      if (host_.current(a)) {
        host_.upload(a.full);
      } else {
        upload_to_device(a.full, a.master);
      }
      copy_.taken(a);
    }
  }
  // As ResidentAllGather::refresh: full() was last read by the unit's backward.
  void refresh(const GatherArgs& a, c10::Stream stream, bool hold) override {
    copy_.hold(hold);
    if (!copy_.changed(a)) return;
    if (host_.current(a)) {
      host_.upload(a.full);
    } else {
      upload_to_device_chunked(a.full, a.master, kRefreshChunk);
    }
    copy_.refreshed(a, stream);
  }
  void release_hold() override { copy_.hold(false); }
  at::Tensor host_copy(const GatherArgs& a) override { return host_.buffer(a); }
  void prepare_host_copy(const GatherArgs& a) override { host_.prepare(a); }
  void host_copy_written(const GatherArgs& a) override { host_.written(a); }

 private:
  KeptCopy copy_;
  HostCopy host_;
};

// --- reductions ------------------------------------------------------------------------------

// Reductions through the flat gradient: cast to the reduce dtype, collective(), upcast to
// fp32 (or not: Note [Low-precision master gradient]); land() sets or adds the result to the
// device master gradient.
class FlatGradReduce : public ReducePlan {
 public:
  FlatGradReduce(std::string name, at::ScalarType reduce_dtype, int64_t padded_numel)
      : ReducePlan(std::move(name)), reduce_dtype_(reduce_dtype), padded_numel_(padded_numel) {}
  bool needs_flat_grad() const final { return true; }
  int64_t bytes() const override { return padded_numel_ * c10::elementSize(reduce_dtype_); }
  // Note [Low-precision master gradient]: land() then takes the reduced buffer as it is.
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
  void land(const ReduceResult& r, GradState& s) override {
    at::Tensor& mg = s.master.mutable_grad();
    const at::Tensor& g = upcast_ ? r.grad : r.reduced;
    if (mg.defined()) {
      mg.add_(g);
    } else {
      mg = g;  // sharded: a fresh shard-sized buffer; replicated: the flat gradient itself
    }
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

// Note [CPU offload]: the wrapped reduction runs as without offload; its fp32 result goes to
// the host gradient on the same stream, without blocking the host.
class HostGradDelivery final : public ReducePlan {
 public:
  HostGradDelivery(std::unique_ptr<FlatGradReduce> inner, c10::Device device)
      : ReducePlan("HostGradDelivery(" + inner->name() + ")"),
        inner_(std::move(inner)),
        device_(device) {}
  bool needs_flat_grad() const override { return true; }
  int64_t bytes() const override { return inner_->bytes(); }
  int64_t replicate_bytes() const override { return inner_->replicate_bytes(); }
  ReduceResult reduce(const at::Tensor& flat_grad, c10::Stream stream) override {
    return inner_->reduce_as(flat_grad, stream, /*upcast=*/!keep_);
  }
  // r.grad was allocated on this stream (or is upcast here, on it).
  void land(const ReduceResult& r, GradState& s) override {
    at::Tensor& mg = s.master.mutable_grad();
    if (keep_ && !mg.defined() && r.reduced.scalar_type() != at::kFloat) {
      // Note [Host compute copy]: the reduce dtype's bytes go down; the step upcasts them.
      if (!reduced_host_.defined() || reduced_host_.use_count() > 1 ||
          reduced_host_.storage().use_count() > 1)
        reduced_host_ = host_empty(r.reduced.numel(), r.reduced.scalar_type(), device_);
      download_to_host(reduced_host_, r.reduced);
      reduced_ready_ = true;
      return;
    }
    const at::Tensor g = r.grad.defined() ? r.grad : to_float(r.reduced);
    if (!mg.defined()) {
      // Note [Exact pinned allocations] (offload.cpp): the last gradient's buffer again, unless
      // someone still holds it (a tensor or a view of its storage) — pinning pages per step
      // would cost more than the copy.
      if (!host_grad_.defined() || host_grad_.use_count() > 1 ||
          host_grad_.storage().use_count() > 1)
        host_grad_ = host_empty(g.numel(), at::kFloat, device_);
      mg = host_grad_;
      download_to_host(mg, g);
      return;
    }
    if (!host_grad_stage_.defined()) host_grad_stage_ = host_empty(g.numel(), at::kFloat, device_);
    download_to_host(host_grad_stage_, g);
    host_grad_staged_ = true;
  }
  void finish_host_grad(const at::Tensor& master) override {
    if (!host_grad_staged_) return;
    at::NoGradGuard no_grad;
    master.mutable_grad().add_(host_grad_stage_);
    host_grad_staged_ = false;
  }
  bool has_staged_host_grad() const override { return host_grad_staged_; }
  void keep_reduce_dtype_on_host(bool keep) override { keep_ = keep; }
  at::Tensor take_reduced_host_grad() override {
    if (!reduced_ready_) return {};
    reduced_ready_ = false;
    return reduced_host_;
  }

 private:
  std::unique_ptr<FlatGradReduce> inner_;
  bool keep_ = false;              // Note [Host compute copy]
  at::Tensor reduced_host_;        // pinned; a reduction in the reduce dtype, reused when free
  bool reduced_ready_ = false;     // reduced_host_ holds the last reduction, not yet taken
  c10::Device device_;             // the communicator's: pinned host memory when CUDA
  at::Tensor host_grad_;           // pinned; the host gradient's buffer, reused when free
  at::Tensor host_grad_stage_;     // pinned; a reduction beside an existing host gradient
  bool host_grad_staged_ = false;  // host_grad_stage_ holds one to add
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
  void land(const ReduceResult&, GradState& s) override {
    at::Tensor& mg = s.master.mutable_grad();
    const FlatLayout& l = s.layout;
    if (mg.defined()) {  // accumulating into an existing gradient: adds per parameter
      for (size_t i = 0; i < s.pending.size(); ++i) {
        at::Tensor src;
        if (s.pending[i].defined()) {
          src = s.pending[i].reshape({-1});
        } else if (s.flat_grad.defined() && s.written[i]) {
          src = s.flat_grad.narrow(0, l.offsets[i], l.numels[i]);
        }
        if (src.defined()) mg.narrow(0, l.offsets[i], l.numels[i]).add_(src);
        if (s.pending[i].defined()) s.in_use.push_back(std::move(s.pending[i]));
      }
      return;
    }
    // A fresh gradient: Note [Range copies] (range_copy_kernel.h), one launch for the copies
    // (upcasts) and the zeros, or Note [Grouped gradient copies]'s two.
    mg = at::empty({s.master.numel()},
                   s.master.options().dtype(grad_dtype_).requires_grad(false));
    RangeCopies copies(mg);
    for (size_t i = 0; i < s.pending.size(); ++i) {
      if (s.pending[i].defined()) {
        copies.copy(l.offsets[i], s.pending[i]);
        s.in_use.push_back(std::move(s.pending[i]));
      } else if (s.flat_grad.defined() && s.written[i]) {
        copies.copy(l.offsets[i], s.flat_grad, l.offsets[i], l.numels[i]);
      } else {
        copies.zero(l.offsets[i], l.numels[i]);  // no gradient reached it: zero, as the general path
      }
    }
    for (const auto& [b, e] : s.padding) copies.zero(b, e - b);
    copies.run();
  }

 private:
  at::ScalarType reduce_dtype_;
  at::ScalarType grad_dtype_;  // Note [Low-precision master gradient]
  int64_t padded_numel_;
};

}  // namespace

int64_t all_gather_bytes(const FlatParamConfig& config, const FlatLayout& layout) {
  return config.sharded ? layout.shard_numel * c10::elementSize(config.param_dtype) : 0;
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

std::unique_ptr<GatherPlan> choose_gather_plan(const FlatParamConfig& config,
                                               const FlatLayout& layout, Communicator& comm) {
  if (!config.sharded) {
    if (config.offload > 0) return std::make_unique<ReplicatedUpload>();
    return std::make_unique<ReplicatedRecast>(!full_aliases_master(config));
  }
  switch (config.offload) {
    case 1:
      return std::make_unique<ResidentAllGather>("ResidentAllGather", layout, config.param_dtype,
                                                 comm);
    case 2:
      return std::make_unique<UploadAllGather>("UploadAllGather", layout, config.param_dtype, comm);
    default:
      return std::make_unique<AllGather>("AllGather", layout, config.param_dtype, comm);
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
                                             const FlatLayout& layout, const Mesh& mesh) {
  config.validate(unit_name);
  auto plan = choose_gather_plan(config, layout, mesh.shard());
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
