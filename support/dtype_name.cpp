// flatshard/support/dtype_name.cpp — see dtype_name.h for the contract.
#include "support/dtype_name.h"

#include <utility>

namespace flatshard {

namespace {

// The one table: name <-> type.
const std::pair<const char*, c10::ScalarType> kNames[] = {
    {"fp32", c10::kFloat}, {"bf16", c10::kBFloat16}, {"fp16", c10::kHalf}};

}  // namespace

std::string dtype_name(c10::ScalarType t) {
  for (const auto& [name, type] : kNames)
    if (type == t) return name;
  return c10::toString(t);
}

std::optional<c10::ScalarType> dtype_from_name(const std::string& name) {
  for (const auto& [n, type] : kNames)
    if (name == n) return type;
  return std::nullopt;
}

const std::vector<std::string>& dtype_names() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> out;
    for (const auto& entry : kNames) out.push_back(entry.first);
    return out;
  }();
  return names;
}

const char* gather_dtype_name(GatherDtype d) {
  switch (d) {
    case GatherDtype::kParam:
      return "param";
    case GatherDtype::kFp8:
      return "fp8";
    case GatherDtype::kInt8:
      return "int8";
    case GatherDtype::kFp8Delayed:
      return "fp8_delayed";
  }
  return "?";
}

std::optional<GatherDtype> gather_dtype_from_name(const std::string& name) {
  for (GatherDtype d :
       {GatherDtype::kParam, GatherDtype::kFp8, GatherDtype::kInt8, GatherDtype::kFp8Delayed})
    if (name == gather_dtype_name(d)) return d;
  return std::nullopt;
}

}  // namespace flatshard
