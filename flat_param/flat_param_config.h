// flatshard/flat_param/flat_param_config.h — what a unit's flat parameter is asked to be, and
// the per-parameter views of its master shard: the plain data that FlatParam
// (flat_param/flat_param.h) and its collective plans (flat_param/collective_plan.h) share, in a
// header of its own so the plans need not include FlatParam (no include loop in flat_param/).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "support/dtype_name.h"  // GatherDtype

namespace flatshard {

struct FlatParamConfig {
  bool sharded = true;                          // false: replicated (NO_SHARD)
  at::ScalarType param_dtype = at::kFloat;      // compute and all-gather dtype
  at::ScalarType reduce_dtype = at::kFloat;     // gradient reduction dtype
  int64_t align = 8;                            // elements; see FlatLayout
  bool sync_module_states = true;               // broadcast rank 0's values at construction
  // Debugging (FLATSHARD_DEBUG=1): after every unshard the padding of the gathered buffer is
  // filled with NaN, so code that reads padding produces NaN instead of silently using zeros;
  // a fresh flat gradient starts as NaN, so a region neither written nor zeroed shows.
  bool poison_padding = false;
  // CPU offload level, 0 (off), 1 or 2: Note [CPU offload] (flat_param/offload.h).
  int offload = 0;
  // Note [Low-precision master gradient] (collective_plan.h): master().grad keeps the reduce
  // dtype instead of being upcast to fp32. Not with offload (fsdp/resolve.cpp refuses it).
  bool keep_low_precision_grads = false;
  // Note [Kept compute shard] (collective_plan.h): a sharded unit below fp32, not offloaded,
  // keeps its master shard's compute-dtype cast on the device between gathers.
  bool keep_compute_shard = false;
  // Where keep_compute_shard means something (the one home of that rule): sharded, below fp32
  // (an fp32 cast would copy the master), not offloaded (level 1 keeps its own), gathering the
  // param dtype (a quantized gather sends its own wire).
  bool can_keep_compute_shard() const {
    return sharded && offload == 0 && param_dtype != at::kFloat &&
           gather_dtype == GatherDtype::kParam;
  }
  // The all-gather's wire format (sharded units; fsdp/resolve.cpp leaves NO_SHARD units at
  // kParam: they gather nothing). Not with offload.
  GatherDtype gather_dtype = GatherDtype::kParam;
  // The dtype of master().grad.
  at::ScalarType grad_dtype() const { return keep_low_precision_grads ? reduce_dtype : at::kFloat; }
  // The one home of the rules between these fields (fsdp/resolve.cpp, the plan factories and
  // the planner call it): the offload level (check_offload_level), no
  // keep_low_precision_grads with offload, keep_compute_shard only where it means something, a
  // quantized gather_dtype only on a sharded, not offloaded unit. Throws c10::Error naming
  // `unit`.
  void validate(const std::string& unit) const;
};

// Throws c10::Error "<who>: offload level must be 0, 1 or 2, got <level>" otherwise.
void check_offload_level(int level, const std::string& who);

// The part of one original parameter inside this rank's master shard (Note [Original-parameter
// views]): elements [begin, end) of master(), which are elements [param_begin, param_begin +
// end - begin) of the flattened parameter.
struct ShardView {
  int64_t begin = 0, end = 0;
  int64_t param_begin = 0;
  at::Tensor tensor;  // 1-D over master()'s storage; requires grad iff the parameter is trainable
  int64_t numel() const { return end - begin; }
};

// Sum of the version counters of `master` and the views' tensors: GatherArgs::master_version().
int64_t master_version_of(const at::Tensor& master, const std::vector<ShardView>& views);

}  // namespace flatshard
