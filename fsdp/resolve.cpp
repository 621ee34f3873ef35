#include "fsdp/resolve.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "collectives/env.h"
#include "wrap_policies/match.h"

namespace flatshard {

ResolvedUnit resolve_unit(const UnitSpec& spec, const ShardingOptions& options,
                          int shard_world_size) {
  TORCH_CHECK(shard_world_size >= 1, "unit '", spec.name, "': world size must be >= 1, got ",
              shard_world_size);
  ResolvedUnit r;
  r.strategy = spec.options.strategy.value_or(options.strategy);
  const bool reshard = spec.options.reshard_after_forward.value_or(
      spec.is_root ? false : options.reshard_after_forward);
  r.reshard_after_forward = reshard && r.strategy == ShardingStrategy::kFullShard;
  r.recompute = spec.options.recompute.value_or(false);
  TORCH_CHECK(!(r.recompute && spec.is_root), "unit '", spec.name,
              "': recompute is not supported on the root unit (its forward is the whole "
              "model's); set it on the layers' units instead, e.g. recompute:type=Block");

  const auto& mp = options.mixed_precision;
  r.flat.sharded = r.strategy != ShardingStrategy::kNoShard;
  r.flat.param_dtype = mp.param_dtype;
  r.flat.reduce_dtype = mp.reduce_dtype.value_or(mp.param_dtype);
  r.flat.align = options.align;
  r.flat.sync_module_states = options.sync_module_states;
  r.flat.poison_padding = env::debug();
  const int offload = spec.options.offload.value_or(options.offload);
  check_offload_level(offload, "unit '" + spec.name + "'");
  r.flat.offload = r.flat.sharded ? offload : std::min(offload, 1);
  // Note [Delayed offload step] (fsdp/offload_step.h): level 2 reads the master at every gather.
  TORCH_CHECK(r.flat.offload < 2 || options.offload_step != OffloadStep::kDelayed, "unit '",
              spec.name, "': offload level 2 cannot run with offload_step = delayed (each gather "
              "would upload the master while the delayed step writes it); use level 1, or "
              "offload_step = backward");
  // Note [Low-precision master gradient] (flat_param/collective_plan.h).
  r.flat.keep_low_precision_grads = mp.keep_low_precision_grads;
  // flat_param/quantized_gather.h: only a sharded unit has a wire. MixedPrecision's applies to
  // the sharded units; a plan's option asks for this unit (validate() refuses it on NO_SHARD).
  r.flat.gather_dtype = spec.options.gather_dtype.value_or(
      r.flat.sharded ? mp.gather_dtype : GatherDtype::kParam);
  // Note [Kept compute shard] (flat_param/collective_plan.h): only where it means something.
  r.flat.keep_compute_shard = options.keep_compute_shard && r.flat.can_keep_compute_shard();
  r.flat.validate(spec.name);
  r.layout_world_size = r.flat.sharded ? shard_world_size : 1;
  return r;
}

void check_recompute_plan(const Plan& plan) {
  // Every unit's module paths, sorted: the paths below p are the range starting at p + ".",
  // found by one binary search per recompute path (O(n log n); testing every pair of units was
  // O(n^2) and made the advisor's recompute candidates quadratic in layers).
  std::vector<std::pair<std::string, const UnitSpec*>> paths;
  bool any = false;
  for (const UnitSpec& u : plan.units) {
    any = any || u.options.recompute.value_or(false);
    for (const std::string& q : u.module_paths) paths.emplace_back(q, &u);
  }
  if (!any) return;
  std::sort(paths.begin(), paths.end());
  for (const UnitSpec& u : plan.units) {
    if (!u.options.recompute.value_or(false)) continue;
    for (const std::string& p : u.module_paths) {
      const std::string below = p + ".";
      for (auto it = std::lower_bound(paths.begin(), paths.end(),
                                      std::make_pair(below, static_cast<const UnitSpec*>(nullptr)));
           it != paths.end() && it->first.compare(0, below.size(), below) == 0; ++it) {
        if (it->second == &u) continue;
        const UnitSpec& v = *it->second;
        const std::string& q = it->first;
        TORCH_CHECK(false, "unit '", u.name, "' is recomputed but its member module '", p,
                    "' contains module '", q, "' of unit '", v.name,
                    "': a unit nested inside a recompute unit is not supported (its forward "
                    "would run again inside the backward); recompute the inner unit "
                    "instead, or drop the rule that makes it a unit");
      }
    }
  }
}

void check_recompute_policy(const Policy& policy, const torch::nn::Module& model,
                            const Plan& plan) {
  for (const UnitSpec& u : plan.units)
    if (u.options.recompute.value_or(false)) return;  // the rule recomputes some unit: fine
  bool asks = false;
  for (const Rule& rule : policy.rules) asks = asks || rule.options.recompute.value_or(false);
  if (!asks) return;
  // The root as make_plan's terms would see it (wrap_policies/match.h: one home for matching).
  const PolicyMatcher matcher(policy);
  MatchSubject root = match_subject(model, "", model);
  if (matcher.needs_size())
    for (const auto& p : model.parameters(/*recurse=*/true)) root.free_numel += p.numel();
  for (size_t r = 0; r < policy.rules.size(); ++r) {
    const Rule& rule = policy.rules[r];
    if (!rule.options.recompute.value_or(false)) continue;
    const bool all = matcher.rule_matches(r, root);
    if (!all) continue;
    TORCH_CHECK(false, "unit '<root>': the rule '", to_spec(rule), "' asks for recompute and "
                "matches the root module (", model.name(), "), but recompute is not supported "
                "on the root unit (its forward is the whole model's) and a rule never makes the "
                "root a unit, so nothing would be recomputed; set it on the layers' units "
                "instead, e.g. recompute:type=Block");
  }
}

}  // namespace flatshard
