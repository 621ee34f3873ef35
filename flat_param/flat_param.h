// flatshard/flat_param/flat_param.h — one unit's parameters as one flat, sharded buffer.
//
// Contract
// - Built once from the unit's original parameters (all floating point, one device). After
//   construction every original parameter is a view (set_data) of `full()`, the unsharded
//   buffer in the compute dtype; module code is unchanged and keeps reading its members.
// - `master()` is the fp32 local shard ([shard_numel]; the whole padded buffer for replicated
//   units). It is a leaf that requires grad: the optimizer's parameter. Padding is zero.
// - unshard(): full() gets storage, this rank's slot gets cast(master), one all-gather fills the
//   rest. reshard(): full()'s storage is resized to 0 bytes; the views stay valid objects.
//   Note [Unsharded buffer lifetime]: views never change; only the storage behind full() is
//   freed and re-created, so autograd's saved references to parameters stay usable as long as
//   the buffer is regathered before they are read (pre-backward does that).
// - Note [Guarded sharded parameters]: while a sharded unit's parameters are not attached
//   (after reshard(), or gathered by unshard(stream, /*attach=*/false) for a prefetch), each
//   parameter's TensorImpl points at its own guard storage instead of full()'s: no data, the
//   full buffer's byte size (so views and shape checks pass), and a data access that throws a
//   c10::Error naming the unit and the parameter and saying what to do. attach_params() points
//   them back at full()'s storage. Only the storage pointer changes: the TensorImpl (what
//   autograd saved and the optimizer check compares) and its sizes, strides and offset stay.
// - Frozen parameters (requires_grad false at construction) stay in the flat buffer: gathered
//   like the others (the forward reads them), never given a gradient (autograd computes none
//   for them; their regions of the flat gradient are zeroed like padding), and not optimizer
//   parameters. A unit with no trainable parameter never reduces (Note [Frozen parameters]).
// - Note [Original-parameter views]: shard_views() gives, per original parameter, the part of
//   it this rank's master() holds, as a 1-D tensor sharing master()'s storage (possibly empty),
//   a leaf that requires grad iff the parameter is trainable: what an optimizer needs for
//   parameter groups by name (FSDP's use_orig_params). With set_views_active(true) (always for
//   units that mix frozen and trainable parameters) each reduction keeps the views' .grad equal
//   to their slices of master().grad: before accumulating, a view whose .grad was cleared
//   (zero_grad(set_to_none)) zeroes its slice and one the user replaced is copied in; after
//   it, every trainable view's .grad is again its slice.
// - Gradients: prepare_grad() gives full_grad() storage (not zeroed); after each parameter's
//   AccumulateGrad, accept_grad(i) moves its .grad into the flat buffer and points .grad at its
//   view there, so further backward passes add in place (Note [Flat gradient without
//   zero-fill]). With set_defer_grad_copies(true) (the reduction follows in this backward) it
//   only keeps a reference to .grad and reduce_grad() does the copy on its own stream; the
//   kept gradients are among the buffers reduce_grad() returns. reduce_grad() zeroes what no
//   gradient wrote and turns the buffer into master().grad with ONE reduce-scatter (sharded) or
//   ONE all-reduce (replicated), averaged over ranks, accumulating into an existing master grad.
// - HSDP (collectives/mesh.h): with a mesh whose replicate group has more than one rank,
//   the shard group shards; reduce_grad() then also all-reduces (average) the reduced
//   gradient across the replicate group on the same stream, right after the reduce-scatter (or the
//   all-reduce of a replicated unit), so the result is the mean over all R * S ranks. At
//   construction rank 0's values are broadcast within the shard group, then across replicas.
// - Deferred values (Note [Deferred initialization], fsdp/deferred_init.h): built with a `fill`
//   function, the parameters must be meta tensors (shapes only). The constructor allocates the
//   fp32 flat buffer it would have copied the values into (padding zero) and points every fp32
//   parameter at its region of it (materialize_meta: same TensorImpl), a parameter of another
//   dtype at a tensor of its own; calls fill() once, which writes the values in place; checks
//   that every parameter kept its shape, dtype, device and storage; and agrees across ranks
//   (collectives/agree.h, over the mesh) before any collective of the unit, so a
//   fill that throws or breaks the layout on any rank throws on every rank, naming the unit,
//   the rank and the cause. Then it goes on as if the values had been copied in (broadcast
//   with sync_module_states, keep the shard). Peak: the flat fp32 buffer, the master shard
//   and (briefly) full(); no second copy of the unit.
// - Loaded values (Note [Loading into shards], fsdp/deferred_init.h): built with `load_ranges`
//   instead, the parameters must be meta tensors too, but no full buffer is made: master()
//   starts as zeros of this rank's shard (padding zero), `load_ranges(i, begin, end, dst)` is
//   called for each parameter i that intersects it, with elements [begin, end) of the
//   flattened parameter and `dst` the master's slice that holds them; then the unit agrees
//   across ranks (as for `fill`) and goes on without any broadcast: every rank read its own
//   part. The parameters take full()'s views directly. Peak: the master shard and (briefly)
//   full().
// - CPU offload (Note [CPU offload], flat_param/offload.h), config.offload 1 or 2: master()
//   and its gradient are host tensors (pinned on CUDA); level 1 keeps a compute-dtype copy of
//   the shard on the device, refreshed at the first unshard() after the master's version
//   (GatherArgs::master_version(): master() and its views) changed; level 2 uploads the master
//   at every unshard(). reduce_grad() ends with an asynchronous copy of the reduced shard to the
//   host gradient; the caller synchronizes with the stream and calls
//   reduce_plan().host_grad()->finish(master()) before the optimizer reads it. What only an
//   offloaded or step-copy unit has is owned by its plans and reached through them
//   (gather_plan().extras(), reduce_plan().host_grad(): flat_param/collective_plan.h).
// - All collectives go through the given Communicator on the given stream; the caller orders
//   streams (fsdp/ does). No method here blocks the host on the device. Which collectives run
//   is decided once, at construction: a GatherPlan for unshard() and a ReducePlan for
//   reduce_grad() (flat_param/collective_plan.h); FlatParam keeps the buffers and views.
// - Not thread-safe; one FlatParam per unit per rank.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/mesh.h"
#include "flat_param/flat_param_config.h"
#include "flat_param/layout.h"

namespace flatshard {

class GatherPlan;  // flat_param/collective_plan.h
class ReducePlan;

struct ParamRef {
  std::string name;  // fully qualified, for messages
  at::Tensor param;  // the module's parameter handle (a leaf)
};

class FlatParam {
 public:
  // Elements [begin, end) of the flattened parameter `param` (index into params) into `dst`,
  // a 1-D fp32 slice of master() on the communicator's device.
  using RangeFill =
      std::function<void(size_t param, int64_t begin, int64_t end, const at::Tensor& dst)>;

  // `fill`: deferred values; `load_ranges`: loaded values (see the contract; at most one of
  // the two); both empty: the parameters hold their values.
  // `mesh`: the shard group (and with HSDP the replicate group) the unit's collectives run over.
  FlatParam(std::string unit_name, std::vector<ParamRef> params, const Mesh& mesh,
            const FlatParamConfig& config, const std::function<void()>& fill = {},
            const RangeFill& load_ranges = {});
  ~FlatParam();
  FlatParam(const FlatParam&) = delete;
  FlatParam& operator=(const FlatParam&) = delete;

  const std::string& unit_name() const { return unit_name_; }
  const FlatLayout& layout() const { return layout_; }
  const FlatParamConfig& config() const { return config_; }
  const std::vector<ParamRef>& params() const { return params_; }
  // The collectives chosen at construction (flat_param/collective_plan.h), with the optional
  // parts they own: extras() (OffloadCopy, StepCopy) and host_grad().
  const GatherPlan& gather_plan() const { return *gather_; }
  const ReducePlan& reduce_plan() const { return *reduce_; }

  // Whether parameter i requires grad (read once, at construction).
  bool trainable(size_t i) const { return trainable_[i]; }
  bool any_trainable() const { return num_trainable_ > 0; }
  bool all_trainable() const { return num_trainable_ == params_.size(); }
  // Note [Original-parameter views]: one per parameter, in params() order.
  const std::vector<ShardView>& shard_views() const { return views_; }
  // Keep the views' .grad in step with master().grad from now on (idempotent; on by default for
  // units with frozen and trainable parameters). Points them at master().grad at once.
  void set_views_active(bool active);
  bool views_active() const { return views_active_; }
  // Views active: makes master().grad agree with the views' .grad (a cleared .grad is zero, a
  // replaced one is copied in) on the current stream; undefined when every trainable view's
  // .grad is cleared. Returns the replaced gradients read (the caller keeps them alive until
  // the stream's work is done). No-op otherwise.
  std::vector<at::Tensor> absorb_view_grads();
  // Views active and every trainable view's .grad cleared (zero_grad(set_to_none) on an
  // optimizer over the views): drops master().grad too, so the memory is free before the next
  // forward instead of at this unit's next reduction (as zero_grad on the master would).
  void release_cleared_grad();

  // Never reassigned after construction (the gather plan keeps it: GatherArgs, whose
  // master_version() changes when it or a view is written in place); written in place (an
  // optimizer step, a checkpoint load).
  const at::Tensor& master() const { return master_; }
  const at::Tensor& full() const { return full_; }
  const at::Tensor& full_grad() const { return full_grad_; }
  bool is_unsharded() const;

  // Gathers full() from the master shards (cast to param_dtype) on `stream`. For replicated
  // units: recasts master into full() when they are separate buffers. `attach`: the parameters
  // read full() from now on (attach_params()); false leaves them guarded (a prefetch: the
  // caller attaches them once the consumer is ordered after the gather).
  void unshard(c10::Stream stream, bool attach = true);
  // Frees full()'s storage and guards the parameters (sharded units only; a no-op for
  // replicated ones). Note [Guarded sharded parameters].
  void reshard();
  // Points the parameters at full()'s storage (idempotent); full() must be gathered.
  void attach_params();
  // Allocates full_grad() (uninitialised; NaN with poison_padding). No-op if it is already
  // prepared (gradient accumulation across backward passes).
  void prepare_grad();
  // Whether accept_grad() leaves the copy to reduce_grad() (Note [Flat gradient without
  // zero-fill]). Set it when reduce_grad() follows in this backward pass (gradient sync on);
  // otherwise the gradients would stay pending, held beside full_grad(), until the next
  // reduce_grad() or drop_grad(). Off, they land in full_grad() at once, ready for the next
  // pass to add in place. Off by default; stays as set.
  void set_defer_grad_copies(bool defer) { defer_grad_copies_ = defer; }
  // After parameter i's AccumulateGrad (on the compute stream): its .grad, if not already its
  // view of full_grad(), is copied there (it is the whole gradient even if the region was
  // written before: Note [Replaced gradient]) and replaced by that view. Deferring: .grad is
  // left as is and only remembered (pending) for reduce_grad(); a later call that finds another
  // .grad (out-of-place accumulation, which includes the pending one) remembers that instead.
  void accept_grad(size_t i);
  // Copies the pending gradients into full_grad(), then one reduce-scatter / all-reduce
  // (average over ranks) of it into master().grad, all enqueued on `stream`, which must already
  // be ordered after the compute stream. Clears the parameters' .grad and drops full_grad();
  // returns the buffers `stream` still reads (the pending gradients among them), which the
  // caller must keep alive until work on the allocating (compute) stream is ordered after
  // `stream` (Note [Reduce buffer lifetime]).
  std::vector<at::Tensor> reduce_grad(c10::Stream stream);
  // Clears the parameters' .grad and the pending gradients, frees full_grad() without reducing.
  void drop_grad();

  // Whether unshard() would write and wait for nothing (GatherPlan::gather_is_noop).
  bool gather_is_noop() const;

  // The one way to see a tensor laid out as master() (the master, its gradient, an optimizer
  // state) whole: all-gathered over the shard group into a new [padded_numel] buffer on the
  // current stream, on the device (an offloaded unit's host tensor is copied there first);
  // a replicated unit's is itself (on the device). Undefined `local`: zeros of master()'s shape.
  // Collective over the shard group for sharded units.
  at::Tensor gather_whole(const at::Tensor& local) const;

  // True when reduce_grad() also all-reduces across replicas.
  bool hybrid() const { return mesh_.hybrid(); }

 private:
  // Construction, in this order (flat_param.cpp).
  // The parameters' checks (dtype, device, leaf, meta iff `deferred`); their shapes; trainable_.
  std::vector<std::vector<int64_t>> check_params(bool deferred);
  // layout_ over the shard group (1 rank for replicated units), padding_, pending_.
  void make_layout(const std::vector<std::vector<int64_t>>& shapes);
  // master_ on the device: loaded (load_master), or the full fp32 values copied or filled
  // (fill_deferred), broadcast (broadcast_values) and sliced to this rank's shard.
  void initial_values(const std::function<void()>& fill, const RangeFill& load_ranges);
  // Deferred values: materialises the parameters in `init` (or beside it), runs `fill`, checks
  // and agrees, then copies the values that are not already in `init` there.
  void fill_deferred(const at::Tensor& init, const std::function<void()>& fill);
  // Loaded values: master_ = zeros of the shard, each intersecting range read into it, agreed.
  void load_master(const RangeFill& load_ranges);
  // sync_module_states: rank 0's values within the shard group, then across replicas.
  void broadcast_values(const at::Tensor& init);
  // reduce_ (flat_param/collective_plan.h), once; it validates the config.
  void choose_plans();
  // Note [CPU offload]: master_ moves to (pinned) host memory.
  void move_to_host();
  // master_ becomes the optimizer's leaf; views_ (Note [Original-parameter views]).
  void make_views();
  // full_ (the master itself for replicated fp32), then gather_ over master_ and full_ (its
  // own buffers with it) and its extras.
  void make_full_buffer();
  // The parameters become views of full_; sharded units: guards made, full_ freed, guarded.
  void attach_and_guard();

  // Note [Flat gradient without zero-fill]: the pending copies into full_grad_ (the pending
  // gradients go to `in_use`), then zeroes what no gradient wrote.
  void complete_flat_grad(std::vector<at::Tensor>& in_use);
  void clear_param_grads();
  void guard_params();
  void point_view_grads();

  std::string unit_name_;
  std::vector<ParamRef> params_;
  std::vector<bool> trainable_;
  size_t num_trainable_ = 0;
  std::vector<ShardView> views_;
  bool views_active_ = false;
  Mesh mesh_;            // the unit's rank layout (collectives/mesh.h)
  Communicator& comm_;   // mesh_.shard(): the layout's world, the gather and the shard's place
  FlatParamConfig config_;
  FlatLayout layout_;
  at::Tensor master_;     // fp32 local shard (optimizer's parameter)
  at::Tensor full_;       // unsharded buffer in param_dtype; params are views of it
  at::Tensor full_grad_;  // flat gradient in param_dtype; params' .grad: views of it or pending_
  std::vector<bool> grad_written_;  // per parameter: its region of full_grad_ holds a gradient
  // Per parameter: a gradient not yet in its region (deferred copy), or undefined. Allocated on
  // the compute stream, read by reduce_grad() on the reduce stream.
  std::vector<at::Tensor> pending_;
  bool defer_grad_copies_ = false;
  bool full_aliases_master_ = false;  // replicated fp32: no second copy
  std::vector<std::pair<int64_t, int64_t>> padding_;  // [begin, end) gaps of the flat buffer
  // Note [Guarded sharded parameters]: per parameter, the storage it points at while guarded
  // (sharded units only; empty for replicated ones).
  std::vector<c10::Storage> guards_;
  bool attached_ = true;  // the parameters point at full()'s storage
  // The collectives (flat_param/collective_plan.h): chosen in the constructor, never changed.
  // They own what only they need (offload's copies, the step copy, the host gradient buffers).
  std::unique_ptr<GatherPlan> gather_;
  std::unique_ptr<ReducePlan> reduce_;
};

// Resizes the storage behind `t` (which must own its whole storage from offset 0) to hold
// `numel` elements of its dtype, on its device. numel == 0 frees it.
void resize_tensor_storage(const at::Tensor& t, int64_t numel);
bool storage_is_allocated(const at::Tensor& t);
// True when `t` reads a guard storage of a sharded parameter (Note [Guarded sharded
// parameters]): a parameter (or a view of one) of a sharded unit that is not gathered.
bool is_guarded_param(const at::Tensor& t);
// Gives the meta tensor `t` (a parameter or buffer of a model built on the meta device) the
// storage, offset and strides of `data`, which must have t's shape and dtype: the same
// TensorImpl — what modules, autograd and plans hold — now reads `data`'s storage on its
// device. Like set_data(), which refuses meta -> device; a stale gradient accumulator is
// dropped as set_data() does. Throws c10::Error naming `what` otherwise.
void materialize_meta(const at::Tensor& t, const at::Tensor& data, const std::string& what);

}  // namespace flatshard
