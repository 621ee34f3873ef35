// flatshard/fsdp/step_guard.h — notice optimizer misuse from the master shards' version counters.
//
// Two mistakes leave no error behind by themselves:
// 1. Stepping the optimizer after a backward pass run with set_requires_gradient_sync(false):
//    nothing was reduced, so the step used whatever the masters' .grad held before (stale or
//    another step's gradients). Certain, so it throws.
// 2. An optimizer built on the model's original parameters instead of ShardedModel::parameters():
//    those are views of gathered buffers whose .grad flatshard clears after reducing, so the
//    optimizer skips them and the masters never change — training silently does nothing. Not
//    certain (a loop may legitimately run backward without stepping, e.g. many synced
//    micro-batches of gradient accumulation), so it warns once (TORCH_WARN) after
//    kStaleStepsBeforeWarning consecutive reduced backward passes with no master changed.
//    ShardedModel::check_optimizer() gives a certain answer on demand.
//
// How: every in-place write to a master (optimizer steps, copy_, checkpoint loads) bumps its
// version counter (`_version()`); flatshard itself never writes a master during a step, but
// with offload_step = backward, when it says so (on_backward_end's `stepped`). With offload_step
// = delayed, the worker writes offloaded masters at any time (Note [Delayed offload step]):
// their versions say nothing and are not compared (`skip_offloaded`).
// Contract: on_backward_end() at the end of each backward pass, on_step_start() when a new
// forward begins (before any unit gathers). Per rank, single-threaded, no collectives.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace flatshard {

class Unit;

class StepGuard {
 public:
  static constexpr int kStaleStepsBeforeWarning = 10;

  // `reduced`: gradients were reduced into the masters' .grad (gradient sync was on).
  // `stepped`: flatshard stepped some masters during this backward (Note [Offload step in
  // backward]), so a step certainly happened.
  void on_backward_end(const std::vector<std::unique_ptr<Unit>>& units, bool reduced,
                       bool stepped, int rank, bool skip_offloaded = false);
  // Throws for mistake 1; warns once for mistake 2.
  void on_step_start(const std::vector<std::unique_ptr<Unit>>& units, int rank);

 private:
  enum class Last { kNone, kReduced, kUnreduced };
  Last last_ = Last::kNone;
  std::vector<int64_t> versions_;  // masters' versions at the end of the last backward
  int stale_steps_ = 0;            // consecutive reduced backwards with no master changed
  bool stepped_ = false;           // the last backward stepped masters itself
  bool warned_ = false;
  bool skip_offloaded_ = false;    // the last backward's on_backward_end said so
};

}  // namespace flatshard
