// flatshard/wrap_policies/match.h — the one place a policy's terms are tested against a module.
//
// make_plan (every module of a tree, wrap_policies/make_plan.cpp) and check_recompute_policy
// (the root module, fsdp/resolve.h) both ask a PolicyMatcher, so a term means the same thing
// wherever it is read. The meaning of each term is in policy.h; this header adds how a module is
// presented to the terms (MatchSubject) and the other names a model may answer to.
//
//   PolicyMatcher m(policy);                                   // validates, compiles once
//   MatchSubject s = match_subject(root, "blocks.3", *module);  // its own and its alias names
//   int rule = m.first_match(s);                               // -1: no rule matches
//
// Note [Module aliases]
// A model may be known under a second set of names: flatshard's LLaMA family is what a Hugging
// Face directory loads into (models/hf.h), and flatshard-explain --weights, the checkpoint and
// transformers name its modules the Hugging Face way (model.layers.3, LlamaDecoderLayer) where
// the C++ tree says layers.3 / DecoderLayer. The root module of such a model implements
// ModuleAliases; a type term then holds on a module when its own type or its alias type
// matches, a path glob when its own path or its alias path matches, so a policy written for the
// checkpoint works unchanged on the model. Predicates see the module's own path only, and units
// are named by the modules' own paths. Only the root's ModuleAliases is read (a model nested in
// another keeps its own names only). models/ implements it; nothing here knows a family.
//
// Cost: the first matching rule is found by looking the subject's type names and (literal) paths
// up in an index of the rules' first type or path term, then scanning only the rules no index
// covers (globs with wildcards, size and predicate terms): a policy of n type or path names
// costs O(modules + n) to match, not O(modules * n). validate() bounds the number of terms and
// names (kMaxPolicyNames).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "wrap_policies/glob.h"
#include "wrap_policies/policy.h"

namespace flatshard {

// Implemented by a model's root module whose modules have a second set of names (Note [Module
// aliases]).
class ModuleAliases {
 public:
  virtual ~ModuleAliases() = default;
  struct Alias {
    std::optional<std::string> path;  // the module's other dotted path; "" is the root's
    std::string type;                 // its other type name as a policy writes it; "" for none
  };
  // `path`: the module's path in this root's tree ("" for the root itself). Must not throw for
  // any module of the tree; a module without another name gets {} (no alias).
  virtual Alias module_alias(const std::string& path, const torch::nn::Module& module) const = 0;
};

// One module as the terms see it.
struct MatchSubject {
  std::string path;  // dotted path from the root; "" for the root
  const torch::nn::Module* module = nullptr;
  ModuleAliases::Alias alias;  // Note [Module aliases]; {} when the root declares none
  int64_t free_numel = 0;      // what a size term compares (policy.h: by_size)
};

// `module` at `path` of `root`'s tree, with its alias when `root` implements ModuleAliases.
// free_numel is left 0 (make_plan fills it in).
MatchSubject match_subject(const torch::nn::Module& root, const std::string& path,
                           const torch::nn::Module& module);

class PolicyMatcher {
 public:
  // Validates `policy` (validate(), policy.h) and compiles it: globs once, and the index of the
  // rules by their first type or literal path term. Keeps a reference: `policy` must outlive
  // the matcher.
  explicit PolicyMatcher(const Policy& policy);

  size_t num_rules() const { return rules_.size(); }
  // Some term compares sizes: the caller must fill MatchSubject::free_numel.
  bool needs_size() const { return needs_size_; }
  // All terms of rule `r` hold on `s`.
  bool rule_matches(size_t r, const MatchSubject& s) const;
  // The index of the first rule whose terms all hold on `s`; -1 if none.
  int first_match(const MatchSubject& s) const;
  // The rules in (first, end) that might match `s` (a superset of those that do), ascending:
  // what first_match tries. `first` = -1 for all of them.
  std::vector<int> candidates(const MatchSubject& s, int first = -1) const;

 private:
  struct CompiledRule {
    const Rule* rule;
    std::vector<std::vector<Glob>> globs;  // per term; empty for non-path terms
  };
  bool term_matches(const Term& t, const std::vector<Glob>& globs, const MatchSubject& s) const;

  std::vector<CompiledRule> rules_;
  bool needs_size_ = false;
  // First type term's names (as a module name's accepted spellings, type_accepted_names) and
  // first literal path term's paths -> the rules, ascending.
  std::unordered_map<std::string, std::vector<int>> by_type_;
  std::unordered_map<std::string, std::vector<int>> by_path_;
  std::vector<int> scanned_;  // rules no index covers, ascending
};

// Every type name `type_name_matches(module_name, t)` accepts (policy.h: by_type), e.g.
// "flatshard::gpt::BlockImpl" -> itself, "gpt::BlockImpl", "BlockImpl", "flatshard::gpt::Block",
// "gpt::Block", "Block".
std::vector<std::string> type_accepted_names(const std::string& module_name);

}  // namespace flatshard
