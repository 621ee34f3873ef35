// flatshard/fsdp/offload_step.cpp — see Notes [Offload step in backward] and [Delayed offload
// step] in offload_step.h.
#include "fsdp/offload_step.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <string>

#include "flat_param/flat_param.h"
#include "fsdp/fused_adamw.h"

namespace flatshard {

OffloadStepper::~OffloadStepper() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return pending_ == 0; });
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void OffloadStepper::attach(std::shared_ptr<FusedAdamW> opt, const std::vector<FlatParam*>& flats) {
  wait();
  if (opt)
    for (const auto& group : opt->param_groups())
      TORCH_CHECK(!static_cast<const torch::optim::AdamWOptions&>(group.options()).amsgrad(),
                  "attach_optimizer (rank ", rank_, "): amsgrad has no fused step; flatshard "
                  "steps offloaded units with FusedAdamW's fused kernel only");
  entries_.clear();
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
  if (delayed_) {
    enqueue_delayed(flat, e, stream, job);
  } else {
    // Captured here, so a gradient written after the reduction (hand-written clipping) is
    // caught by the next opt.step() whenever the worker gets to it.
    job.staged = flat.has_staged_host_grad();
    job.captured = opt_->capture_located(e.params);
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
  if (flat.has_staged_host_grad()) {  // added to a gradient left from before: rare, synchronous
    if (device) e.done->synchronize();
    flat.finish_host_grad();
  }
  if (device) e.done->block(upload_stream_);  // the unit's backward read the copy before this
  flat.refresh_compute_copy(upload_stream_, /*hold=*/true);
  if (device) {
    if (!e.uploaded) e.uploaded.emplace(stream.device_type());
    e.uploaded->record(upload_stream_);  // the worker's step writes the master the upload reads
  }
  job.captured = opt_->capture_located(e.params);
  flat.drop_master_grad();
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
  if (delayed_) {  // Note [Delayed offload step]
    if (job.wait_event) job.entry->uploaded->synchronize();  // after the gradient's copy too
    opt_->run_step(*job.captured);
    return;
  }
  if (job.wait_event) job.entry->done->synchronize();
  job.flat->finish_host_grad();  // one in-place add to the captured gradient when staged
  opt_->run_step(*job.captured);
  opt_->mark_stepped_early(*job.captured, job.staged ? 1 : 0);
  job.flat->refresh_compute_copy(upload_stream_);
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

}  // namespace flatshard
