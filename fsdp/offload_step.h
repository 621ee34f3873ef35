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
//   staged gradient (FlatParam::finish_host_grad) and calls FusedAdamW::step_params over the
//   optimizer's tensors that live in the unit's master (the master, or its shard views for
//   parameter groups), with their groups' options. At level 1 it then uploads the unit's
//   compute-dtype shard on its own stream (FlatParam::refresh_compute_copy), so PCIe carries
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
//   have stepped), and any other write to a stepped gradient before optimizer.step()
//   (FusedAdamW names it: unscaling, hand-written clipping).
// - Errors on the worker (a kernel that throws) are kept and rethrown, naming the unit and the
//   rank, by the next wait.
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

namespace flatshard {

class FlatParam;
class FusedAdamW;

class OffloadStepper {
 public:
  // `upload_stream`: where the stepped masters' compute-dtype copies are uploaded (level 1).
  OffloadStepper(int rank, c10::Stream upload_stream)
      : rank_(rank), upload_stream_(upload_stream) {}
  ~OffloadStepper();  // waits for queued steps (errors dropped), joins the worker
  OffloadStepper(const OffloadStepper&) = delete;
  OffloadStepper& operator=(const OffloadStepper&) = delete;

  // The optimizer whose tensors step with each unit: per FlatParam, the tensors of `opt` that
  // share its master's storage. Waits first. Replaces an earlier attachment.
  void attach(std::shared_ptr<FusedAdamW> opt, const std::vector<FlatParam*>& flats);
  bool attached() const { return opt_ != nullptr; }
  // Main thread, after `flat`'s reduction was enqueued on `stream`: queue its step (a no-op for
  // a unit the optimizer holds no tensor of).
  void enqueue(FlatParam& flat, const c10::Stream& stream);
  // Blocks until every queued step ran; rethrows the first error a step raised.
  void wait();
  // Whether enqueue() queued a step since the last call (StepGuard: a step happened).
  bool take_stepped();

 private:
  struct Entry {
    std::vector<at::Tensor> params;  // the optimizer's tensors in this unit's master
    std::optional<c10::Event> done;  // recorded on the reduce stream by enqueue()
  };
  struct Job {
    FlatParam* flat;
    Entry* entry;
    bool wait_event;
  };
  void run();

  int rank_;
  c10::Stream upload_stream_;
  std::shared_ptr<FusedAdamW> opt_;
  std::unordered_map<const FlatParam*, Entry> entries_;
  bool stepped_ = false;

  std::mutex mu_;
  std::condition_variable cv_;  // jobs queued, or stop
  std::condition_variable idle_cv_;  // pending_ reached 0
  std::deque<Job> jobs_;
  int64_t pending_ = 0;  // queued + running
  bool stop_ = false;
  std::exception_ptr error_;
  std::thread worker_;  // started by the first enqueue()
};

}  // namespace flatshard
