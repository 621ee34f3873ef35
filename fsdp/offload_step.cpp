// flatshard/fsdp/offload_step.cpp — see Note [Offload step in backward] in offload_step.h.
#include "fsdp/offload_step.h"

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
  entries_.clear();
  opt_ = std::move(opt);
  if (!opt_) return;
  std::unordered_map<const c10::StorageImpl*, FlatParam*> by_storage;
  for (FlatParam* f : flats)
    if (f->master().defined() && f->master().numel() > 0)
      by_storage[f->master().storage().unsafeGetStorageImpl()] = f;
  for (const auto& group : opt_->param_groups())
    for (const auto& p : group.params()) {
      if (!p.defined() || !p.has_storage()) continue;
      auto it = by_storage.find(p.storage().unsafeGetStorageImpl());
      if (it != by_storage.end()) entries_[it->second].params.push_back(p);
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(Job{&flat, &e, device});
    ++pending_;
    if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
  }
  stepped_ = true;
  cv_.notify_one();
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

bool OffloadStepper::take_stepped() {
  const bool s = stepped_;
  stepped_ = false;
  return s;
}

void OffloadStepper::run() {
  for (;;) {
    Job job{};
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_
      job = jobs_.front();
      jobs_.pop_front();
    }
    std::exception_ptr failed;
    try {
      if (job.wait_event) job.entry->done->synchronize();
      job.flat->finish_host_grad();
      opt_->step_params(job.entry->params);
      job.flat->refresh_compute_copy(upload_stream_);
    } catch (const std::exception& ex) {
      try {
        TORCH_CHECK(false, "flatshard (rank ", rank_, "): the CPU optimizer step of unit '",
                    job.flat->unit_name(), "' during backward (offload_step = backward) failed: ",
                    ex.what());
      } catch (...) {
        failed = std::current_exception();
      }
    } catch (...) {
      failed = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed && !error_) error_ = failed;
      if (--pending_ == 0) idle_cv_.notify_all();
    }
  }
}

}  // namespace flatshard
