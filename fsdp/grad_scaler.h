// flatshard/fsdp/grad_scaler.h — loss scaling for fp16 compute over fp32 master shards: the
// rules of torch.amp.GradScaler, with the inf/NaN check agreed by every rank.
//
//   flatshard::ShardingOptions o;
//   o.mixed_precision.param_dtype = c10::kHalf;             // reduce dtype follows: fp16
//   auto fsdp = flatshard::fully_shard(model, plan, comm, o);
//   torch::optim::AdamW opt(fsdp->parameters(), ...);        // fp32 master shards
//   flatshard::ShardedGradScaler scaler(*fsdp);
//   for (...) {
//     opt.zero_grad();
//     scaler.scale(loss).backward();
//     scaler.unscale_(opt);  fsdp->clip_grad_norm_(1.0);     // optional: clip true gradients
//     scaler.step(opt);                                      // skipped on every rank after inf/NaN
//     scaler.update();
//   }
//
// Why: fp16 holds magnitudes in [6e-8, 65504]; small gradients flush to zero unless the loss
// is multiplied by a large factor first, and a factor too large overflows to inf. The scaler
// keeps the factor as large as the gradients allow: it backs off when an overflow appears and
// grows again after a run of clean steps. bf16 has fp32's range and needs none of this.
//
// Rules (torch.amp.GradScaler's; defaults beside GradScalerOptions' fields)
// - scale(loss) = loss * S. The gradients reaching the fp32 masters are then S times too large
//   (and inf/NaN where fp16 compute or an fp16 reduction overflowed).
// - unscale_(opt): every gradient the optimizer holds (fp32: the masters' .grad) is multiplied
//   by 1/S (computed in double, rounded to fp32, as torch does) and checked for inf/NaN; at most
//   once per optimizer per step. With S < 1 the unscaled values are checked as well (a finite
//   gradient times 1/S > 1 can overflow), so a non-finite gradient never makes a clean step. The
//   local answer is combined with ONE all-reduce of one 2-float tensor [found_inf, failed] over
//   every rank holding shards: the shard group, then (HSDP) the replicate group with the same
//   tensor, so the result is the sum over all R * S ranks.
// - step(opt): unscale_(opt) unless done this step; then opt.step() only if no rank found
//   inf/NaN. Returns whether it stepped — the same on every rank.
// - update(): after a skipped step S *= backoff_factor and the clean-step count resets; after
//   growth_interval consecutive clean steps S *= growth_factor (kept only if finite in fp32)
//   and the count resets. S is held as an fp32 value, like torch's scale tensor.
// - Note [Loss scale range] (grad_scaler.cpp): S is always a normal fp32 value, in
//   [2^-126, FLT_MAX], so 1/S is finite. An init_scale or a loaded scale outside it is refused;
//   backing off below 2^-126 holds S at 2^-126 (torch's would go subnormal, then 0, and its
//   unscale would turn every gradient into inf/NaN unseen).
// - enabled = false: scale() returns the loss, step() is opt.step(), unscale_() and update() do
//   nothing, state_dict() is not saved by checkpoints (checkpoint/checkpoint.h).
//
// Contract
// - Collective: unscale_() and step() (which may unscale) are called by every rank of the
//   ShardedModel's groups in the same order, between backward and the next forward. scale(),
//   update(), get_scale() and the state are local; they agree across ranks because every rank
//   sees the same combined answer. The ShardedModel must outlive the scaler.
// - Streams and sync: the unscale and the all-reduce are queued on the current stream of the
//   communicator's device (after backward, flatshard has ordered it after every reduction);
//   unscale_() then reads the 2-float answer on the host — one device-to-host copy per
//   optimizer per step, as torch's step() does.
// - Errors (c10::Error, never a crash): misuse — unscale_() twice, unscale_() after step(),
//   step() twice without update(), update() with nothing recorded, load_state_dict() inside a
//   step — names the call and the rank and throws before any collective (every rank of a
//   program that misuses misuses alike). A local fault found inside unscale_() (a gradient that
//   is not fp32, a failing kernel) is carried in the all-reduce, so every rank throws: the
//   failing rank its own message, the others naming it (collectives/agree.h). Bad options and
//   bad state name the field, the value and the rank.
// - Not thread-safe: one scaler per rank.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <unordered_map>

namespace torch {
namespace optim {
class Optimizer;
}
}  // namespace torch

namespace flatshard {

class ShardedModel;

struct GradScalerOptions {
  double init_scale = 65536.0;     // S at the start: 2^16; a normal fp32 value, [2^-126, FLT_MAX]
  double growth_factor = 2.0;      // S *= this after growth_interval clean steps; (1, 2^16]
  double backoff_factor = 0.5;     // S *= this after a step with inf/NaN; [2^-16, 1)
  int64_t growth_interval = 2000;  // clean steps before growing; >= 1
  bool enabled = true;             // false: a pass-through (bf16 or fp32 runs keep one loop)
};

// What a checkpoint carries (state_dict()): the scale, the clean-step count and the constants.
struct GradScalerState {
  double scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t growth_tracker = 0;  // consecutive clean steps since the last change of S
  // Throws c10::Error "<what>: <field> ... got <value>" unless every field is usable: scale a
  // normal positive fp32 value (Note [Loss scale range]), growth_factor in (1, 2^16],
  // backoff_factor in [2^-16, 1), growth_interval in [1, 2^31 - 1], growth_tracker in
  // [0, growth_interval). Untrusted values (a manifest)
  // pass through it before anything uses them.
  void check(const std::string& what) const;
};

class ShardedGradScaler {
 public:
  // Throws for invalid options (naming the field, the value and the rank).
  explicit ShardedGradScaler(ShardedModel& model, GradScalerOptions options = {});

  bool enabled() const { return enabled_; }
  // loss * S (a new tensor; loss itself is unchanged). Floating-point losses only.
  at::Tensor scale(const at::Tensor& loss) const;
  // Collective (see the contract). Divides `opt`'s gradients by S, checks them for inf/NaN.
  void unscale_(torch::optim::Optimizer& opt);
  // Collective. Returns true if opt.step() ran (no rank found inf/NaN), false if skipped.
  bool step(torch::optim::Optimizer& opt);
  // Backs off or grows S from this step's answers (every optimizer unscaled since the last
  // update), then starts the next step.
  void update();
  // S (1.0 when disabled).
  double get_scale() const { return enabled_ ? static_cast<double>(scale_) : 1.0; }
  int64_t growth_tracker() const { return growth_tracker_; }

  GradScalerState state_dict() const;
  // Restores a state_dict() (checked first: GradScalerState::check). Between steps only. A
  // disabled scaler ignores it, as torch's does.
  void load_state_dict(const GradScalerState& state);

 private:
  enum class OptState { kUnscaled, kStepped };
  struct PerOptimizer {
    OptState state = OptState::kUnscaled;
    bool found_inf = false;
  };
  std::string where(const char* call) const;  // "ShardedGradScaler::<call> (rank R)"

  ShardedModel& model_;
  bool enabled_;
  float scale_;  // S, an fp32 value as torch's scale tensor
  double growth_factor_, backoff_factor_;
  int64_t growth_interval_;
  int64_t growth_tracker_ = 0;
  // This step's optimizers (keyed by address), cleared by update(). Absent: not unscaled yet.
  std::unordered_map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer_;
};

}  // namespace flatshard
