// flatshard/wrap_policies/match.cpp — PolicyMatcher (see match.h).
#include "wrap_policies/match.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>

namespace flatshard {

namespace {

bool literal_glob(const std::string& g) { return g.find_first_of("*?[") == std::string::npos; }

void append(std::vector<int>& out, const std::unordered_map<std::string, std::vector<int>>& index,
            const std::string& key) {
  auto it = index.find(key);
  if (it != index.end()) out.insert(out.end(), it->second.begin(), it->second.end());
}

}  // namespace

std::vector<std::string> type_accepted_names(const std::string& module_name) {
  // type_name_matches(N, t): N == t or N ends with "::" + t, or either with t + "Impl".
  std::vector<std::string> out;
  auto add = [&](const std::string& s) {
    if (s.empty()) return;
    out.push_back(s);
    const std::string impl = "Impl";
    if (s.size() > impl.size() && s.compare(s.size() - impl.size(), impl.size(), impl) == 0)
      out.push_back(s.substr(0, s.size() - impl.size()));
  };
  add(module_name);
  for (size_t p = 2; p <= module_name.size(); ++p)
    if (module_name[p - 2] == ':' && module_name[p - 1] == ':') add(module_name.substr(p));
  return out;
}

MatchSubject match_subject(const torch::nn::Module& root, const std::string& path,
                           const torch::nn::Module& module) {
  MatchSubject s;
  s.path = path;
  s.module = &module;
  if (const auto* aliases = dynamic_cast<const ModuleAliases*>(&root))
    s.alias = aliases->module_alias(path, module);
  return s;
}

PolicyMatcher::PolicyMatcher(const Policy& policy) {
  validate(policy);
  for (size_t r = 0; r < policy.rules.size(); ++r) {
    const Rule& rule = policy.rules[r];
    CompiledRule c{&rule, {}};
    const Term* indexed = nullptr;
    for (const Term& t : rule.terms) {
      c.globs.emplace_back();
      if (t.kind == Term::Kind::kPath)
        for (const auto& g : t.names) c.globs.back().emplace_back(g);
      needs_size_ = needs_size_ || t.kind == Term::Kind::kSize;
      if (indexed == nullptr && t.kind == Term::Kind::kType) indexed = &t;
    }
    if (indexed == nullptr)
      for (const Term& t : rule.terms)
        if (indexed == nullptr && t.kind == Term::Kind::kPath &&
            std::all_of(t.names.begin(), t.names.end(), literal_glob))
          indexed = &t;
    const int index = static_cast<int>(r);
    if (indexed == nullptr) {
      scanned_.push_back(index);
    } else {
      auto& map = indexed->kind == Term::Kind::kType ? by_type_ : by_path_;
      for (const auto& name : indexed->names) {
        auto& rules = map[name];
        if (rules.empty() || rules.back() != index) rules.push_back(index);
      }
    }
    rules_.push_back(std::move(c));
  }
}

bool PolicyMatcher::term_matches(const Term& t, const std::vector<Glob>& globs,
                                 const MatchSubject& s) const {
  switch (t.kind) {
    case Term::Kind::kType: {
      const std::string& name = s.module->name();
      return std::any_of(t.names.begin(), t.names.end(), [&](const std::string& type) {
        return type_name_matches(name, type) ||
               (!s.alias.type.empty() && type_name_matches(s.alias.type, type));
      });
    }
    case Term::Kind::kSize:
      return s.free_numel >= t.min_numel;
    case Term::Kind::kPath:
      return std::any_of(globs.begin(), globs.end(), [&](const Glob& g) {
        return g.matches(s.path) || (s.alias.path && g.matches(*s.alias.path));
      });
    case Term::Kind::kPredicate:
      return t.predicate(s.path, *s.module);
  }
  return false;
}

bool PolicyMatcher::rule_matches(size_t r, const MatchSubject& s) const {
  const CompiledRule& c = rules_.at(r);
  for (size_t t = 0; t < c.rule->terms.size(); ++t)
    if (!term_matches(c.rule->terms[t], c.globs[t], s)) return false;
  return true;
}

std::vector<int> PolicyMatcher::candidates(const MatchSubject& s, int first) const {
  std::vector<int> out;
  if (!by_type_.empty()) {
    for (const auto& n : type_accepted_names(s.module->name())) append(out, by_type_, n);
    if (!s.alias.type.empty())
      for (const auto& n : type_accepted_names(s.alias.type)) append(out, by_type_, n);
  }
  if (!by_path_.empty()) {
    append(out, by_path_, s.path);
    if (s.alias.path) append(out, by_path_, *s.alias.path);
  }
  out.insert(out.end(), scanned_.begin(), scanned_.end());
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  out.erase(out.begin(), std::upper_bound(out.begin(), out.end(), first));
  return out;
}

int PolicyMatcher::first_match(const MatchSubject& s) const {
  for (int r : candidates(s))
    if (rule_matches(static_cast<size_t>(r), s)) return r;
  return -1;
}

}  // namespace flatshard
