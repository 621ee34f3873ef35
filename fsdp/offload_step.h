// flatshard/fsdp/offload_step.h — the CPU optimizer step of offloaded units, during backward.
//
// Note [Offload step in backward]
// With CPU offload (Note [CPU offload], flat_param/offload.h) the optimizer steps the host
// masters on the CPU. By default (OffloadStep::kAfterBackward) that step starts when the user
// calls optimizer.step() after backward, so a training step lasts GPU work + CPU optimizer.
// With ShardingOptions::offload_step = OffloadStep::kBackward and the optimizer attached
// (ShardedModel::attach_optimizer, a flatshard::FusedAdamW), each offloaded unit's master is
// stepped on a worker thread as soon as its reduced gradient is on the host, while the device
// runs the backward of the units after it (ZeRO-Offload's overlap without its delay):
// - Trigger: the unit's post-backward, right after its reduction (and the copy of the gradient
//   to the host) was enqueued on the reduce stream: the stepper records an event there and
//   queues the unit. The worker waits for that event on the host (nothing else blocks), adds a
//   staged gradient (HostGrad::finish) and calls FusedAdamW::step_params over the
//   optimizer's tensors that live in the unit's master (the master, or its shard views for
//   parameter groups), with their groups' options. At level 1 it then uploads the unit's
//   compute-dtype shard on its own stream (OffloadCopy::refresh), so PCIe carries
//   the new values during the rest of backward instead of in the next forward, whose gather
//   only waits for that stream. (Level 2 uploads at every gather, as without this mode.)
// - The rest: optimizer.step() waits for the worker (FusedAdamW::set_before_step), then steps
//   what was not stepped early (units not offloaded, tensors outside the model). A new forward
//   also waits before its first gather, so the next upload reads the stepped master, and so
//   does a backward's first pre-backward (a second backward over a retained graph gathers and
//   reduces again); so do gather_full_params/grads, checkpoints and the ShardedModel's
//   destructor.
// - Exact: the same kernel over the same tensors, in another list: bit for bit the result of
//   stepping after backward (tests/offload_test.cpp). Every synced backward is an optimizer
//   step: accumulate micro-batches with set_requires_gradient_sync(false), which reduces (and
//   steps) only on the last one.
// - Refused, with a message: an optimizer other than FusedAdamW (the per-unit step needs
//   step_params), a backward with offloaded units and no optimizer attached,
//   clip_grad_norm_ (the global norm is known only after the last reduction, when most units
//   have stepped), and any other write to an offloaded unit's gradient after its reduction
//   and before optimizer.step() (FusedAdamW names it: unscaling, hand-written clipping). The
//   step is captured at the reduction (FusedAdamW::capture_step, with the gradients' versions),
//   so the write is caught whether the worker ran before or after it.
// - Errors on the worker (a kernel that throws) are kept and rethrown, naming the unit and the
//   rank, by the next wait.
//
// Note [Delayed offload step]
// OffloadStep::kDelayed is ZeRO-Offload's one-step-delayed update, opt-in: the device computes
// step N+1's forward and backward with the parameters of before step N's update, so that
// update runs on the host beside them instead of beside step N's remaining backward only.
// - Semantics: with M_k the masters after k steps and g_k step k's gradient, step k's forward
//   and backward read M_{k-2} (M_0 for the first two steps) and M_k = AdamW(M_{k-1}, g_k).
//   Only offloaded units are delayed; units on the device step in optimizer.step() as always.
//   tests/offload_test.cpp checks this against an unsharded model trained with that delay.
// - Per unit, on the main thread, in its post-backward: wait for the unit's previous step (the
//   backpressure when the host is the slower side); reduce (the gradient goes to the host);
//   then, on the upload stream after the reduction, refresh the device copy from the master
//   (M_{k-1}, complete: its step was waited for) with a hold (OffloadCopy::refresh:
//   until the next refresh the copy ignores writes to the master); capture the step
//   (FusedAdamW::capture_step: the gradient and the group options as they are now) and drop
//   the unit's gradients (master and shard views: they belong to that step now, so zero_grad,
//   clipping or inspection cannot race with it) and mark its tensors stepped early
//   (FusedAdamW::mark_stepped_early), so opt.step() skips them; queue it. The worker waits for the
//   upload (it reads the master) and steps. The next forward and backward gather the held copy
//   without waiting for the worker.
// - Level 1 only: level 2 uploads from the master at every gather, which the worker writes
//   meanwhile; sharded level-2 units are refused at setup. Offloaded NO_SHARD units (level 1
//   either way) are delayed like level 1.
// - Waits: gather_full_params/grads, checkpoints and the destructor wait for the worker and
//   read the newest masters. sync_offload_params() also ends the holds, so the next forward
//   reads the newest masters (before evaluation; checkpoint loads do it). After backward the
//   offloaded units' gradients are undefined (gather_full_grads shows zeros for them).
// - Refused, with a message: clip_grad_norm_ and the gradient scaler (the step takes the
//   gradient at the reduction), a second synced backward without a forward between (a
//   retained graph: its gathers would read a copy refreshed since the forward), level 2, and
//   any gradient an offloaded tensor holds at opt.step() (written after backward, e.g. zeros
//   for "missing" gradients: it would step that tensor a second time; opt.step() throws the
//   backward mode's error before stepping anything).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "collectives/env.h"
#include "optim/fused_adamw.h"

namespace flatshard {

class FlatParam;
class Tracer;

class OffloadStepper {
 public:
  // `upload_stream`: where the stepped masters' compute-dtype copies are uploaded (level 1).
  // `delayed`: Note [Delayed offload step]; else Note [Offload step in backward].
  // `tracer` (nullptr: off) gets each step's spans on its CPU optimizer track (fsdp/trace.h).
  OffloadStepper(int rank, c10::Stream upload_stream, bool delayed, Tracer* tracer = nullptr)
      : rank_(rank),
        upload_stream_(upload_stream),
        delayed_(delayed),
        threads_(env::offload_step_threads()),
        tracer_(tracer) {}
  ~OffloadStepper();  // waits for queued steps (errors dropped), joins the worker
  OffloadStepper(const OffloadStepper&) = delete;
  OffloadStepper& operator=(const OffloadStepper&) = delete;

  // The optimizer whose tensors step with each unit: per FlatParam, the tensors of `opt` that
  // share its master's storage. Waits first. Replaces an earlier attachment. `trace_units`
  // (empty, or one per flat): the units' indices in the trace.
  void attach(std::shared_ptr<FusedAdamW> opt, const std::vector<FlatParam*>& flats,
              const std::vector<int>& trace_units = {});
  bool attached() const { return opt_ != nullptr; }
  // Main thread, after `flat`'s reduction was enqueued on `stream`: queue its step (a no-op for
  // a unit the optimizer holds no tensor of). Delayed: refreshes the device copy first.
  void enqueue(FlatParam& flat, const c10::Stream& stream);
  // Blocks until every queued step ran; rethrows the first error a step raised.
  void wait();
  // Blocks until `flat`'s queued step (if any) ran; rethrows as wait(). Main thread, before the
  // unit's reduction: the worker no longer reads its host gradient.
  void wait_for(const FlatParam& flat);
  bool delayed() const { return delayed_; }
  // Whether enqueue() queued a step since the last call (StepGuard: a step happened).
  bool take_stepped();

 private:
  struct Entry {
    // The optimizer's tensors in this unit's master, with their groups (FusedAdamW::located).
    std::vector<FusedAdamW::Located> params;
    std::optional<c10::Event> done;  // recorded on the reduce stream by enqueue()
    std::optional<c10::Event> uploaded;  // delayed: after the refresh, on the upload stream
    bool queued = false;                 // a step of this unit is queued or running (mu_)
    int trace_unit = -1;                 // the unit's index in the trace
    // Note [Host compute copy]: the buffer its steps write the compute-dtype master into, taken
    // at attach (undefined: the fp32 path, and no host-copy work per step).
    at::Tensor host_copy;
  };
  struct Job {
    FlatParam* flat = nullptr;
    Entry* entry = nullptr;
    bool wait_event = false;
    std::optional<FusedAdamW::CapturedStep> captured;  // the step to run, taken at enqueue()
    bool staged = false;  // backward: HostGrad::finish() adds to the captured gradient
    int trace_step = -1;  // the trace's step it was queued in (-1: not traced)
  };
  void run();
  void run_job(Job& job);
  // The unit's step as it reads now (Note [Host compute copy]: its gradient in the reduce dtype
  // and its compute-dtype copy, where the unit has them).
  FusedAdamW::CapturedStep capture(FlatParam& flat, const Entry& e);
  void enqueue_delayed(FlatParam& flat, Entry& e, const c10::Stream& stream, Job& job);

  int rank_;
  c10::Stream upload_stream_;
  bool delayed_;
  int threads_;  // the worker's intra-op threads (env FLATSHARD_OFFLOAD_STEP_THREADS; 0: default)
  Tracer* tracer_;  // nullptr: not tracing; outlives the stepper (the runtime owns both)
  std::shared_ptr<FusedAdamW> opt_;
  std::unordered_map<const FlatParam*, Entry> entries_;
  bool stepped_ = false;

  std::mutex mu_;
  std::condition_variable cv_;  // jobs queued, or stop
  std::condition_variable idle_cv_;  // a step ended
  std::deque<Job> jobs_;
  int64_t pending_ = 0;  // queued + running
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread worker_;  // started by the first enqueue()
};

// Note [CPU offload]'s lifecycle over one model's units, in one place: what offload does at each
// point of a step, for every offload_step mode. The runtime (fsdp/runtime.cpp) calls it at its
// hook points, each unit (fsdp/unit.cpp) around its reduction, the ShardedModel for its waits,
// the optimizer's attachment and clipping. With offload_step = after backward (no stepper) that
// is the end of backward's host sync; with backward or delayed, the stepper's queue, its waits
// and the checks of Notes [Offload step in backward] and [Delayed offload step].
// Main thread only (the stepper's worker runs behind it).
class OffloadLifecycle {
 public:
  // `stepper`: null unless offload_step is kBackward or kDelayed.
  OffloadLifecycle(int rank, std::shared_ptr<OffloadStepper> stepper)
      : rank_(rank), stepper_(std::move(stepper)) {}
  OffloadLifecycle(const OffloadLifecycle&) = delete;
  OffloadLifecycle& operator=(const OffloadLifecycle&) = delete;

  // Each unit's flat parameter as the unit is built, in plan order; `trace_index`: the unit's
  // index in the trace. The units outlive this (the runtime destroys it first).
  void add_unit(FlatParam& flat, int trace_index);
  // flatshard steps the offloaded units itself (offload_step = backward or delayed).
  bool steps_in_backward() const { return stepper_ != nullptr; }
  bool delayed() const { return stepper_ && stepper_->delayed(); }
  bool any_offloaded() const { return any_offloaded_; }  // some unit's offload level is above 0

  // --- the runtime's hook points (fsdp/runtime.cpp) -----------------------------------------
  // The root's entry (a forward may begin): the last backward's CPU steps end before any upload
  // reads a master; not when delayed, nor inside a backward.
  void on_root_entry(bool backward_active);
  // A backward's first pre-backward: refuses a synced backward the stepper cannot step (no
  // optimizer attached; delayed and `forward_ran` false, a retained graph's second backward),
  // then waits for the stepper (not delayed).
  void on_backward_start(bool requires_grad_sync, bool forward_ran);
  // End of backward, after compute was ordered after the last reduction: without a stepper and
  // with sync, the step's one host sync on `compute`, then the staged host gradients are added.
  void on_backward_end(bool requires_grad_sync, c10::Stream compute);
  // Whether a step was queued since the last call (StepGuard).
  bool take_stepped() { return stepper_ && stepper_->take_stepped(); }

  // --- a unit's reduction (fsdp/unit.cpp), offloaded units with a stepper only -------------------
  // Before reduce_grad(): the unit's queued step no longer reads its host gradient.
  void before_reduction(const FlatParam& flat);
  // After it was enqueued on `stream`: the unit's CPU step is queued.
  void after_reduction(FlatParam& flat, const c10::Stream& stream);

  // --- the ShardedModel (fsdp/sharded_model.h) -------------------------------------------
  // Waits for the stepper's queued steps (a no-op without one); rethrows a step's error.
  void wait();
  // wait(), then the delayed mode's held device copies take the newest masters at the next
  // gather (OffloadCopy::release_hold).
  void sync_params();
  // The stepper steps offloaded units with `opt` from now on (steps_in_backward() only), and
  // opt.step() waits for it first (not when delayed: Note [Delayed offload step]).
  void attach(const std::shared_ptr<FusedAdamW>& opt);
  // Throws when offloaded units were stepped in backward: clip_grad_norm_ cannot apply to them.
  void check_clip_grad_norm() const;

 private:
  int rank_;
  std::shared_ptr<OffloadStepper> stepper_;  // shared: an attached optimizer's wait holds it weakly
  std::vector<FlatParam*> flats_;            // every unit's, in plan order
  std::vector<int> trace_units_;             // their indices in the trace
  bool any_offloaded_ = false;
};

}  // namespace flatshard
