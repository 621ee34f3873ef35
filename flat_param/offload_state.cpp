#include "flat_param/offload_state.h"

#include <c10/core/StreamGuard.h>

#include "flat_param/offload.h"
#include "flat_param/upcast.h"

namespace flatshard {

namespace {

// Beside backward, whose peak a refresh must not raise: 64 MiB of fp32 staging at a time.
constexpr int64_t kRefreshChunk = int64_t{16} << 20;

}  // namespace

OffloadCopy::OffloadCopy(const GatherArgs& args, Kept kept)
    : args_(args), resident_(kept == Kept::kResident) {
  switch (kept) {
    case Kept::kNone:
      break;
    case Kept::kResident:  // uploaded at the first gather
      kept_ = at::empty({args_.master.numel()}, at::TensorOptions()
                                                    .dtype(args_.full.scalar_type())
                                                    .device(args_.full.device()));
      break;
    case Kept::kFull:
      kept_ = args_.full;
      upload_kept(/*chunked=*/false);
      version_ = args_.master_version();
      break;
  }
}

int64_t OffloadCopy::resident_bytes() const {
  return resident_ && kept_.defined() ? static_cast<int64_t>(kept_.nbytes()) : 0;
}

bool OffloadCopy::host_current() const {
  return host_.defined() && host_version_.load() == args_.master_version();
}

void OffloadCopy::upload_kept(bool chunked) {
  if (host_current()) {
    upload(kept_);
  } else if (chunked) {
    upload_to_device_chunked(kept_, args_.master, kRefreshChunk);
  } else {
    upload_to_device(kept_, args_.master);
  }
}

const at::Tensor& OffloadCopy::update(c10::Stream stream) {
  if (refreshed_) {  // refresh() uploaded on its own stream: the gather reads after it
    refreshed_->block(stream);
    refreshed_.reset();
  }
  if (!held_ && args_.master_version() != version_) {  // Note [CPU offload]
    upload_kept(/*chunked=*/false);
    version_ = args_.master_version();
  }
  return kept_;
}

void OffloadCopy::upload(const at::Tensor& dst) const {
  if (host_current()) {
    // Without blocking the host (pinned on CUDA: an asynchronous DMA of the bytes as they are).
    dst.copy_(host_, /*non_blocking=*/dst.device() != host_.device());
  } else {
    upload_to_device(dst, args_.master);
  }
}

// Writing the kept copy here is safe: this unit's last gather read it before the unit's
// backward, which came before the reduction the caller waited for.
void OffloadCopy::refresh(c10::Stream stream, bool hold) {
  if (!kept_.defined() || kept_.numel() == 0) return;  // nothing kept: the gathers upload
  at::NoGradGuard no_grad;
  c10::StreamGuard guard(stream);
  held_ = hold;
  if (args_.master_version() == version_) return;
  upload_kept(/*chunked=*/true);
  version_ = args_.master_version();
  if (stream.device_type() == c10::DeviceType::CPU) return;
  refreshed_.emplace(stream.device_type());
  refreshed_->record(stream);
}

at::Tensor OffloadCopy::host_copy() {
  const at::Tensor& full = args_.full;
  if (full.scalar_type() == at::kFloat) return {};
  if (!host_.defined()) host_ = host_empty(args_.master.numel(), full.scalar_type(), full.device());
  return host_;
}

void OffloadCopy::prepare_host_copy() {
  if (!host_.defined() || host_current()) return;
  at::NoGradGuard no_grad;
  host_.copy_(args_.master);  // a host pass, rare: the first step, or after a load
  host_version_ = args_.master_version();
}

void OffloadCopy::host_copy_written() {
  if (host_.defined()) host_version_ = args_.master_version();
}


namespace {

// Whether the pinned buffer `t` can take the next copy: allocated, and nobody else holds it (a
// tensor or a view of its storage).
bool reusable(const at::Tensor& t) {
  return t.defined() && t.use_count() == 1 && t.storage().use_count() == 1;
}

}  // namespace

at::Tensor HostGrad::deliver(const ReduceResult& r, const at::Tensor& current) {
  if (keep_ && !current.defined() && r.reduced.scalar_type() != at::kFloat) {
    // Note [Host compute copy]: the reduce dtype's bytes go down; the step upcasts them.
    if (!reusable(reduced_host_))
      reduced_host_ = host_empty(r.reduced.numel(), r.reduced.scalar_type(), device_);
    download_to_host(reduced_host_, r.reduced);
    reduced_ready_ = true;
    return current;
  }
  const at::Tensor g = r.grad.defined() ? r.grad : to_float(r.reduced);
  if (!current.defined()) {
    // Note [Exact pinned allocations] (offload.cpp): the last gradient's buffer again, unless
    // someone still holds it.
    if (!reusable(host_grad_)) host_grad_ = host_empty(g.numel(), at::kFloat, device_);
    download_to_host(host_grad_, g);
    return host_grad_;
  }
  if (!stage_.defined()) stage_ = host_empty(g.numel(), at::kFloat, device_);
  download_to_host(stage_, g);
  staged_ = true;
  return current;
}

at::Tensor HostGrad::take_reduced() {
  if (!reduced_ready_) return {};
  reduced_ready_ = false;
  return reduced_host_;
}

void HostGrad::finish(const at::Tensor& master) {
  if (!staged_) return;
  staged_ = false;
  at::NoGradGuard no_grad;
  master.mutable_grad().add_(stage_);
}

}  // namespace flatshard
