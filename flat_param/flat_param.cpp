#include "flat_param/flat_param.h"

#include <ATen/native/Resize.h>
#if FLATSHARD_WITH_CUDA
#include <ATen/native/cuda/Resize.h>
#endif
#include <c10/core/StreamGuard.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <mutex>

#include "collectives/agree.h"
#include "flat_param/collective_plan.h"
#include "flat_param/gathered_scale.h"
#include "flat_param/offload.h"
#include "flat_param/offload_state.h"
#include "flat_param/upcast.h"

namespace flatshard {

void resize_tensor_storage(const at::Tensor& t, int64_t numel) {
  TORCH_INTERNAL_ASSERT(t.storage_offset() == 0, "resize_tensor_storage needs a base tensor");
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(numel) * t.element_size();
  if (impl->nbytes() == bytes) return;
#if FLATSHARD_WITH_CUDA
  if (t.is_cuda()) {
    at::native::resize_bytes_cuda(impl, bytes);
    return;
  }
#endif
  TORCH_CHECK(t.is_cpu(), "flatshard: cannot resize storage on device ", t.device(),
              " (built without CUDA support?)");
  at::native::resize_bytes_cpu(impl, bytes);
}

bool storage_is_allocated(const at::Tensor& t) { return t.storage().nbytes() > 0; }

void materialize_meta(const at::Tensor& t, const at::Tensor& data, const std::string& what) {
  TORCH_CHECK(t.defined() && t.is_meta(), what, " is not a meta tensor");
  TORCH_CHECK(data.sizes() == t.sizes() && data.scalar_type() == t.scalar_type(), what,
              ": cannot take values of shape ", data.sizes(), " and dtype ", data.scalar_type(),
              "; it is ", t.sizes(), " ", t.scalar_type());
  TORCH_CHECK(!data.is_meta(), what, ": the values to take are on meta too");
  // What set_data() does besides the copy: an accumulator built for the meta tensor would
  // expect meta gradients.
  if (auto* meta = torch::autograd::impl::get_autograd_meta(t)) {
    std::lock_guard<std::mutex> lock(meta->mutex_);
    meta->grad_accumulator_.reset();
  }
  // set_data() would refuse (meta and CPU/CUDA are not "compatible shallow-copy types"), but
  // both are plain TensorImpls: the copy moves storage, sizes, strides, dtype, device and
  // dispatch keys; the autograd meta and the version counter stay, as with set_data().
  t.unsafeGetTensorImpl()->shallow_copy_from(data.getIntrusivePtr());
}

namespace {

// The deleter of every guard storage's (null) DataPtr: never called with data, and it marks
// the storage as a guard for is_guarded_param().
void guard_deleter(void*) {}

// Note [Guarded sharded parameters]
// Why not leave the parameters on full()'s 0-byte storage: its data pointer is null, and only
// the typed data_ptr<T>() checks for that ("data is not allocated yet"). TensorIterator (every
// elementwise op, reductions like sum) takes the untyped pointer and dereferences null: a
// segfault. View ops (t() in linear) fail earlier with ATen's "setStorage: ... out of bounds
// for storage of size 0", which names neither flatshard nor the unit. A guard is a StorageImpl
// whose data accessors throw (release_data_and_set_meta_custom_data_ptr_error_msg_, what
// PyTorch uses for storage-less fake tensors): StorageImpl::data() and mutable_data() check it,
// and every kernel, typed or not, reaches the data through them, on the host, before any
// launch — so it is the same on CPU and CUDA. Its byte size is full()'s, so views and bounds
// checks pass and the first data access raises our message. The flag cannot be cleared, which
// is why each parameter gets its own guard for the unit's life instead of full()'s storage
// being flagged and unflagged; one guard per parameter also lets the message name it.
c10::Storage make_guard(size_t nbytes, c10::Device device, std::string message) {
  c10::Storage guard(c10::Storage::use_byte_size_t(), nbytes,
                     c10::DataPtr(nullptr, nullptr, &guard_deleter, device),
                     /*allocator=*/nullptr, /*resizable=*/false);
  guard.unsafeGetStorageImpl()->release_data_and_set_meta_custom_data_ptr_error_msg_(
      std::move(message));
  return guard;
}

// Elements [begin, begin + n) of the 1-D `t` as a tensor over the same storage that is not an
// autograd view of it: a leaf of its own (a shard view the optimizer holds) or a .grad that
// Optimizer::zero_grad may detach_() (which views refuse).
at::Tensor storage_slice(const at::Tensor& t, int64_t begin, int64_t n) {
  at::Tensor out = at::empty({0}, t.options());
  out.set_(t.storage(), t.storage_offset() + begin, {n}, {1});
  return out;
}

// Allocates a tensor whose storage we may later resize (at::empty's is resizable).
at::Tensor resizable_empty(int64_t numel, at::ScalarType dtype, c10::Device device) {
  return at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
}

}  // namespace

namespace {
// The parameters' TensorImpls, in order (flat_param/gathered_scale.h keys its lookups by them).
std::vector<const c10::TensorImpl*> param_impls(const std::vector<ParamRef>& params) {
  std::vector<const c10::TensorImpl*> out;
  out.reserve(params.size());
  for (const ParamRef& p : params) out.push_back(p.param.unsafeGetTensorImpl());
  return out;
}
}  // namespace

FlatParam::FlatParam(std::string unit_name, std::vector<ParamRef> params, const Mesh& mesh,
                     const FlatParamConfig& config, const std::function<void()>& fill,
                     const RangeFill& load_ranges)
    : unit_name_(std::move(unit_name)),
      params_(std::move(params)),
      mesh_(mesh),
      comm_(mesh_.shard()),
      config_(config) {
  at::NoGradGuard no_grad;
  make_layout(check_params(fill || load_ranges));
  initial_values(fill, load_ranges);
  choose_plans();
  move_to_host();
  make_views();
  make_full_buffer();
  attach_and_guard();
  if (gather_->extras().fp8_scales != nullptr) {
    // flat_param/gathered_scale.h: the scale while gathered; a guarded (sharded) parameter or
    // a unit not gathered now has none.
    detail::register_fp8_params(this, param_impls(params_), [this](const at::Tensor& param, size_t i) {
      const at::Tensor* scales = gather_->extras().fp8_scales;
      if (is_guarded_param(param) || !is_unsharded() || !scales->defined()) return at::Tensor();
      return scales->narrow(0, static_cast<int64_t>(i), 1);
    });
  }
}

FlatParam::~FlatParam() {
  if (gather_->extras().fp8_scales != nullptr)
    detail::unregister_fp8_params(this);  // noexcept
}

std::vector<std::vector<int64_t>> FlatParam::check_params(bool deferred) {
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& p : params_) {
    TORCH_CHECK(p.param.defined(), "unit '", unit_name_, "': parameter '", p.name,
                "' is undefined");
    TORCH_CHECK(at::isFloatingType(p.param.scalar_type()), "unit '", unit_name_,
                "': parameter '", p.name, "' has dtype ", p.param.scalar_type(),
                "; flat parameters hold floating-point parameters only");
    TORCH_CHECK(p.param.scalar_type() == params_.front().param.scalar_type(), "unit '",
                unit_name_, "': parameters of one unit must share a dtype, but '",
                params_.front().name, "' is ", params_.front().param.scalar_type(), " and '",
                p.name, "' is ", p.param.scalar_type(), " (rank ", comm_.rank(), ")");
    TORCH_CHECK(p.param.device() == params_.front().param.device(), "unit '", unit_name_,
                "': parameters of one unit must share a device, but '", params_.front().name,
                "' is on ", params_.front().param.device(), " and '", p.name, "' on ",
                p.param.device(), " (rank ", comm_.rank(), ")");
    TORCH_CHECK(p.param.is_leaf(), "unit '", unit_name_, "': parameter '", p.name,
                "' is not a leaf tensor");
    TORCH_CHECK(p.param.is_meta() == deferred, "unit '", unit_name_,
                "' (rank ", comm_.rank(), "): parameter '", p.name, "' is ",
                deferred ? "not on the meta device, but the unit is built with deferred values"
                         : "on the meta device (it holds no values), but the unit is built "
                           "from values");
    shapes.push_back(p.param.sizes().vec());
    trainable_.push_back(p.param.requires_grad());
    if (trainable_.back()) ++num_trainable_;
  }
  return shapes;
}

void FlatParam::make_layout(const std::vector<std::vector<int64_t>>& shapes) {
  const int world = config_.sharded ? comm_.world_size() : 1;
  layout_ = FlatLayout::make(shapes, world, config_.align);
  pending_.resize(params_.size());
  int64_t end = 0;
  for (size_t i = 0; i <= layout_.numels.size(); ++i) {
    const int64_t next = i < layout_.numels.size() ? layout_.offsets[i] : layout_.padded_numel;
    if (next > end) padding_.emplace_back(end, next);
    if (i < layout_.numels.size()) end = layout_.offsets[i] + layout_.numels[i];
  }
}

void FlatParam::initial_values(const std::function<void()>& fill, const RangeFill& load_ranges) {
  TORCH_CHECK(!(fill && load_ranges), "unit '", unit_name_,
              "': built with both an init and a loader");
  if (load_ranges) {
    load_master(load_ranges);  // Note [Loading into shards]: no full buffer, no broadcast
    return;
  }
  // The full fp32 values, padding zero, on the communicator's device.
  at::Tensor init = at::zeros({layout_.padded_numel},
                              at::TensorOptions().dtype(at::kFloat).device(comm_.device()));
  if (fill) {
    fill_deferred(init, fill);
  } else {
    for (size_t i = 0; i < params_.size(); ++i) {
      init.narrow(0, layout_.offsets[i], layout_.numels[i])
          .copy_(params_[i].param.detach().reshape({-1}));
    }
  }
  broadcast_values(init);
  if (config_.sharded) {
    master_ = init.narrow(0, layout_.shard_begin(comm_.rank()), layout_.shard_numel).clone();
  } else {
    master_ = init;
  }
}

void FlatParam::broadcast_values(const at::Tensor& init) {
  if (config_.sync_module_states && comm_.world_size() > 1 && layout_.padded_numel > 0) {
    comm_.broadcast(init, 0, comm_.current_stream());
  }
  // HSDP: every shard group now holds its rank 0's values; make them global rank 0's.
  Communicator* replicate = mesh_.replicate();
  if (config_.sync_module_states && replicate && layout_.padded_numel > 0) {
    replicate->broadcast(init, 0, replicate->current_stream());
  }
}

void FlatParam::choose_plans() {
  // Throws for an offload level other than 0, 1 or 2 (before anything is moved to the host).
  reduce_ = make_reduce_plan(unit_name_, config_, layout_, mesh_);
}

void FlatParam::move_to_host() {
  if (config_.offload == 0) return;
  // Note [CPU offload]: the optimizer's side lives on the host.
  at::Tensor host = host_empty(master_.numel(), at::kFloat, comm_.device());
  host.copy_(master_);
  master_ = host;
}

void FlatParam::make_views() {
  // Note [Frozen parameters]: a unit of frozen parameters only has no optimizer parameter.
  master_.requires_grad_(num_trainable_ > 0);
  // Note [Original-parameter views]: views by storage (set_), not autograd views of master_,
  // so each is a leaf of its own whose .grad the optimizer reads.
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t base = config_.sharded ? layout_.shard_begin(comm_.rank()) : 0;
    const int64_t size = master_.numel();
    const int64_t b = std::clamp<int64_t>(layout_.offsets[i] - base, 0, size);
    const int64_t e = std::clamp<int64_t>(layout_.offsets[i] + layout_.numels[i] - base, 0, size);
    ShardView v;
    v.begin = b;
    v.end = std::max(b, e);
    v.param_begin = v.numel() > 0 ? b + base - layout_.offsets[i] : 0;
    v.tensor = storage_slice(master_, v.begin, v.numel());
    if (trainable_[i]) v.tensor.requires_grad_(true);
    views_.push_back(std::move(v));
  }
  views_active_ = num_trainable_ > 0 && num_trainable_ < params_.size();
}

void FlatParam::make_full_buffer() {
  full_aliases_master_ = full_aliases_master(config_);
  if (full_aliases_master_) {
    full_ = master_.detach();
  } else {
    full_ = resizable_empty(layout_.padded_numel, config_.param_dtype, comm_.device());
  }
  // The gather plan keeps the buffers from now on: master_ and full_ are never reassigned after
  // this. Replicated: full_ gets the master's values; offload 1: the resident shard (uploaded at
  // the first unshard()).
  std::vector<std::string> names;
  names.reserve(params_.size());
  for (const ParamRef& p : params_) names.push_back(p.name);
  gather_ = make_gather_plan(unit_name_, config_, layout_, mesh_,
                             GatherArgs{master_.detach(), full_, views_, std::move(names)});
}

void FlatParam::attach_and_guard() {
  // Note [Unsharded buffer lifetime]: from here on the parameters are views of full_.
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor view =
        full_.narrow(0, layout_.offsets[i], layout_.numels[i]).view(layout_.shapes[i]);
    // Loaded values: the parameter is still on meta (set_data refuses meta). It takes the view
    // itself, or, of another dtype, a tensor of its own that set_data replaces at once.
    if (params_[i].param.is_meta()) {
      const auto dtype = params_[i].param.scalar_type();
      materialize_meta(params_[i].param,
                       view.scalar_type() == dtype ? view
                                                   : at::empty(layout_.shapes[i],
                                                               view.options().dtype(dtype)),
                       "parameter '" + params_[i].name + "' of unit '" + unit_name_ + "'");
    }
    params_[i].param.set_data(view);
  }
  if (!config_.sharded) return;
  const size_t nbytes = static_cast<size_t>(layout_.padded_numel) * full_.element_size();
  for (const auto& p : params_) {
    guards_.push_back(make_guard(
        nbytes, full_.device(),
        "flatshard: parameter '" + p.name + "' of unit '" + unit_name_ + "' (rank " +
            std::to_string(comm_.rank()) +
            ") was read while the unit is sharded: outside its unit's flatshard::call it "
            "holds no values. Enter the module through flatshard::call(module, args...) or "
            "flatshard::enter(module, fn) instead of calling its forward() directly; between "
            "steps read parameters with ShardedModel::gather_full_params(). After the "
            "ShardedModel is destroyed its sharded parameters have no values: gather them "
            "(or save a checkpoint) first."));
  }
  resize_tensor_storage(full_, 0);
  guard_params();
}

void FlatParam::fill_deferred(const at::Tensor& init, const std::function<void()>& fill) {
  const std::string where = "unit '" + unit_name_ + "' (rank " + std::to_string(comm_.rank()) + ")";
  std::vector<at::Tensor> values;  // what each parameter reads while fill() runs
  // Before any collective of this unit: a rank that failed must not leave the others waiting
  // in the broadcast below. HSDP: the shard group's answer, then across replicas.
  run_agreed(mesh_, "fully_shard: initialising unit '" + unit_name_ + "'", [&] {
    for (size_t i = 0; i < params_.size(); ++i) {
      const ParamRef& p = params_[i];
      at::Tensor v = init.narrow(0, layout_.offsets[i], layout_.numels[i]).view(layout_.shapes[i]);
      if (p.param.scalar_type() != at::kFloat)  // its own dtype; copied into init after fill()
        v = at::empty(layout_.shapes[i], init.options().dtype(p.param.scalar_type()));
      materialize_meta(p.param, v, "parameter '" + p.name + "' of " + where);
      values.push_back(std::move(v));
    }
    const void* base = init.data_ptr();
    const size_t nbytes = init.storage().nbytes();
    fill();
    TORCH_CHECK(init.data_ptr() == base && init.storage().nbytes() == nbytes,
                "initialising the parameters of ", where, " resized or moved its flat buffer; "
                "an init must write the values in place, keeping the shape");
    for (size_t i = 0; i < params_.size(); ++i) {
      const at::Tensor& p = params_[i].param;
      const at::Tensor& v = values[i];
      TORCH_CHECK(p.sizes() == v.sizes() && p.scalar_type() == v.scalar_type() &&
                      p.device() == v.device(),
                  "initialising parameter '", params_[i].name, "' of ", where,
                  " changed it from ", v.sizes(), " ", v.scalar_type(), " on ", v.device(),
                  " to ", p.sizes(), " ", p.scalar_type(), " on ", p.device(),
                  "; an init must fill the tensor it is given in place, keeping its shape");
      TORCH_CHECK(p.data_ptr() == v.data_ptr() && p.strides() == v.strides(),
                  "initialising parameter '", params_[i].name, "' of ", where,
                  " replaced its storage; an init must write the values in place (copy_, "
                  "normal_, fill_, ...), not set_data() or resize them");
    }
  });
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].param.scalar_type() != at::kFloat)
      init.narrow(0, layout_.offsets[i], layout_.numels[i]).copy_(values[i].reshape({-1}));
}

void FlatParam::load_master(const RangeFill& load_ranges) {
  const int64_t base = config_.sharded ? layout_.shard_begin(comm_.rank()) : 0;
  const int64_t size = config_.sharded ? layout_.shard_numel : layout_.padded_numel;
  master_ = at::zeros({size}, at::TensorOptions().dtype(at::kFloat).device(comm_.device()));
  // Note [Loading into shards]: the unit's agree point, as for an init; no broadcast follows.
  run_agreed(mesh_, "fully_shard: loading unit '" + unit_name_ + "'", [&] {
    const void* data = master_.data_ptr();
    for (size_t i = 0; i < params_.size(); ++i) {
      const int64_t b = std::clamp<int64_t>(layout_.offsets[i] - base, 0, size);
      const int64_t e =
          std::clamp<int64_t>(layout_.offsets[i] + layout_.numels[i] - base, 0, size);
      if (e <= b) continue;
      const int64_t first = b + base - layout_.offsets[i];  // in the flattened parameter
      load_ranges(i, first, first + (e - b), master_.narrow(0, b, e - b));
    }
    TORCH_CHECK(master_.data_ptr() == data && master_.numel() == size, "loading unit '",
                unit_name_, "' (rank ", comm_.rank(), ") moved or resized its master shard; "
                "a loader must write the slice it is given in place");
  });
}

void FlatParam::guard_params() {
  if (!attached_ || guards_.empty()) return;
  for (size_t i = 0; i < params_.size(); ++i)
    params_[i].param.unsafeGetTensorImpl()->set_storage_keep_dtype(guards_[i]);
  attached_ = false;
}

void FlatParam::attach_params() {
  if (attached_) return;
  TORCH_INTERNAL_ASSERT(is_unsharded(), "unit '", unit_name_,
                        "': attach_params() before the buffer is gathered");
  for (auto& p : params_) p.param.unsafeGetTensorImpl()->set_storage_keep_dtype(full_.storage());
  attached_ = true;
}

bool is_guarded_param(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return false;
  return t.storage().unsafeGetStorageImpl()->_mutable_data_ptr_no_checks().get_deleter() ==
         &guard_deleter;
}

bool FlatParam::is_unsharded() const { return storage_is_allocated(full_) || layout_.padded_numel == 0; }

void FlatParam::unshard(c10::Stream stream, bool attach) {
  at::NoGradGuard no_grad;
  c10::StreamGuard guard(stream);
  if (config_.sharded) {  // Note [Unsharded buffer lifetime]: full()'s storage comes back
    resize_tensor_storage(full_, layout_.padded_numel);
    if (attach) attach_params();
  }
  gather_->gather(stream);
  // (Not for the replicated fp32 buffer: it is the optimizer's master, whose padding must stay 0.)
  if (config_.poison_padding && !full_aliases_master_)
    for (const auto& [b, e] : padding_) full_.narrow(0, b, e - b).fill_(NAN);
}

bool FlatParam::gather_is_noop() const {
  if (config_.poison_padding && !full_aliases_master_) return false;  // unshard() poisons
  return gather_->gather_is_noop();
}

void FlatParam::reshard() {
  if (!config_.sharded) return;
  guard_params();
  resize_tensor_storage(full_, 0);
}

void FlatParam::clear_param_grads() {
  for (auto& p : params_) p.param.mutable_grad() = at::Tensor();
  for (auto& g : pending_) g = at::Tensor();  // no reduction read them: free now
}

// Note [Flat gradient without zero-fill]
// The flat gradient is not zeroed and the parameters' .grad are not pre-attached to it: then
// AccumulateGrad, finding no .grad, keeps the incoming gradient as is, and accept_grad() copies
// it into the flat buffer and points .grad at its view there, so later backward passes before
// the reduction (accumulation without sync) add into the view in place. Against zero-filling
// and adding in place, the first backward saves a write and a read+write of the whole unit's
// gradient (8 -> 4 bytes moved per element in the compute dtype), on the compute stream, every
// step. reduce_grad() zeroes what no gradient wrote: padding and parameters that got none.
// When the reduction follows in the same backward (gradient sync on: set_defer_grad_copies), the
// remaining copy leaves the compute stream too: accept_grad() only remembers the gradient
// (pending_, .grad untouched) and reduce_grad() copies it on the reduce stream, overlapping the
// backward of earlier units. Without sync the copy stays, so the next pass adds into the view.
// A pending gradient is compute-stream memory read on the reduce stream: reduce_grad() returns
// it with the buffers the caller holds until the compute stream waits for the reduction (Note
// [Reduce buffer lifetime]); freed earlier, compute could reuse the block before the copy ran.
// The price: gradients stay allocated beside the flat buffer until then (at peak, about the
// computing unit's and the previous unit's gradients more).
void FlatParam::prepare_grad() {
  if (full_grad_.defined()) return;
  at::NoGradGuard no_grad;
  full_grad_ = at::empty({layout_.padded_numel},
                         at::TensorOptions().dtype(config_.param_dtype).device(comm_.device()));
  // Debugging: whatever reduce_grad() fails to overwrite or zero shows up as NaN.
  if (config_.poison_padding) full_grad_.fill_(NAN);
  grad_written_.assign(params_.size(), false);
}

void FlatParam::accept_grad(size_t i) {
  TORCH_INTERNAL_ASSERT(i < params_.size(), "unit '", unit_name_, "': parameter index ", i,
                        " out of range (", params_.size(), ")");
  at::Tensor& g = params_[i].param.mutable_grad();
  if (!g.defined()) return;
  at::NoGradGuard no_grad;
  if (defer_grad_copies_ && !full_grad_.defined()) {
    // No flat gradient yet, so .grad cannot be a view of it: remember it for reduce_grad(),
    // which allocates the flat gradient only if it needs one (Note [One-rank reduction]).
    TORCH_CHECK(g.scalar_type() == config_.param_dtype && g.device() == comm_.device(),
                "unit '", unit_name_, "': the gradient of '", params_[i].name, "' is ",
                g.scalar_type(), " on ", g.device(), " but the flat gradient is ",
                config_.param_dtype, " on ", comm_.device(), " (rank ", comm_.rank(), ")");
    pending_[i] = g;
    return;
  }
  prepare_grad();
  at::Tensor region = full_grad_.narrow(0, layout_.offsets[i], layout_.numels[i]);
  if (g.data_ptr() == region.data_ptr() && g.numel() == region.numel()) {
    grad_written_[i] = true;  // accumulated in place into the view
    return;
  }
  TORCH_CHECK(g.scalar_type() == full_grad_.scalar_type() && g.device() == full_grad_.device(),
              "unit '", unit_name_, "': the gradient of '", params_[i].name, "' is ",
              g.scalar_type(), " on ", g.device(), " but the flat gradient is ",
              full_grad_.scalar_type(), " on ", full_grad_.device(), " (rank ", comm_.rank(),
              ")");
  if (defer_grad_copies_) {
    // reduce_grad() copies it. The pending tensor again: AccumulateGrad added in place. Another
    // one: an out-of-place accumulation, whose result includes the pending one; replace it.
    pending_[i] = g;
    return;
  }
  // Note [Replaced gradient]: .grad is not our view although the region may hold an earlier
  // pass's gradient. Either autograd accumulated out of place (create_graph: the new tensor is
  // view + new, so it includes the region) or the user reset .grad between passes (discarding
  // what it held). Either way .grad is now the whole gradient: copy, never add.
  region.copy_(g.reshape({-1}));
  grad_written_[i] = true;
  pending_[i] = at::Tensor();  // g is the pending gradient, or includes it (as above)
  g = region.view(layout_.shapes[i]);
}

void FlatParam::complete_flat_grad(std::vector<at::Tensor>& in_use) {
  prepare_grad();  // a unit whose parameters got no gradient reduces zeros (all ranks agree)
  // Note [Flat gradient without zero-fill]: the deferred copies, then zero what no gradient
  // wrote. The pending gradients go to `in_use`: the compute stream allocated them.
  // Note [Range copies] (range_copy_kernel.h): one launch for the copies and the zeros (or Note
  // [Grouped gradient copies]' two, upcast.cpp).
  RangeCopies copies(full_grad_);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!pending_[i].defined()) continue;
    copies.copy(layout_.offsets[i], pending_[i]);  // the whole gradient: Note [Replaced gradient]
    grad_written_[i] = true;
    in_use.push_back(std::move(pending_[i]));  // leaves pending_[i] undefined
  }
  for (const auto& [b, e] : padding_) copies.zero(b, e - b);
  for (size_t i = 0; i < params_.size(); ++i)
    if (!grad_written_[i]) copies.zero(layout_.offsets[i], layout_.numels[i]);
  copies.run();
}

std::vector<at::Tensor> FlatParam::reduce_grad(c10::Stream stream) {
  at::NoGradGuard no_grad;
  c10::StreamGuard guard(stream);
  std::vector<at::Tensor> in_use;
  ReduceResult r;
  if (reduce_->needs_flat_grad()) {  // else Note [One-rank reduction]: no flat gradient
    complete_flat_grad(in_use);
    r = reduce_->reduce(full_grad_, stream);
  }
  for (auto& t : absorb_view_grads()) in_use.push_back(std::move(t));
  // The plan computes the master gradient; FlatParam sets it.
  const BackwardGrads grads{layout_, padding_, full_grad_, grad_written_, pending_, master_};
  master_.mutable_grad() = reduce_->accumulate_master_grad(r, grads, master_.grad());
  for (auto& g : pending_)  // the one-rank reduction read them on `stream`
    if (g.defined()) in_use.push_back(std::move(g));
  point_view_grads();
  if (full_grad_.defined()) in_use.push_back(full_grad_);
  if (r.sent.defined()) in_use.push_back(std::move(r.sent));
  drop_grad();
  return in_use;
}

void FlatParam::set_views_active(bool active) {
  views_active_ = active && num_trainable_ > 0;
  point_view_grads();
}

void FlatParam::point_view_grads() {
  if (!views_active_) return;
  at::NoGradGuard no_grad;
  const at::Tensor& mg = master_.grad();
  for (size_t i = 0; i < views_.size(); ++i) {
    if (!trainable_[i]) continue;
    ShardView& v = views_[i];
    v.tensor.mutable_grad() = mg.defined() ? storage_slice(mg, v.begin, v.numel()) : at::Tensor();
  }
}

void FlatParam::release_cleared_grad() {
  if (!views_active_ || !master_.grad().defined()) return;
  for (size_t i = 0; i < views_.size(); ++i)
    if (trainable_[i] && views_[i].tensor.grad().defined()) return;
  master_.mutable_grad() = at::Tensor();
}

std::vector<at::Tensor> FlatParam::absorb_view_grads() {
  std::vector<at::Tensor> read;
  if (!views_active_) return read;
  at::NoGradGuard no_grad;
  at::Tensor& mg = master_.mutable_grad();
  bool any_set = false;
  for (size_t i = 0; i < views_.size(); ++i)
    any_set = any_set || (trainable_[i] && views_[i].tensor.grad().defined());
  if (!any_set) {  // zero_grad(set_to_none) on every view: the next reduction starts afresh
    mg = at::Tensor();
    return read;
  }
  if (!mg.defined())  // Note [Low-precision master gradient]: in its dtype
    mg = at::zeros({master_.numel()}, master_.options().dtype(config_.grad_dtype()));
  for (size_t i = 0; i < views_.size(); ++i) {
    const ShardView& v = views_[i];
    if (!trainable_[i] || v.numel() == 0) continue;
    const at::Tensor& g = v.tensor.grad();
    at::Tensor slice = mg.narrow(0, v.begin, v.numel());
    if (!g.defined()) {
      slice.zero_();  // this view's gradient was cleared: it counts as zero
    } else if (g.data_ptr() != slice.data_ptr()) {
      TORCH_CHECK(g.numel() == v.numel(), "unit '", unit_name_, "': the gradient set on the "
                  "shard view of '", params_[i].name, "' has ", g.numel(), " elements, the view ",
                  v.numel(), " (rank ", comm_.rank(), ")");
      slice.copy_(g.reshape({-1}));  // replaced by the user: it is the whole gradient
      read.push_back(g);
    }
  }
  return read;
}

void FlatParam::drop_grad() {
  clear_param_grads();
  full_grad_ = at::Tensor();
}

at::Tensor FlatParam::gather_whole(const at::Tensor& local) const {
  at::Tensor src = local.defined() ? local.detach() : at::zeros_like(master_.detach());
  src = src.to(comm_.device());  // an offloaded unit's state is on the host (Note [CPU offload])
  if (!config_.sharded || layout_.padded_numel == 0) return src;
  at::Tensor full = at::empty({layout_.padded_numel}, src.options());
  comm_.all_gather(src, full, comm_.current_stream());
  return full;
}

}  // namespace flatshard
