#include "flat_param/flat_param_config.h"

#include <c10/util/Exception.h>

namespace flatshard {

void check_offload_level(int level, const std::string& who) {
  TORCH_CHECK(level >= 0 && level <= 2, who, ": offload level must be 0, 1 or 2, got ", level);
}

void FlatParamConfig::validate(const std::string& unit) const {
  check_offload_level(offload, "unit '" + unit + "'");
  // Note [Low-precision master gradient] (flat_param/collective_plan.h).
  TORCH_CHECK(!(keep_low_precision_grads && offload > 0), "unit '", unit,
              "': MixedPrecision::keep_low_precision_grads cannot be combined with offload "
              "(level ", offload, "): offloaded gradients take the host path (Note [Host "
              "compute copy]); turn one of them off");
  // Note [Kept compute shard]: fsdp/resolve.cpp sets it only where it applies.
  TORCH_CHECK(!keep_compute_shard || can_keep_compute_shard(),
              "unit '", unit, "': keep_compute_shard applies to sharded units below fp32 that "
              "are not offloaded and gather their param dtype (sharded ", sharded, ", offload ",
              offload, ", param dtype ", param_dtype, ", gather dtype ",
              gather_dtype_name(gather_dtype), ")");
  if (gather_dtype == GatherDtype::kParam) return;
  TORCH_CHECK(sharded, "unit '", unit, "': gather dtype ", gather_dtype_name(gather_dtype),
              " needs a sharded unit (a NO_SHARD unit gathers nothing); use gather dtype param");
  TORCH_CHECK(offload == 0, "unit '", unit, "': gather dtype ", gather_dtype_name(gather_dtype),
              " cannot be combined with offload (level ", offload,
              "): the offloaded gathers upload the compute dtype; turn one of them off");
}


int64_t master_version_of(const at::Tensor& master, const std::vector<ShardView>& views) {
  int64_t v = static_cast<int64_t>(master._version());
  for (const auto& view : views) v += static_cast<int64_t>(view.tensor._version());
  return v;
}

}  // namespace flatshard
