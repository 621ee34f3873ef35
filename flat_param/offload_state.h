// flatshard/flat_param/offload_state.h — what an offloaded unit keeps beside its host master.
//
// Contract
// - Note [CPU offload] (flat_param/offload.h): an offloaded unit's master and gradient live on
//   the host. What that needs beyond the collectives lives here, in an object the unit's plan
//   holds only when the unit is offloaded (STYLE.md 17: a wrapper, not a wider base):
//   OffloadCopy, the copy of the master the gathers read (the device's compute-dtype copy and
//   Note [Host compute copy]'s host buffer). The stepper (fsdp/offload_step.h) finds it as
//   FlatParam::gather_plan().extras().offload; null for units that are not offloaded.
// - Threads: the plan's gather() and update() run on the main thread; refresh(), host_copy(),
//   prepare_host_copy() and host_copy_written() may run on the stepper's thread, never at once
//   with the unit's gathers (Note [Offload step in backward]'s waits order them).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <cstdint>
#include <optional>

#include "flat_param/collective_plan.h"

namespace flatshard {

// The copy of the master an offloaded gather plan uploads from the host: which master version
// the device copy holds, the refresh() a gather must wait for, Note [Delayed offload step]'s
// hold (the copy then changes only by refresh()), and Note [Host compute copy]'s host buffer.
class OffloadCopy {
 public:
  // Where the gathers read the master on the device between uploads.
  enum class Kept {
    kNone,      // nowhere (level 2): every gather uploads (upload())
    kResident,  // level 1: a compute-dtype shard this allocates (resident_bytes()), uploaded at
                // the first gather
    kFull,      // an offloaded NO_SHARD unit: full() itself, uploaded now
  };
  // `args`: the owning plan's (they outlive this).
  OffloadCopy(const GatherArgs& args, Kept kept);
  OffloadCopy(const OffloadCopy&) = delete;
  OffloadCopy& operator=(const OffloadCopy&) = delete;

  // Device bytes held between gathers (level 1's resident shard; 0 otherwise).
  int64_t resident_bytes() const;

  // --- the plan's side (main thread) ---
  // Before a gather on `stream` that reads the kept copy: orders `stream` after the last
  // refresh()'s upload, then uploads the master into the copy unless it holds the master's
  // current version or is held. Returns the kept copy.
  const at::Tensor& update(c10::Stream stream);
  // Kept::kNone: the master into `dst` (compute dtype, the device) on the current stream, from
  // the host buffer as it is while it holds the master's current version, else the fp32 path.
  void upload(const at::Tensor& dst) const;

  // --- the stepper's side (fsdp/offload_step.h) ---
  // Right after an optimizer step wrote the master (Note [Offload step in backward]: on the
  // stepper's thread, once the unit's backward is done): brings the kept copy up to date now,
  // on `stream` (made current here), so the next gather finds it current and only waits for
  // `stream`'s work instead of uploading. Nothing where nothing is kept. `hold` (Note [Delayed
  // offload step]: on the main thread, before the step): from now on the copy changes only by
  // refresh(), not when the master's version moves (the step writing the master next must not
  // reach the device before the unit's next refresh), until release_hold().
  void refresh(c10::Stream stream, bool hold = false);
  // Ends a hold: the next gather uploads the master if it changed since the copy took it.
  void release_hold() { held_ = false; }
  // Note [Host compute copy] (flat_param/collective_plan.h): the host buffer (compute dtype,
  // master's element count) a CPU step writes the updated master into; allocated at the first
  // call; undefined when the compute dtype is fp32.
  at::Tensor host_copy();
  // Before a step writes host_copy() (on the stepper's thread, the previous upload of it
  // done): casts the master into it unless it already holds the master as it is now.
  void prepare_host_copy();
  // After that step: the buffer holds the master as it is now (its new version).
  void host_copy_written();

 private:
  // The master (or the host buffer when current) into the kept copy; `chunked` beside backward.
  void upload_kept(bool chunked);
  bool host_current() const;

  const GatherArgs& args_;
  at::Tensor kept_;          // the device copy the gathers read; undefined for Kept::kNone
  bool resident_;            // kept_ was allocated here (Kept::kResident)
  int64_t version_ = -1;     // master_version() kept_ last took
  std::optional<c10::Event> refreshed_;  // recorded by refresh(); the next gather waits for it
  bool held_ = false;                    // Note [Delayed offload step]
  // Note [Host compute copy]: pinned on CUDA; undefined until the stepper asks for it. Its
  // version is read by the gathers on the main thread and written by the stepper's thread,
  // never at once for a unit (Note [Offload step in backward]'s waits); atomic so that holds
  // without reasoning.
  at::Tensor host_;
  std::atomic<int64_t> host_version_{-1};
};

// Note [CPU offload]'s gradient side: the pinned host buffers an offloaded reduction is copied
// into without blocking the host (the host gradient, a staging buffer beside an existing one,
// Note [Host compute copy]'s reduce-dtype buffer), each reused while nobody else holds it (Note
// [Exact pinned allocations], offload.cpp: pinning pages per step would cost more than the
// copy). HostGradDelivery (plans.cpp) owns it and delivers into it; the stepper and
// the runtime's offload lifecycle (fsdp/offload_step.h) find it as
// FlatParam::reduce_plan().host_grad() and finish() adds what it staged.
class HostGrad {
 public:
  // `device`: the communicator's (pinned host memory when CUDA).
  explicit HostGrad(c10::Device device) : device_(device) {}
  HostGrad(const HostGrad&) = delete;
  HostGrad& operator=(const HostGrad&) = delete;

  // --- the plan's side, on the reduce stream (current), which allocated r.grad ---
  // The reduction `r` to the host. `current`: master's .grad now. Undefined: into the host
  // gradient, which is returned (master's .grad to be); defined: into the staging buffer
  // (finish()), and `current` is returned. Keeping the reduce dtype (keep_reduce_dtype())
  // with `current` undefined and `r` below fp32: into the reduce-dtype buffer (take_reduced()),
  // and the undefined `current` is returned.
  at::Tensor deliver(const ReduceResult& r, const at::Tensor& current);
  bool keeps_reduce_dtype() const { return keep_; }

  // --- the stepper's side ---
  // Note [Host compute copy]: from now on a reduction in a dtype below fp32 that finds no host
  // gradient to add to comes to the host as it is, for take_reduced(), and master's .grad stays
  // undefined.
  void keep_reduce_dtype(bool keep) { keep_ = keep; }
  // The last reduction's host gradient in the reduce dtype (then forgotten here), or undefined
  // when it went to master's .grad.
  at::Tensor take_reduced();
  // Whether a reduction waits in the staging buffer (finish() adds it).
  bool staged() const { return staged_; }
  // After the host waited for the reduction's stream: adds the staged reduction to `master`'s
  // .grad (the unit's master, whose .grad the delivery returned), then it is no longer staged
  // here. No-op when none is staged.
  void finish(const at::Tensor& master);

 private:
  c10::Device device_;           // the communicator's: pinned host memory when CUDA
  bool keep_ = false;            // Note [Host compute copy]
  at::Tensor reduced_host_;      // pinned; a reduction in the reduce dtype, reused when free
  bool reduced_ready_ = false;   // reduced_host_ holds the last reduction, not yet taken
  at::Tensor host_grad_;         // pinned; the host gradient's buffer, reused when free
  at::Tensor stage_;             // pinned; a reduction beside an existing host gradient
  bool staged_ = false;          // stage_ holds one to add
};

}  // namespace flatshard
