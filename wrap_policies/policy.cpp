// flatshard/wrap_policies/policy.cpp — policy builders, validation and to_spec() (policy.h).
// make_plan() lives in make_plan.cpp.
#include "wrap_policies/policy.h"

#include <c10/util/Exception.h>

#include "wrap_policies/glob.h"

namespace flatshard {

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

Rule one_term(Term t) {
  Rule r;
  r.terms.push_back(std::move(t));
  return r;
}

// "10M" rather than "10000000" when exact: to_spec() output is read by people.
std::string count_text(int64_t n) {
  static const std::pair<int64_t, const char*> kUnits[] = {
      {1000000000, "G"}, {1000000, "M"}, {1000, "k"}};
  for (const auto& [unit, suffix] : kUnits)
    if (n != 0 && n % unit == 0) return std::to_string(n / unit) + suffix;
  return std::to_string(n);
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? sep : "") + v[i];
  return s;
}

// The spec prefix for `o`, "" for no options: a strategy word, "recompute", or both joined by
// '+' ("keep+recompute"). Combinations no prefix stands for print as an explicit (unparseable)
// note rather than silently as something else.
std::string prefix_text(const UnitOptions& o) {
  UnitOptions base = o;
  base.recompute.reset();
  base.offload.reset();
  base.gather_dtype.reset();
  std::string s;
  if (base == no_shard()) s = "noshard";
  if (base == shard_grad_op()) s = "grad_op";
  if (base == full_shard()) s = "full";
  if (base == full_shard_keep()) s = "keep";
  const bool known = base == UnitOptions{} || !s.empty();
  if (known && o.recompute != false) {  // unset or true
    if (o.recompute) s += s.empty() ? "recompute" : "+recompute";
    if (o.offload) {
      const std::string word = *o.offload == 1 ? "offload" : "offload" + std::to_string(*o.offload);
      s += s.empty() ? word : "+" + word;
    }
    if (o.gather_dtype) {
      const std::string word = std::string("gather_") + gather_dtype_name(*o.gather_dtype);
      s += s.empty() ? word : "+" + word;
    }
    return s;
  }
  s = "<options strategy=";
  s += o.strategy ? to_string(*o.strategy) : "default";
  s += " reshard_after_forward=";
  s += o.reshard_after_forward ? (*o.reshard_after_forward ? "true" : "false") : "default";
  if (o.recompute) s += *o.recompute ? " recompute=true" : " recompute=false";
  if (o.offload) s += " offload=" + std::to_string(*o.offload);
  if (o.gather_dtype) s += std::string(" gather=") + gather_dtype_name(*o.gather_dtype);
  return s + ">";
}

std::string term_text(const Term& t) {
  switch (t.kind) {
    case Term::Kind::kType:
      return "type=" + join(t.names, "|");
    case Term::Kind::kSize:
      return "size>=" + count_text(t.min_numel);
    case Term::Kind::kPath:
      return "path=" + join(t.names, "|");
    case Term::Kind::kPredicate:
      return "<predicate " + t.label + ">";
  }
  return "?";
}

UnitOptions with_strategy(ShardingStrategy s, std::optional<bool> reshard_after_forward) {
  UnitOptions o;
  o.strategy = s;
  o.reshard_after_forward = reshard_after_forward;
  return o;
}

}  // namespace

UnitOptions no_shard() { return with_strategy(ShardingStrategy::kNoShard, std::nullopt); }
UnitOptions shard_grad_op() { return with_strategy(ShardingStrategy::kShardGradOp, std::nullopt); }
UnitOptions full_shard() { return with_strategy(ShardingStrategy::kFullShard, std::nullopt); }
UnitOptions full_shard_keep() { return with_strategy(ShardingStrategy::kFullShard, false); }
UnitOptions recompute(UnitOptions base) {
  base.recompute = true;
  return base;
}
UnitOptions offload(UnitOptions base, int level) {
  TORCH_CHECK(level >= 0 && level <= 2, "offload level must be 0, 1 or 2, got ", level);
  base.offload = level;
  return base;
}

bool type_name_matches(const std::string& module_name, const std::string& type_name) {
  if (type_name.empty()) return false;
  for (const std::string& t : {type_name, type_name + "Impl"})
    if (module_name == t || ends_with(module_name, "::" + t)) return true;
  return false;
}

std::string policy_type_name(const std::string& module_name) {
  const size_t colon = module_name.rfind("::");
  std::string last = colon == std::string::npos ? module_name : module_name.substr(colon + 2);
  if (last.size() > 4 && ends_with(last, "Impl")) last.resize(last.size() - 4);
  return last.empty() ? module_name : last;
}

Rule by_type(std::vector<std::string> type_names) {
  Term t;
  t.kind = Term::Kind::kType;
  t.names = std::move(type_names);
  return one_term(std::move(t));
}
Rule by_type(const std::string& type_name) { return by_type(std::vector<std::string>{type_name}); }

Rule by_size(int64_t min_numel) {
  Term t;
  t.kind = Term::Kind::kSize;
  t.min_numel = min_numel;
  return one_term(std::move(t));
}

Rule by_path(std::vector<std::string> globs) {
  for (const auto& g : globs) Glob{g};  // validates now, where the caller can see it
  Term t;
  t.kind = Term::Kind::kPath;
  t.names = std::move(globs);
  return one_term(std::move(t));
}
Rule by_path(const std::string& glob) { return by_path(std::vector<std::string>{glob}); }

Rule by_predicate(ModulePredicate predicate, std::string label) {
  Term t;
  t.kind = Term::Kind::kPredicate;
  t.predicate = std::move(predicate);
  t.label = std::move(label);
  return one_term(std::move(t));
}

Rule all_of(std::vector<Rule> rules) {
  Rule out;
  bool have_options = false;
  for (auto& r : rules) {
    if (r.every != 1) {
      TORCH_CHECK(out.every == 1, "all_of: two rules group (every=", out.every, " and every=",
                  r.every, "); at most one may");
      out.every = r.every;
    }
    if (r.options != UnitOptions{}) {
      TORCH_CHECK(!have_options || r.options == out.options,
                  "all_of: rules carry different unit options");
      out.options = r.options;
      have_options = true;
    }
    for (auto& t : r.terms) out.terms.push_back(std::move(t));
  }
  return out;
}

Rule every(int64_t k, Rule rule) {
  TORCH_CHECK(k >= 1, "every(k): k must be >= 1, got ", k);
  rule.every = k;
  return rule;
}

Rule with_options(Rule rule, UnitOptions options) {
  rule.options = options;
  return rule;
}

Policy any_of(std::vector<Rule> rules) {
  Policy p;
  p.rules = std::move(rules);
  return p;
}

Policy single(Rule rule) { return any_of({std::move(rule)}); }

void validate(const Policy& policy) {
  int64_t names = 0;
  for (const Rule& r : policy.rules)
    for (const Term& t : r.terms) names += 1 + static_cast<int64_t>(t.names.size());
  TORCH_CHECK(names <= kMaxPolicyNames, "policy: ", policy.rules.size(), " rules with ", names,
              " terms and names in all, more than the limit of ", kMaxPolicyNames,
              " (wrap_policies/policy.h: kMaxPolicyNames); match many modules with one glob "
              "(path=blocks.*) or a type (type=Block) instead of one term per module");
  for (size_t i = 0; i < policy.rules.size(); ++i) {
    const Rule& r = policy.rules[i];
    TORCH_CHECK(!r.terms.empty(), "policy rule ", i,
                ": no terms (a rule must say what it matches)");
    TORCH_CHECK(r.every >= 1, "policy rule ", i, ": every must be >= 1, got ", r.every);
    for (const Term& t : r.terms) {
      switch (t.kind) {
        case Term::Kind::kType:
        case Term::Kind::kPath:
          TORCH_CHECK(!t.names.empty(), "policy rule ", i, ": ", term_text(t), " lists no names");
          for (const auto& n : t.names) {
            TORCH_CHECK(!n.empty(), "policy rule ", i, ": empty name in ", term_text(t));
            if (t.kind == Term::Kind::kPath) Glob{n};
          }
          break;
        case Term::Kind::kSize:
          TORCH_CHECK(t.min_numel >= 0, "policy rule ", i, ": size must be >= 0, got ",
                      t.min_numel);
          break;
        case Term::Kind::kPredicate:
          TORCH_CHECK(static_cast<bool>(t.predicate), "policy rule ", i, ": empty predicate '",
                      t.label, "'");
          break;
      }
    }
  }
}

std::string to_spec(const Rule& r) {
  std::vector<std::string> terms;
  if (r.every != 1) terms.push_back("every=" + std::to_string(r.every));
  for (const Term& t : r.terms) terms.push_back(term_text(t));
  const std::string prefix = prefix_text(r.options);
  return (prefix.empty() ? "" : prefix + ":") + join(terms, ",");
}

std::string Policy::to_spec() const {
  std::vector<std::string> rule_texts;
  for (const Rule& r : rules) rule_texts.push_back(flatshard::to_spec(r));
  if (root_options != UnitOptions{}) rule_texts.push_back("root:" + prefix_text(root_options));
  return rule_texts.empty() ? "none" : join(rule_texts, ";");
}

}  // namespace flatshard
