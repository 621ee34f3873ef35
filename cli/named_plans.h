// flatshard/cli/named_plans.h — the named plans flatshard-bench and flatshard-explain accept
// wherever a policy is (--policy; docs/vocabulary.md), as wrap-policy specs of a model's family.
//
//   local     no plan: flatshard-bench's unsharded floor (explain has nothing to explain)
//   leaf      type=<leaf types>            every module that owns parameters directly
//   layer     type=<layer type>            one unit per transformer layer
//   every-K   every=K,type=<layer type>    K consecutive layers per unit (K >= 1)
//   model     none                         the root alone: one unit, deliberately
//   noshard   noshard:type=<layer type>;root:noshard   per-layer units and the root, NO_SHARD
//
// Header-only, part of the options both tools share (cli/, docs/design.md).
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/exit.h"

namespace flatshard {
namespace tools {

// "local", "leaf", "layer", "model", "noshard" or anything starting "every-" (a bad K is an
// error of named_plan_spec, not a policy spec).
inline bool is_named_plan(const std::string& s) {
  return s == "local" || s == "leaf" || s == "layer" || s == "model" || s == "noshard" ||
         s.rfind("every-", 0) == 0;
}

// The names as a help or error text lists them, and as "did you mean" compares with.
inline const std::vector<std::string>& named_plan_names() {
  static const std::vector<std::string> names = {"local", "leaf",  "layer",
                                                 "every-2", "model", "noshard"};
  return names;
}

// "every-K" -> K; throws std::invalid_argument unless K is a positive decimal below 1e9.
inline long every_k_of(const std::string& name) {
  const std::string digits = name.substr(6);
  const bool ok = !digits.empty() && digits.size() <= 9 &&
                  digits.find_first_not_of("0123456789") == std::string::npos &&
                  std::stol(digits) >= 1;
  if (!ok)
    throw std::invalid_argument("'" + name +
                                "': expected every-K with K a positive integer, e.g. every-2");
  return std::stol(digits);
}

// The spec of named plan `name` for a family whose one-layer rule is `layer_rule` (e.g.
// "type=Block") and whose leaf rule is `leaf_rule` ("type=Linear|LayerNorm|Embedding");
// nullopt when `name` is not a named plan, "" for local (no plan). Throws std::invalid_argument
// for a bad every-K, or a name the model cannot express (an empty rule: no layer type known).
inline std::optional<std::string> named_plan_spec(const std::string& name,
                                                  const std::string& layer_rule,
                                                  const std::string& leaf_rule) {
  if (!is_named_plan(name)) return std::nullopt;
  if (name == "local") return std::string();
  if (name == "model") return std::string("none");
  const std::string& rule = name == "leaf" ? leaf_rule : layer_rule;
  if (rule.empty())
    throw std::invalid_argument("'" + name + "' needs the model's " +
                                (name == "leaf" ? "leaf" : "layer") +
                                " types, which are not known here: give a spec instead");
  if (name == "leaf" || name == "layer") return rule;
  if (name == "noshard") return "noshard:" + rule + ";root:noshard";
  return "every=" + std::to_string(every_k_of(name)) + "," + rule;
}

// " (did you mean 'leaf'?)" for a word close to a named plan ("leef"), else "".
inline std::string named_plan_hint(const std::string& word) {
  const std::string near = closest_name(word, named_plan_names());
  return near.empty() ? "" : " (did you mean '" + near + "'?)";
}

}  // namespace tools
}  // namespace flatshard
