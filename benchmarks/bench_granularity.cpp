// flatshard/benchmarks/bench_granularity.cpp — see bench_granularity.h for the contract.
#include "benchmarks/bench_granularity.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>

#include "benchmarks/bench_options.h"
#include "fsdp/resolve.h"
#include "cli/named_plans.h"
#include "support/input_file.h"
#include "wrap_policies/spec.h"

namespace flatshard {
namespace bench {

namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

Policy parse_spec(const std::string& label, const std::string& spec) {
  try {
    return parse_policy(spec);
  } catch (const c10::Error& e) {
    // The parser's message: first line names the column and token; the caret display below it
    // does not survive a one-line error, so the spec is quoted in front instead.
    const std::string msg = e.what_without_backtrace();
    const std::string line = msg.substr(0, msg.find('\n'));
    if (spec.find_first_of("=:>") == std::string::npos)  // a word: likely a mistyped name
      throw UsageError("--policy: unknown plan '" + label +
                       "' (names: local, leaf, layer, every-K, model, noshard)" +
                       tools::named_plan_hint(label) + " and not a policy spec either: " + line);
    throw UsageError("--policy '" + label + "': " + line);
  }
}

}  // namespace

std::vector<std::string> split_granularities(const std::vector<std::string>& flags) {
  std::vector<std::string> out;
  for (const auto& flag : flags) {
    bool spec_open = false;  // the last entry is a policy spec that may continue
    size_t start = 0;
    while (start <= flag.size()) {
      size_t comma = flag.find(',', start);
      if (comma == std::string::npos) comma = flag.size();
      const std::string piece = trim(flag.substr(start, comma - start));
      if (piece.empty())
        throw UsageError("--policy '" + flag + "': empty entry at character " +
                         std::to_string(start + 1));
      if (tools::is_named_plan(piece)) {
        out.push_back(piece);
        spec_open = false;
      } else if (spec_open) {
        out.back() += "," + piece;
      } else {
        out.push_back(piece);
        spec_open = true;
      }
      start = comma + 1;
    }
  }
  return out;
}

Granularity resolve_granularity(const std::string& label, const torch::nn::Module& model,
                                const models::FamilyModules& modules) {
  Granularity g;
  g.label = label;
  if (label == "local") {
    g.local = true;
    return g;
  }
  if (label == "model") {
    g.plan = make_plan(model, g.policy);  // no rules: the root owns everything
    return g;
  }
  std::optional<std::string> named;
  try {
    named = tools::named_plan_spec(label, "type=" + modules.layer_type,
                                   "type=" + modules.leaf_types);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--policy ") + e.what());
  }
  g.policy = parse_spec(label, named ? *named : label);
  try {
    g.plan = make_plan(model, g.policy);
    // A recompute rule that matches only the root is an error, as in fully_shard(policy).
    check_recompute_policy(g.policy, model, g.plan);
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    throw UsageError("--policy '" + label + "': " + msg.substr(0, msg.find('\n')));
  }
  // A rule that matches nothing is a typo; a spec without rules ('none', what the advisor
  // prints for the one-unit plan, or root options alone) asks for the root alone, as 'model'.
  // The text fully_shard fails with (Plan::unmatched_warning: the model's types and paths).
  if (const std::string unmatched = g.plan.unmatched_warning(); !unmatched.empty())
    throw UsageError("--policy '" + printable_escape(label) + "': " + unmatched);
  return g;
}

Granularity with_recompute(Granularity g) {
  if (g.local || g.plan.units.size() < 2) return g;
  for (UnitSpec& u : g.plan.units)
    if (!u.is_root) u.options.recompute = true;
  try {
    check_recompute_plan(g.plan);  // fully_shard's check, as a usage error before any run
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    throw UsageError("--recompute with --policy '" + g.label + "': " +
                     msg.substr(0, msg.find('\n')));
  }
  g.label += "+recompute";
  return g;
}

Granularity with_offload(Granularity g, int level, OffloadStep step) {
  if (g.local || level == 0) return g;
  for (UnitSpec& u : g.plan.units) u.options.offload = level;
  g.label += "+offload" + std::to_string(level) +
             (step == OffloadStep::kBackward  ? "+bwdstep"
              : step == OffloadStep::kDelayed ? "+delayed"
                                              : "");
  return g;
}

int offload_of(const Granularity& g) {
  int level = 0;
  for (const UnitSpec& u : g.plan.units) level = std::max(level, u.options.offload.value_or(0));
  return level;
}

}  // namespace bench
}  // namespace flatshard
