// flatshard/wrap_policies/plan.cpp — printing and sums over a Plan (see plan.h).
#include "wrap_policies/plan.h"

#include <algorithm>
#include <sstream>

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

// "default" when the rule set nothing, so the table shows what fully_shard()'s options decide.
std::string options_text(const UnitOptions& o) {
  std::string s = o.strategy ? to_string(*o.strategy) : "default";
  if (o.reshard_after_forward) s += *o.reshard_after_forward ? " reshard" : " keep";
  return s;
}

// Left-aligned text cells, right-aligned numbers; widths from the content so long module paths
// never break the columns.
std::string pad(const std::string& s, size_t w, bool right) {
  if (s.size() >= w) return s;
  std::string fill(w - s.size(), ' ');
  return right ? fill + s : s + fill;
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
  const std::vector<bool> right = {true, false, false, true, true, true};
  std::vector<std::vector<std::string>> rows = {header};
  for (size_t i = 0; i < units.size(); ++i) {
    const auto& u = units[i];
    rows.push_back({std::to_string(i), u.name, options_text(u.options),
                    std::to_string(u.module_paths.size()), std::to_string(u.param_names.size()),
                    std::to_string(u.numel)});
  }
  std::vector<size_t> width(header.size(), 0);
  for (const auto& r : rows)
    for (size_t c = 0; c < r.size(); ++c) width[c] = std::max(width[c], r[c].size());

  std::ostringstream os;
  for (const auto& r : rows) {
    for (size_t c = 0; c < r.size(); ++c) {
      if (c) os << "  ";
      // No trailing blanks on the last column.
      os << (c + 1 == r.size() && !right[c] ? r[c] : pad(r[c], width[c], right[c]));
    }
    os << '\n';
  }
  os << "units: " << units.size() << ", total numel: " << total_numel()
     << ", tied params: " << tied.size();
  if (!empty_units.empty()) os << ", empty units dropped: " << empty_units.size();
  os << '\n';
  for (const auto& [first, others] : tied) {
    os << "tied: " << first;
    for (const auto& o : others) os << " = " << o;
    os << '\n';
  }
  return os.str();
}

}  // namespace flatshard
