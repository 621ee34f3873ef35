// flatshard/support/dtype_name.h — the names flatshard gives the dtypes of its options: "fp32",
// "bf16", "fp16". The one map between them and c10's types: explain's report
// (planner/explain.cpp), the tools' --param-dtype / --reduce-dtype (cli/options.h) and the
// bench's reports all go through it, so a name reads and parses the same everywhere.
//
// Contract
// - dtype_name(t): "fp32" / "bf16" / "fp16" for kFloat / kBFloat16 / kHalf; c10's own name
//   (c10::toString) for any other type.
// - dtype_from_name(s): the inverse on those three names, exactly (no case folding, no
//   aliases); nullopt for anything else.
// - dtype_names(): {"fp32", "bf16", "fp16"}, the order help texts list them in.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <vector>

namespace flatshard {

std::string dtype_name(c10::ScalarType t);
std::optional<c10::ScalarType> dtype_from_name(const std::string& name);
const std::vector<std::string>& dtype_names();

// What a sharded unit's all-gather puts on the wire (flat_param/quantized_gather.h):
// kParam the shard in param_dtype (the default); kFp8 float8_e4m3fn with one fp32 scale per
// original parameter; kInt8 block-wise symmetric int8, one fp32 scale per 256 elements of the
// shard. Either way the gathered parameters are param_dtype and the masters stay fp32. Here,
// at the bottom, because MixedPrecision (fsdp/), FlatParamConfig (flat_param/) and a plan's
// UnitOptions (wrap_policies/) all name it.
// kFp8Delayed is kFp8 with the previous gather's amax (Note [Delayed fp8 amax]): no amax
// all-reduce after the first gather.
enum class GatherDtype { kParam, kFp8, kInt8, kFp8Delayed };
// "param", "fp8", "int8", "fp8_delayed": the names options, flags and explain use (a spec's words
// are "gather_" + the name).
const char* gather_dtype_name(GatherDtype d);
// The inverse, exactly; nullopt for anything else.
std::optional<GatherDtype> gather_dtype_from_name(const std::string& name);

}  // namespace flatshard
