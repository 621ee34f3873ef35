// flatshard/wrap_policies/policy.h — which modules of a model become units, and make_plan().
//
// A Policy is plain data: an ordered list of Rules (any-of; the FIRST rule that matches a module
// wins) plus options for the root unit. A Rule is a list of Terms that must all match (AND), an
// optional every-k grouping, and the UnitOptions given to the units it creates.
//
//   Policy p = any_of({with_options(by_path("lm_head"), no_shard()),
//                      every(2, by_type("Block"))});
//   Plan plan = make_plan(*model, p);     // pure: reads the module tree, runs nothing
//
// Terms (what a module must satisfy):
//   by_type(names)  module.name() is NAME, ends with "::NAME", or either with the LibTorch "Impl"
//                   suffix. LibTorch's name() is the demangled Impl class: torch::nn::Linear's is
//                   "torch::nn::LinearImpl", a user TORCH_MODULE(Block) in namespace gpt gives
//                   "gpt::BlockImpl". So "Linear", "nn::Linear", "torch::nn::LinearImpl" all
//                   match it. Several names: any of them.
//   by_size(min)    the numel of the module's parameters not already claimed by units matched
//                   inside it is >= min (FSDP's size_based_auto_wrap_policy). Decided bottom-up:
//                   children are matched before their parent, so a parent only counts what its
//                   matched descendants left over. Each distinct tensor counts once.
//   by_path(globs)  the module's dotted path ("blocks.3.mlp") matches one of the globs; the
//                   syntax is in glob.h (notably '*' also matches across dots).
//   by_predicate(f) f(path, module) returns true. Called at most once per module and rule, children
//                   before parents, and only when the rule's earlier terms held.
// A rule built by every(k, rule) groups, per parent module, the modules the rule matched, in
// registration order, k at a time into ONE unit (the last group may be smaller). Siblings the
// rule did not match are skipped, not run-breakers. A group's name is "<parent>.<first>-<last>"
// ("blocks.0-1"), its module_paths lists every member.
//
// Matching (wrap_policies/match.h: the one place terms are tested) also accepts a model's
// Hugging Face names where its root declares them (Note [Module aliases]): `type=LlamaDecoderLayer`
// and `path=model.layers.[0-9]` match flatshard's LLaMA's DecoderLayer at layers.N.
//
// Plan semantics (make_plan):
//  - The root module is never matched. Parameters no unit claims belong to the root unit
//    (units[0], is_root, name "<root>", no module_paths), which gets Policy::root_options.
//  - Units may nest (a matched module inside another): each owns only the parameters not owned
//    by a unit inside it.
//  - Tied parameters (one TensorImpl under several names) are owned by the innermost unit whose
//    subtree holds all their names (the root unit if none); Plan::tied records them and the
//    owner's param_names lists only the first name. No TensorImpl is ever in two units.
//  - A module object registered under several paths is one module: only its first path can be
//    matched, and its parameters belong where that path puts them (flatshard::call finds units by
//    module identity, so every path runs the same unit). The other names still appear in tied.
//  - Units are ordered by the registration (pre-)order of their first module, root first. Units
//    that end up owning no parameter are dropped (Plan::empty_units lists them).
//  - Plan::matched_modules counts the modules the policy matched; 0 = "matches nothing"
//    (Plan::unmatched_warning). A rule that matches nothing only because earlier rules claim
//    its modules is a Plan::warnings entry naming both rules (Note [Shadowed rules]).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "wrap_policies/plan.h"

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace flatshard {

using ModulePredicate = std::function<bool(const std::string& path, const torch::nn::Module&)>;

struct Term {
  enum class Kind { kType, kSize, kPath, kPredicate };
  Kind kind = Kind::kType;
  std::vector<std::string> names;  // kType: type names; kPath: globs (any of them matches)
  int64_t min_numel = 0;           // kSize
  ModulePredicate predicate;       // kPredicate
  std::string label;               // kPredicate: how to_spec() shows it
};

struct Rule {
  std::vector<Term> terms;  // all must match; never empty
  int64_t every = 1;        // >= 1; k > 1 groups k sibling matches into one unit
  UnitOptions options;      // given to every unit this rule creates
};

struct Policy {
  std::vector<Rule> rules;   // any-of; the first matching rule wins for a module
  UnitOptions root_options;  // options of the root unit

  // Text form in the grammar of spec.h. parse_policy(to_spec()) gives back an equal policy
  // unless a rule has a predicate term (printed as "<predicate LABEL>") or options no prefix
  // stands for (printed as "<options ...>"); both are deliberately unparseable.
  std::string to_spec() const;
  Policy& set_root_options(UnitOptions o) {
    root_options = o;
    return *this;
  }
};

// --- builders: each returns a one-term Rule ---------------------------------------------------
Rule by_type(std::vector<std::string> type_names);
Rule by_type(const std::string& type_name);
Rule by_size(int64_t min_numel);
Rule by_path(std::vector<std::string> globs);  // throws c10::Error on a malformed glob
Rule by_path(const std::string& glob);
Rule by_predicate(ModulePredicate predicate, std::string label = "predicate");
// AND of the rules' terms. At most one of them may group (every > 1); options must agree or be
// set on one only.
Rule all_of(std::vector<Rule> rules);
// Groups `rule`'s matches k at a time (k >= 1).
Rule every(int64_t k, Rule rule);
Rule with_options(Rule rule, UnitOptions options);
// OR of rules, first match wins.
Policy any_of(std::vector<Rule> rules);
Policy single(Rule rule);

// The option sets the text prefixes stand for.
UnitOptions no_shard();        // "noshard:"  NO_SHARD
UnitOptions shard_grad_op();   // "grad_op:"  SHARD_GRAD_OP
UnitOptions full_shard();      // "full:"     FULL_SHARD
UnitOptions full_shard_keep(); // "keep:"     FULL_SHARD, no reshard after forward
// `base` with activation checkpointing on: recompute() is "recompute:", recompute(full_shard_keep())
// is "keep+recompute:" (Note [Recompute], fsdp/recompute.h).
UnitOptions recompute(UnitOptions base = {});
// `base` with CPU offload at `level` (0, 1 or 2): offload() is "offload:", offload(keep, 2) is
// "keep+offload2:" (Note [CPU offload], flat_param/offload.h). Throws for another level.
UnitOptions offload(UnitOptions base = {}, int level = 1);

// True when module.name() denotes `type_name` (see by_type).
bool type_name_matches(const std::string& module_name, const std::string& type_name);

// module.name() as a policy writes the type, and as every tool prints a unit's kind:
// "torch::nn::LinearImpl" -> "Linear", "flatshard::gpt::BlockImpl" -> "Block" (the last
// component without LibTorch's "Impl"; type_name_matches() accepts it back). Names without
// "::" or "Impl" ("<root>", "Norm") are returned unchanged.
std::string policy_type_name(const std::string& module_name);

// The text form of one rule, as Policy::to_spec() writes it ("recompute:type=Block").
std::string to_spec(const Rule& rule);

// The most terms plus type names and path globs a policy may hold in all (validate() refuses
// more): far above any hand-written or generated per-module policy (a 10,000-layer model's
// one glob per layer), and a bound on what matching and the plan's messages keep.
inline constexpr int64_t kMaxPolicyNames = 100000;

// Throws c10::Error for a malformed policy (empty rule, every < 1, size < 0, bad glob, more
// than kMaxPolicyNames terms and names, ...).
void validate(const Policy& policy);

// Pure: reads the module tree and parameter identities; never changes or runs the model.
Plan make_plan(const torch::nn::Module& model, const Policy& policy);

}  // namespace flatshard
