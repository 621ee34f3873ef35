// flatshard/flat_param/collective_plan.h — the collectives of one flat parameter, chosen once.
//
// Contract
// - A GatherPlan fills the unsharded buffer full() from the fp32 master; a ReducePlan turns the
//   unit's gradient into master().grad. FlatParam owns every buffer and view (master, full(),
//   the flat gradient, the parameters' views and guards). It hands the gather plan its buffers
//   once, at construction (GatherArgs, which the plan keeps), and the reduce plan what backward
//   left per call (BackwardGrads: read-only references on the stack, nothing allocated). A plan
//   writes the buffers' contents (full(), the reduced gradient) but never FlatParam's members:
//   accumulate_master_grad() returns master's .grad to be and FlatParam sets it. The plans own
//   the collectives, the casts around them, and the state only they need.
// - Optional parts (STYLE.md 17: a member that is null when unused, not a virtual no-op on
//   every plan): a gather plan's GatherExtras (OffloadCopy for the offloaded gathers,
//   flat_param/offload_state.h; StepCopy for ReplicatedRecast) and ReducePlan::host_grad()
//   (HostGradDelivery's HostGrad): each owned by its plan, set once in the plan's constructor
//   and read where it is needed through FlatParam::gather_plan().extras() and
//   reduce_plan().host_grad(), null where the unit has none. A new plan implements bytes()
//   and gather() (and gather_is_noop() if it can skip) or needs_flat_grad(), bytes(), reduce()
//   and accumulate_master_grad(), nothing more.
// - Chosen ONCE, in FlatParam's constructor, by make_gather_plan() / make_reduce_plan() from
//   the FlatParamConfig, the layout and the communicators; after that FlatParam never branches
//   on the strategy to issue a collective: unshard() calls gather(), reduce_grad() calls
//   reduce() then accumulate_master_grad(). The choice, in the factories' order:
//     gather  NO_SHARD: ReplicatedRecast (offload 0: recast master into full() when the master
//                       changed since full() took it — or an optimizer step wrote full() in
//                       its pass: Note [Compute copy in the step] —, or nothing when full()
//                       is the fp32 master itself: full_aliases_master()),
//                       ReplicatedUpload (offload 1 or 2: upload when master_version changed);
//             sharded:  Fp8AllGather / Int8AllGather (gather_dtype fp8 / int8, offload 0:
//                       quantize, all-gather bytes, dequantize; flat_param/quantized_gather.h),
//                       KeptShardAllGather (offload 0 with keep_compute_shard: all-gather the
//                       kept compute-dtype shard, recast only when the master changed since
//                       and no step wrote it: Note [Kept compute shard]),
//                       AllGather (offload 0: cast master into this rank's slot, all-gather),
//                       ResidentAllGather (offload 1: the device's compute-dtype shard, uploaded
//                       when master_version changed, or by its OffloadCopy's refresh() right
//                       after a step, is the all-gather's input),
//                       UploadAllGather (offload 2: upload into the slot at every gather).
//     reduce  OneRankReduce when one rank, no replicas, no offload and a reduce dtype that
//             rounds nothing (Note [One-rank reduction], plans.cpp); else
//             ReduceScatter (sharded) or AllReduce (NO_SHARD), wrapped by ReplicateAllReduce
//             when the replicate group has more than one rank (HSDP), and that by
//             HostGradDelivery when offloaded (Note [CPU offload], flat_param/offload.h).
//   name() spells the composition, e.g. "HostGradDelivery(ReplicateAllReduce(ReduceScatter))".
// - Streams: every call enqueues on `stream`, which FlatParam has made current (StreamGuard),
//   and returns; nothing blocks the host. The caller orders `stream` against compute (fsdp/).
// - Numerics: a plan's ops are fixed by its choice (no branch on the data), in one order on one
//   stream, so every rank issues the same collectives. Per call no allocation but the buffers
//   the collectives need and no std::function: a gather is one virtual call; a reduction is
//   reduce() and accumulate_master_grad(), plus FlatGradReduce::collective() once per layer
//   (ReplicateAllReduce adds one).
// - Bytes: bytes() is what one gather / one reduction sends from this rank (the one-rank
//   reduction counts the bytes the general path would send); replicate_bytes() the HSDP
//   all-reduce's (0 without it). Both equal the closed forms all_gather_bytes(),
//   reduce_bytes() and replicate_bytes() below (the factories check it), which explain counts.
//
// How to add a collective (an fp8 all-gather, a new reduction): docs/design.md "How to add a
// gather dtype" lists the files and steps; the closed-form byte functions below get its line.
//
// Note [Host compute copy]
// Opt-in (FLATSHARD_OFFLOAD_HOST_COPY=1): offloaded units whose CPU step flatshard drives
// (offload_step backward or delayed, fsdp/offload_step.h) move half the PCIe bytes of Note [CPU
// offload]'s fp32 host path:
// - Down: with a reduce dtype below fp32, the reduced shard goes to the host as it is (bf16: 2
//   B per element instead of the device upcast and 4 B) and the step reads it, upcasting per
//   block in cache (FusedAdamW, optim/fused_adamw.h). master's .grad then stays undefined for
//   those units (what the step consumed is not kept). A reduction that finds a host gradient
//   to add to (accumulation across steps without zero_grad) takes the fp32 path.
// - Up: the step writes the compute-dtype copy of the updated master in the same pass, into a
//   pinned host buffer the offload copy keeps (OffloadCopy::host_copy(),
//   flat_param/offload_state.h: 2 B per element); level 1's refresh (and
//   an offloaded NO_SHARD unit's), and level 2 at every gather, upload that buffer as it is
//   (no fp32 staging, no device cast) while it holds the master's current version; otherwise
//   (an optimizer step after backward, a checkpoint load) the fp32 path. The first
//   step, or one after the master changed otherwise, casts the master into it on the host
//   first (OffloadCopy::prepare_host_copy()). The gradient's side is HostGrad's
//   (keep_reduce_dtype(), take_reduced()).
// - Exact: the same kernel on the same values (bf16 -> fp32 is exact; the host cast rounds as
//   the device cast does): the fp32 path's result bit for bit (tests/offload_test.cpp, with
//   FLATSHARD_OFFLOAD_HOST_COPY=0 as the reference).
// - Cost: 2 B per element of pinned host memory for the copy; the fp32 host gradient buffer (4
//   B) is then never allocated, the bf16 one (2 B) instead. And host time: the step's upcast
//   and cast run on the host (optim/fused_adamw.cpp), 1.3-1.8x the fp32 step's time. On the
//   H200 host (16 cores) that made the 1B step slower although the device's forward and
//   backward got faster (benchmarks/RESULTS.md "Offload"): the CPU step is the bound there, so
//   the path is off by default. It pays where PCIe, not the host, bounds the step; a one-pass
//   vectorized kernel (bf16 read, fp32 state, bf16 write, no scratch pass) is the next lever.
//
// Note [Kept compute shard]
// Opt-in (ShardingOptions::keep_compute_shard): a sharded unit below fp32, not offloaded, keeps
// a compute-dtype copy of its master shard on the device between gathers (2 B per parameter /
// shard ranks for bf16) — what offload level 1 keeps for its own reasons, and what FSDP2 keeps
// as the all-gather input of its copy-in. An attached FusedAdamW writes it in the same pass as
// the update (Note [Compute copy in the step], optim/fused_adamw.h; a StepCopy as NO_SHARD's
// full()), so neither of the unit's two gathers per step casts: each all-gathers the kept
// shard as it is. When the master changed otherwise (a step that wrote no copy, a load, a
// user's in-place write) the next gather recasts it first, once. Exact: the copy is the cast the
// gather would have made (bit for bit, tests/collective_plan_test.cpp). Cost: the kept shard's
// memory (explain and the cost model count it as the unit's resident_bytes); with one rank, the
// one-rank all-gather copies it into full() instead of casting there (2 + 2 B per element
// moved instead of 4 + 2). Without an attached FusedAdamW it only adds memory: every step's
// master change makes the next gather recast, as AllGather does.
//
// Note [Low-precision master gradient]
// Opt-in (MixedPrecision::keep_low_precision_grads, FSDP1's option of that name): master().grad
// stays in the reduce dtype. The reduce-scatter's output (or the replicated all-reduce's
// buffer) becomes the master gradient as it is, and the one-rank path copies the parameters'
// gradients into a reduce-dtype buffer: no fp32 upcast pass, 2 B instead of 4 B per element
// held from backward to the step, and FusedAdamW reads the bf16 gradient in its own pass
// (Note [One-pass AdamW kernel], optim/adamw_kernel.h; exact, bf16 -> fp32 is). Steps that only
// read the gradient are bit for bit the fp32 path's; what writes it first rounds in the reduce
// dtype: clip_grad_norm_'s scaling, accumulation of synced reductions across backward passes
// (the flat gradient of an unsynced pass is the compute dtype either way). The norm itself is
// computed in fp32. Refused with offload (its host path has its own, Note [Host compute copy])
// and by the gradient scaler (unscaling fp16 in fp16 would lose the small gradients the scale
// protects). With a reduce dtype of fp32 it changes nothing.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "collectives/mesh.h"
#include "flat_param/flat_param_config.h"
#include "flat_param/layout.h"

namespace flatshard {

// What a gather plan reads and writes: FlatParam's buffers, built once, after the constructor
// has made them (handles: the same tensors, so full()'s storage coming and going and the
// master's version moving are what the plan sees). FlatParam never reassigns master() or full()
// after construction.
struct GatherArgs {
  at::Tensor master;             // fp32 shard, detached (master()'s storage and version counter)
  at::Tensor full;               // unsharded buffer (param dtype); sharded: storage when gathered
  std::vector<ShardView> views;  // with `master`: what master_version() sums
  std::vector<std::string> names;  // the parameters' names, for errors (empty: "#<index>")
  // Sum of the version counters of master and the views: changes when any is written in
  // place (an optimizer step on either, a checkpoint load). The one version of a unit's master.
  int64_t master_version() const;
};

class OffloadCopy;  // flat_param/offload_state.h

// Note [Compute copy in the step] (optim/fused_adamw.h): the device buffer (compute dtype, the
// master's element count) that keeps the master's cast between gathers and that an optimizer
// step may write in its pass (a NO_SHARD unit below fp32, not offloaded: its full(); a sharded
// unit with FlatParamConfig::keep_compute_shard: its kept shard, Note [Kept compute shard]),
// and which master version it holds. The gather recasts only when it is not current.
class StepCopy {
 public:
  // `tensor`: the copy (the master's element count, on its device, the compute dtype).
  StepCopy(const GatherArgs& args, at::Tensor tensor) : args_(args), tensor_(std::move(tensor)) {}
  const at::Tensor& tensor() const { return tensor_; }
  // It holds the master as it is now (written by a step, or cast by the last gather).
  bool current() const { return version_ == args_.master_version(); }
  // A step (or the gather's cast) just wrote it with the master's current values.
  void mark_current() { version_ = args_.master_version(); }

 private:
  const GatherArgs& args_;  // the owning plan's
  at::Tensor tensor_;
  int64_t version_ = -1;    // master_version() the copy last took
};

// Note [Deferred gather check] (flat_param/quantized_gather.h): a check of what a plan's
// gathers saw that would cost a host wait per gather on a device, deferred to one call per
// backward pass (fsdp/runtime.cpp's finalize_backward, before the optimizer step can run).
class GatherCheck {
 public:
  virtual ~GatherCheck() = default;
  // Throws c10::Error (the same on every rank: what it reads was gathered) when a gather since
  // the last call failed the check, then forgets it. Waits on the host for the device to
  // finish the last gather's check (nothing when no gather ran since the last call).
  virtual void verify() = 0;
};

// What some plans keep beside the gather (STYLE.md 17: a member that is null when unused, not
// a virtual no-op on every plan): null where the plan has none.
struct GatherExtras {
  OffloadCopy* offload = nullptr;  // Note [CPU offload]: offloaded plans (the stepper's side)
  StepCopy* step = nullptr;        // Note [Compute copy in the step]
  // Fp8AllGather (flat_param/quantized_gather.h): its last gather's per-parameter scales (fp32
  // [number of parameters]; undefined before the first gather), which fp8 matmuls requantize
  // the gathered weights with (flat_param/gathered_scale.h).
  const at::Tensor* fp8_scales = nullptr;
  GatherCheck* check = nullptr;    // Note [Deferred gather check]: quantized gathers on a device
};

class GatherPlan {
 public:
  // `args`: FlatParam's buffers, which the plan keeps (its constructor does what is due once:
  // a replicated plan fills full(), offload 1 allocates its resident shard).
  GatherPlan(std::string name, GatherArgs args)
      : name_(std::move(name)), args_(std::move(args)) {}
  virtual ~GatherPlan() = default;
  GatherPlan(const GatherPlan&) = delete;
  GatherPlan& operator=(const GatherPlan&) = delete;

  const std::string& name() const { return name_; }
  const GatherArgs& args() const { return args_; }
  // Bytes one gather sends from this rank (the closed form all_gather_bytes()).
  virtual int64_t bytes() const = 0;
  // full() from the masters, on `stream`.
  virtual void gather(c10::Stream stream) = 0;
  // True when gather() would write nothing and wait for nothing: a NO_SHARD full() that is the
  // master or holds its current cast. The unit then skips the gather and its stream events.
  virtual bool gather_is_noop() const { return false; }
  // The plan's optional parts (the plan owns them); the same pointers for the plan's life.
  GatherExtras extras() const { return extras_; }

 private:
  std::string name_;

 protected:
  GatherArgs args_;
  GatherExtras extras_;  // set by the constructor of a plan that has them
};

// A reduction's result (FlatGradReduce plans; empty for the one-rank reduction).
struct ReduceResult {
  at::Tensor grad;     // fp32: this rank's share of the mean over all ranks (shard or whole buffer)
  at::Tensor sent;     // what the collective read: the flat gradient or its reduce-dtype copy
  at::Tensor reduced;  // the collective's output (reduce dtype); freed when reduce_grad() returns
};

// What the backward passes left for one reduction, as FlatParam hands it to
// accumulate_master_grad() (read-only references into FlatParam, on the stack).
struct BackwardGrads {
  const FlatLayout& layout;
  const std::vector<std::pair<int64_t, int64_t>>& padding;  // [begin, end) gaps
  const at::Tensor& flat_grad;  // full_grad(): complete iff needs_flat_grad(); may be undefined
  const std::vector<bool>& written;  // per parameter: its region of flat_grad holds a gradient
  // Per parameter: a deferred gradient (Note [Flat gradient without zero-fill]), or undefined;
  // FlatParam keeps the ones read alive until the stream is done with them.
  const std::vector<at::Tensor>& pending;
  const at::Tensor& master;  // master(): its element count and options
};

class HostGrad;  // flat_param/offload_state.h

class ReducePlan {
 public:
  explicit ReducePlan(std::string name) : name_(std::move(name)) {}
  virtual ~ReducePlan() = default;
  ReducePlan(const ReducePlan&) = delete;
  ReducePlan& operator=(const ReducePlan&) = delete;

  const std::string& name() const { return name_; }
  // False for the one-rank reduction, which reads the gradients where they are: no flat
  // gradient, no collective.
  virtual bool needs_flat_grad() const = 0;
  // Bytes one reduction sends from this rank, without / of the HSDP replicate all-reduce.
  virtual int64_t bytes() const = 0;
  virtual int64_t replicate_bytes() const { return 0; }
  // Step 1 (needs_flat_grad() only), on `stream`: the complete flat gradient (param dtype,
  // padded_numel: every region written or zeroed) to this rank's fp32 reduced gradient.
  virtual ReduceResult reduce(const at::Tensor& flat_grad, c10::Stream stream) = 0;
  // Step 2, once FlatParam has absorbed the shard views' gradients into master's .grad (Note
  // [Original-parameter views]): the reduction `r` (or, for the one-rank reduction, `grads`)
  // added to `current`, master's .grad now, in place, or, where that is undefined, a new
  // gradient. Returns what master's .grad is to be (FlatParam sets it): `current`, the new
  // gradient, or undefined where the reduction went elsewhere (HostGrad::take_reduced()).
  virtual at::Tensor accumulate_master_grad(const ReduceResult& r, const BackwardGrads& grads,
                                            const at::Tensor& current) = 0;
  // Note [CPU offload]: where offloaded plans deliver the gradient on the host (the plan owns
  // it); null elsewhere. The same pointer for the plan's life.
  HostGrad* host_grad() const { return host_grad_; }

 private:
  std::string name_;

 protected:
  HostGrad* host_grad_ = nullptr;  // set by the constructor of a plan that delivers to the host
};

// Whether full() is the fp32 master itself (replicated, fp32 compute, not offloaded): no
// second copy, nothing to gather.
bool full_aliases_master(const FlatParamConfig& config);

// The bytes one rank sends per collective of a unit configured as `config` over `layout`, in
// closed form: what the chosen plans' bytes() / replicate_bytes() report (the factories check
// it) and what explain (planner/explain.cpp) counts, so the two agree by construction.
// Gather: the shard in param_dtype (0 for a replicated unit, whose gather is a local cast);
// with a quantized gather_dtype, quantized_gather_bytes() (flat_param/quantized_gather.h).
// Reduce: the padded flat gradient in reduce_dtype. Replicate (HSDP, `hybrid`): what the
// reduction leaves on this rank (its shard; a replicated unit's whole buffer) in reduce_dtype.
int64_t all_gather_bytes(const FlatParamConfig& config, const FlatLayout& layout);
// All-reduces one gather issues besides its all-gather: 1 for an fp8 gather (its amax,
// flat_param/quantized_gather.h; the bytes are in all_gather_bytes()), else 0; fp8_delayed
// 0, its steady state (Note [Delayed fp8 amax]: only a unit's first gather all-reduces; the
// runtime's and explain's counts leave that one out, the communicator's counters see it).
int64_t gather_all_reduces(const FlatParamConfig& config);
int64_t reduce_bytes(const FlatParamConfig& config, const FlatLayout& layout);
int64_t replicate_bytes(const FlatParamConfig& config, const FlatLayout& layout, bool hybrid);
// Device bytes a sharded unit's gather plan keeps between gathers: the compute-dtype shard of
// offload level 1 (OffloadCopy's resident shard) or of Note [Kept compute shard]; 0 otherwise.
int64_t kept_shard_bytes(const FlatParamConfig& config, const FlatLayout& layout);

// The plans of a unit laid out as `layout` whose collectives go over `mesh`: gathers and
// reductions over its shard group, and with HSDP the replicate all-reduce over its replicate
// group. Throws c10::Error naming the unit for an offload level other than 0, 1 or 2.
// The gather plan keeps `args` (FlatParam's buffers, or a test's).
std::unique_ptr<GatherPlan> make_gather_plan(const std::string& unit_name,
                                             const FlatParamConfig& config,
                                             const FlatLayout& layout, const Mesh& mesh,
                                             GatherArgs args);
std::unique_ptr<ReducePlan> make_reduce_plan(const std::string& unit_name,
                                             const FlatParamConfig& config,
                                             const FlatLayout& layout, const Mesh& mesh);

}  // namespace flatshard
