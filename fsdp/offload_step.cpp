// flatshard/fsdp/offload_step.cpp — see Notes [Offload step in backward] and [Delayed offload
// step] in offload_step.h.
#include "fsdp/offload_step.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <string>

#include "collectives/env.h"
#include "flat_param/collective_plan.h"
#include "flat_param/flat_param.h"
#include "flat_param/offload_state.h"
#include "optim/fused_adamw.h"
#include "fsdp/trace.h"

namespace flatshard {

namespace {
// Note [Delayed offload step]: mark_stepped_early()'s `own_writes` for a step whose gradients
// were dropped: no real version plus it is a version (see enqueue_delayed).
constexpr int64_t kDroppedGradient = -(int64_t{1} << 62);

// Note [CPU offload]: where the unit's reductions land on the host (the reduce plan's), and
// the copy of its master its gathers read (the gather plan's); null when not offloaded.
HostGrad* host_grad(const FlatParam& flat) { return flat.reduce_plan().host_grad(); }
OffloadCopy* offload_copy(const FlatParam& flat) { return flat.gather_plan().extras().offload; }

// Whether the unit's last reduction was staged beside an existing host gradient
// (HostGrad::finish() adds it).
bool host_grad_staged(const FlatParam& flat) {
  return host_grad(flat) != nullptr && host_grad(flat)->staged();
}

// After the host waited for the stream of the unit's last reduction: adds a reduction staged
// beside an existing host gradient to master().grad (HostGrad::finish). No-op otherwise.
void finish_host_grad(const FlatParam& flat) {
  if (HostGrad* h = host_grad(flat)) h->finish(flat.master());
}

// Note [Host compute copy]: reductions below fp32 come to the host as they are (offloaded units).
void keep_reduce_dtype(const FlatParam& flat, bool keep) {
  if (HostGrad* h = host_grad(flat)) h->keep_reduce_dtype(keep);
}

// Note [Delayed offload step]: master().grad and the trainable shard views' .grad become
// undefined (the captured step holds them).
void drop_master_grad(FlatParam& flat) {
  flat.master().mutable_grad() = at::Tensor();
  const std::vector<ShardView>& views = flat.shard_views();
  for (size_t i = 0; i < views.size(); ++i)
    if (flat.trainable(i)) views[i].tensor.mutable_grad() = at::Tensor();
}

}  // namespace

OffloadStepper::~OffloadStepper() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return pending_ == 0; });
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void OffloadStepper::attach(std::shared_ptr<FusedAdamW> opt, const std::vector<FlatParam*>& flats,
                            const std::vector<int>& trace_units) {
  wait();
  if (opt)
    for (const auto& group : opt->param_groups())
      TORCH_CHECK(!static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad(),
                  "attach_optimizer (rank ", rank_, "): amsgrad has no fused step; flatshard "
                  "steps offloaded units with FusedAdamW's fused kernel only");
  entries_.clear();
  for (FlatParam* f : flats) keep_reduce_dtype(*f, false);
  opt_ = std::move(opt);
  if (!opt_) return;
  std::unordered_map<const c10::StorageImpl*, FlatParam*> by_storage;
  for (FlatParam* f : flats)
    if (f->master().defined() && f->master().numel() > 0)
      by_storage[f->master().storage().unsafeGetStorageImpl()] = f;
  const auto& groups = opt_->param_groups();
  for (size_t g = 0; g < groups.size(); ++g)
    for (const auto& p : groups[g].params()) {
      if (!p.defined() || !p.has_storage()) continue;
      auto it = by_storage.find(p.storage().unsafeGetStorageImpl());
      if (it != by_storage.end()) entries_[it->second].params.push_back({g, p});
    }
  // Note [Host compute copy]: only units this optimizer steps, so no gradient waits unseen.
  const bool host_copy = env::offload_host_copy();
  for (size_t i = 0; i < flats.size(); ++i) {
    auto it = entries_.find(flats[i]);
    if (it == entries_.end()) continue;
    keep_reduce_dtype(*flats[i], host_copy);
    OffloadCopy* copy = offload_copy(*flats[i]);
    if (host_copy && copy) it->second.host_copy = copy->host_copy();
    if (i < trace_units.size()) it->second.trace_unit = trace_units[i];
  }
}

FusedAdamW::CapturedStep OffloadStepper::capture(FlatParam& flat, const Entry& e) {
  // Note [Host compute copy]: the gradient in the reduce dtype and the copy to write, as the
  // slices of the unit's buffers that line up with each tensor (the master or a shard view).
  HostGrad* host = host_grad(flat);
  const at::Tensor reduced = host ? host->take_reduced() : at::Tensor();
  const at::Tensor& copy = e.host_copy;
  if (!reduced.defined() && !copy.defined()) return opt_->capture_located(e.params);
  const at::Tensor& master = flat.master();
  const std::vector<ShardView>& views = flat.shard_views();
  auto slice = [&](const at::Tensor& buf, const at::Tensor& p) {
    return buf.narrow(0, p.storage_offset() - master.storage_offset(), p.numel());
  };
  // The tensors the fp32 path gives a gradient: the master, and trainable views while the
  // views are active (FlatParam::point_view_grads()).
  auto has_grad = [&](const at::Tensor& p) {
    if (p.is_same(master)) return true;
    if (!flat.views_active()) return false;
    for (size_t i = 0; i < views.size(); ++i)
      if (views[i].tensor.is_same(p)) return flat.trainable(i);
    return false;
  };
  FusedAdamW::TensorOf grad_of, copy_of;
  if (reduced.defined())
    grad_of = [&](const at::Tensor& p) { return has_grad(p) ? slice(reduced, p) : at::Tensor(); };
  if (copy.defined()) copy_of = [&](const at::Tensor& p) { return slice(copy, p); };
  return opt_->capture_located(e.params, grad_of, copy_of);
}

void OffloadStepper::enqueue(FlatParam& flat, const c10::Stream& stream) {
  auto it = entries_.find(&flat);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  const bool device = stream.device_type() != c10::DeviceType::CPU;
  if (device) {
    if (!e.done) e.done.emplace(stream.device_type());
    e.done->record(stream);
  }
  Job job;
  job.flat = &flat;
  job.entry = &e;
  job.wait_event = device;
  if (tracer_) job.trace_step = tracer_->recording_step();
  if (delayed_) {
    enqueue_delayed(flat, e, stream, job);
  } else {
    // Captured here, so a gradient written after the reduction (hand-written clipping) is
    // caught by the next opt.step() whenever the worker gets to it.
    job.staged = host_grad_staged(flat);
    job.captured = capture(flat, e);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    e.queued = true;
    jobs_.push_back(std::move(job));
    ++pending_;
    if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
  }
  stepped_ = true;
  cv_.notify_one();
}

// Note [Delayed offload step]: the unit's previous step was waited for (wait_for), so the master
// is that step's result; the device copy takes it now, the step of this gradient runs later.
void OffloadStepper::enqueue_delayed(FlatParam& flat, Entry& e, const c10::Stream& stream,
                                     Job& job) {
  const bool device = stream.device_type() != c10::DeviceType::CPU;
  if (host_grad_staged(flat)) {  // added to a gradient left from before: rare, synchronous
    if (device) e.done->synchronize();
    finish_host_grad(flat);
  }
  if (device) e.done->block(upload_stream_);  // the unit's backward read the copy before this
  if (OffloadCopy* c = offload_copy(flat)) c->refresh(upload_stream_, /*hold=*/true);
  if (device) {
    if (!e.uploaded) e.uploaded.emplace(stream.device_type());
    e.uploaded->record(upload_stream_);  // the worker's step writes the master the upload reads
  }
  job.captured = capture(flat, e);
  drop_master_grad(flat);
  // Marked as stepped early, as offload_step = backward marks its steps, so opt.step() leaves
  // these tensors to the worker. Their gradients were just dropped: any gradient they hold at
  // opt.step() was written since (a loop filling missing gradients with zeros, clipping) and
  // would step them a second time. No gradient's version (>= 0) equals this mark's, so
  // opt.step() refuses every such gradient with the backward mode's error.
  opt_->mark_stepped_early(*job.captured, kDroppedGradient);
}

void OffloadStepper::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return pending_ == 0; });
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void OffloadStepper::wait_for(const FlatParam& flat) {
  auto it = entries_.find(&flat);
  if (it == entries_.end()) return;
  const Entry& e = it->second;
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [&] { return !e.queued; });
  if (error_) {
    std::exception_ptr err = error_;
    error_ = nullptr;
    std::rethrow_exception(err);
  }
}

bool OffloadStepper::take_stepped() {
  const bool s = stepped_;
  stepped_ = false;
  return s;
}

void OffloadStepper::run_job(Job& job) {
  // The trace's CPU optimizer track: the wait for the unit's gradient, then its step.
  const double t0 = tracer_ ? Tracer::now_us() : 0;
  double t1 = 0;
  struct Spans {  // recorded when the job ends, whichever way
    Tracer* tracer;
    int unit, step;
    const double& t0;
    double& t1;
    ~Spans() {
      if (!tracer) return;
      const double t2 = Tracer::now_us();
      tracer->record_worker(TraceKind::kOffloadWait, unit, step, t0, t1 > 0 ? t1 : t2);
      if (t1 > 0) tracer->record_worker(TraceKind::kOffloadStep, unit, step, t1, t2);
    }
  } spans{tracer_, job.entry->trace_unit, job.trace_step, t0, t1};
  OffloadCopy* offload = offload_copy(*job.flat);
  // Note [Host compute copy]: a host buffer was taken at attach only from an offload copy.
  OffloadCopy* copy = job.entry->host_copy.defined() ? offload : nullptr;
  if (delayed_) {  // Note [Delayed offload step]
    if (job.wait_event) job.entry->uploaded->synchronize();  // after the gradient's copy too
    if (tracer_) t1 = Tracer::now_us();
    if (copy) copy->prepare_host_copy();  // the upload that read it is done
    opt_->run_step(*job.captured);
    if (copy) copy->host_copy_written();
    return;
  }
  if (job.wait_event) job.entry->done->synchronize();
  if (tracer_) t1 = Tracer::now_us();
  finish_host_grad(*job.flat);  // one in-place add to the captured gradient when staged
  if (copy) copy->prepare_host_copy();  // its last upload came before this unit's forward
  opt_->run_step(*job.captured);
  if (copy) copy->host_copy_written();
  opt_->mark_stepped_early(*job.captured, job.staged ? 1 : 0);
  if (offload) offload->refresh(upload_stream_);
}

void OffloadStepper::run() {
  // OpenMP's thread count is per calling thread: this limits the steps, not the main thread.
  if (threads_ > 0) at::set_num_threads(threads_);
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    std::exception_ptr failed;
    try {
      run_job(job);
    } catch (const std::exception& ex) {
      try {
        TORCH_CHECK(false, "flatshard (rank ", rank_, "): the CPU optimizer step of unit '",
                    job.flat->unit_name(), "' (offload_step = ", delayed_ ? "delayed" : "backward",
                    ") failed: ", ex.what());
      } catch (...) {
        failed = std::current_exception();
      }
    } catch (...) {
      failed = std::current_exception();
    }
    job.captured.reset();  // the gradients' buffers are reused by the unit's next reduction
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed && !error_) error_ = failed;
      job.entry->queued = false;
      --pending_;
    }
    idle_cv_.notify_all();
  }
}

void OffloadLifecycle::add_unit(FlatParam& flat, int trace_index) {
  flats_.push_back(&flat);
  trace_units_.push_back(trace_index);
  any_offloaded_ = any_offloaded_ || flat.config().offload > 0;
}

void OffloadLifecycle::on_root_entry(bool backward_active) {
  // Note [Offload step in backward]: the last backward's CPU steps end before any upload reads
  // a master (a no-op when none is queued).
  // Note [Delayed offload step]: not when delayed, whose forward reads the held copies.
  if (stepper_ && !stepper_->delayed() && !backward_active) stepper_->wait();
}

void OffloadLifecycle::on_backward_start(bool requires_grad_sync, bool forward_ran) {
  if (stepper_ && requires_grad_sync && any_offloaded_) {
    const bool delayed = stepper_->delayed();
    TORCH_CHECK(stepper_->attached(), "flatshard (rank ", rank_, "): offload_step = ",
                delayed ? "delayed" : "backward", " steps the offloaded units' optimizer itself, "
                "but no optimizer is attached: call fsdp->attach_optimizer(opt) with the "
                "flatshard::FusedAdamW built on parameters() or named_parameters() before the "
                "first backward (Note [Offload step in backward], fsdp/offload_step.h)");
    // Note [Delayed offload step]: a retained graph's second backward would gather device
    // copies refreshed since its forward (its gradient would not belong to the parameters it
    // used).
    TORCH_CHECK(!delayed || forward_ran, "flatshard (rank ", rank_,
                "): offload_step = delayed: a second backward with gradient sync on and no "
                "forward since the last one (a retained graph) is not supported: the offloaded "
                "units' device copies were refreshed by the first. Run a forward per backward, "
                "or use offload_step = backward (Note [Delayed offload step], "
                "fsdp/offload_step.h)");
  }
  // Note [Offload step in backward]: a second backward over a retained graph (no forward
  // between) must not gather or reduce a unit the worker is still stepping. (Delayed: each
  // unit waits for its own step before it reduces, and the check above refuses this case.)
  if (stepper_ && !stepper_->delayed()) stepper_->wait();
}

void OffloadLifecycle::on_backward_end(bool requires_grad_sync, c10::Stream compute) {
  // Note [CPU offload] (flat_param/offload.h): the step's one host sync. The CPU optimizer reads
  // the host gradients and writes the host masters next; the compute stream now waits for the
  // last reduction (whose stream carried the copies to the host) and came after every gather.
  // With offload_step = backward the stepper waits for each unit's copy and adds its staged
  // gradient instead (Note [Offload step in backward]).
  if (!requires_grad_sync || !any_offloaded_ || stepper_) return;
  if (compute.device_type() != c10::DeviceType::CPU) compute.synchronize();
  for (FlatParam* f : flats_) finish_host_grad(*f);
}

void OffloadLifecycle::before_reduction(const FlatParam& flat) {
  if (stepper_ && flat.config().offload > 0) stepper_->wait_for(flat);
}

void OffloadLifecycle::after_reduction(FlatParam& flat, const c10::Stream& stream) {
  if (stepper_ && flat.config().offload > 0) stepper_->enqueue(flat, stream);
}

void OffloadLifecycle::wait() {
  if (stepper_) stepper_->wait();
}

void OffloadLifecycle::sync_params() {
  wait();
  for (FlatParam* f : flats_)
    if (OffloadCopy* c = offload_copy(*f)) c->release_hold();
}

void OffloadLifecycle::attach(const std::shared_ptr<FusedAdamW>& opt) {
  TORCH_INTERNAL_ASSERT(stepper_ != nullptr, "OffloadLifecycle::attach without a stepper");
  stepper_->attach(opt, flats_, trace_units_);
  // Note [Delayed offload step]: delayed steps run on through the next forward; opt.step()
  // finds the offloaded units without gradients and steps the rest.
  if (stepper_->delayed()) {
    opt->set_before_step(nullptr);
    return;
  }
  std::weak_ptr<OffloadStepper> weak = stepper_;
  opt->set_before_step([weak] {
    if (auto s = weak.lock()) s->wait();
  });
}

void OffloadLifecycle::check_clip_grad_norm() const {
  TORCH_CHECK(!(stepper_ && any_offloaded_), "clip_grad_norm_ (rank ", rank_,
              "): with offload_step = ", stepper_ && stepper_->delayed() ? "delayed" : "backward",
              " the offloaded units' steps took their gradients during backward, before the "
              "global norm was known, so clipping cannot apply to them. Use the default "
              "offload_step (after backward) to clip (Note [Offload step in backward], "
              "fsdp/offload_step.h)");
}

}  // namespace flatshard
