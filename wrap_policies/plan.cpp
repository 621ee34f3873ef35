// flatshard/wrap_policies/plan.cpp — printing and sums over a Plan (see plan.h).
#include "wrap_policies/plan.h"

#include <algorithm>
#include <sstream>

#include "support/format.h"
#include "support/input_file.h"

namespace flatshard {

const char* to_string(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard:
      return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard:
      return "NO_SHARD";
  }
  return "?";
}

namespace {

// "a, b, c" of at most `max` escaped names, then ", ... (N more)".
std::string name_list(const std::vector<std::string>& names, size_t max = 16) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < max; ++i)
    s += (i ? ", " : "") + printable_escape(names[i]);
  if (names.size() > max) s += ", ... (" + std::to_string(names.size() - max) + " more)";
  return s.empty() ? "(none)" : s;
}

}  // namespace

std::string Plan::unmatched_warning() const {
  if (matched_modules != 0 || units.size() != 1 || policy_rules == 0) return "";
  constexpr size_t kMaxSpec = 200;
  std::string spec = printable_escape(policy_spec.substr(0, kMaxSpec));
  if (policy_spec.size() > kMaxSpec) spec += "...";
  return "the policy matched no module" + (spec.empty() ? "" : " ('" + spec + "')") +
         ": the root unit would hold the whole model, gathered at once (no overlap, peak = the "
         "full model); check the type names and paths: the model's types are " +
         name_list(model_types) + "; its top-level paths are " + name_list(top_level_paths);
}

namespace {

// "default" when the rule set nothing, so the table shows what fully_shard()'s options decide.
std::string options_text(const UnitOptions& o) {
  std::string s = o.strategy ? to_string(*o.strategy) : "default";
  if (o.reshard_after_forward) s += *o.reshard_after_forward ? " reshard" : " keep";
  if (o.recompute) s += *o.recompute ? " recompute" : " no-recompute";
  if (o.offload) s += " offload" + std::to_string(*o.offload);
  if (o.gather_dtype) s += std::string(" gather_") + gather_dtype_name(*o.gather_dtype);
  return s;
}

}  // namespace

int64_t Plan::total_numel() const {
  int64_t n = 0;
  for (const auto& u : units) n += u.numel;
  return n;
}

const UnitSpec* Plan::find(const std::string& name) const {
  for (const auto& u : units)
    if (u.name == name) return &u;
  return nullptr;
}

std::string Plan::to_string() const {
  const std::vector<std::string> header = {"#", "unit", "strategy", "modules", "params", "numel"};
  using A = TextTable::Align;
  TextTable table(header, {A::kRight, A::kLeft, A::kLeft, A::kRight, A::kRight, A::kRight});
  for (size_t i = 0; i < units.size(); ++i) {
    const auto& u = units[i];
    table.add_row({std::to_string(i), u.name, options_text(u.options),
                   std::to_string(u.module_paths.size()), std::to_string(u.param_names.size()),
                   std::to_string(u.numel)});
  }
  std::ostringstream os;
  os << table;
  os << "units: " << units.size() << ", total numel: " << total_numel()
     << ", tied params: " << tied.size();
  if (!empty_units.empty()) os << ", empty units dropped: " << empty_units.size();
  os << '\n';
  for (const auto& [first, others] : tied) {
    os << "tied: " << printable_escape(first);  // names may come from a file (the table's are)
    for (const auto& o : others) os << " = " << printable_escape(o);
    os << '\n';
  }
  return os.str();
}

}  // namespace flatshard
