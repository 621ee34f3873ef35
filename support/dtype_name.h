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

}  // namespace flatshard
