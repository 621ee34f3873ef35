// flatshard/flat_param/collective_plan.cpp — see collective_plan.h for the contract. The concrete
// plans, their closed forms and the factory live in flat_param/plans.cpp, which includes the
// offload and quantized plans' headers; this file includes none of them, so no file pair in
// flat_param/ includes each other.
#include "flat_param/collective_plan.h"

namespace flatshard {

int64_t GatherArgs::master_version() const { return master_version_of(master, views); }

bool full_aliases_master(const FlatParamConfig& config) {
  return !config.sharded && config.param_dtype == at::kFloat && config.offload == 0;
}

}  // namespace flatshard
