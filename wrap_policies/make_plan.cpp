// flatshard/wrap_policies/make_plan.cpp — Policy + module tree → Plan (semantics in policy.h).
//
// Four passes over a flat pre-order copy of the tree:
//   1. walk     every (path, module) with its own parameters; a module object seen before is
//               marked `duplicate` (its parameters are aliases, it cannot be matched)
//   2. match    reverse pre-order (children before parents) so size terms see what matched
//               descendants left unclaimed; the first rule whose terms all hold wins
//               (wrap_policies/match.h); then Note [Shadowed rules]
//   3. group    per parent, each every-k rule's matches k at a time; units sorted by first member
//   4. own      each TensorImpl goes to the innermost unit enclosing all its (non-alias) names
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "support/input_file.h"
#include "wrap_policies/match.h"
#include "wrap_policies/policy.h"

namespace flatshard {

namespace {

struct ParamRef {
  std::string name;  // fully qualified, e.g. "blocks.0.fc1.weight"
  const c10::TensorImpl* impl;
  int64_t numel;
};

struct Node {
  std::string path;        // "" for the root
  std::string child_name;  // last path segment
  const torch::nn::Module* module = nullptr;
  int parent = -1;
  std::vector<int> children;
  bool duplicate = false;  // the module object already appeared at an earlier path
  std::vector<ParamRef> params;
};

class Walker {
 public:
  std::vector<Node> nodes;

  void walk(const torch::nn::Module& m, const std::string& path, const std::string& child_name,
            int parent) {
    // A module on the path to here was seen before: the path is scanned only for modules
    // seen before (duplicates are rare), not kept as a second set (issue 49: two hash sets were
    // ~4% of planning 655,000 modules).
    const bool duplicate = !seen_.insert(&m).second;
    TORCH_CHECK(!duplicate || std::find(on_path_.begin(), on_path_.end(), &m) == on_path_.end(),
                "make_plan: module '", path, "' (", m.name(),
                ") contains itself: the module graph has a cycle");
    const int index = static_cast<int>(nodes.size());
    Node node;
    node.path = path;
    node.child_name = child_name;
    node.module = &m;
    node.parent = parent;
    node.duplicate = duplicate;
    // named_parameters(false) skips undefined slots (e.g. Linear's bias when bias=false).
    for (const auto& kv : m.named_parameters(/*recurse=*/false)) {
      const at::Tensor& t = kv.value();
      if (!t.defined()) continue;
      node.params.push_back({join(path, kv.key()), t.unsafeGetTensorImpl(), t.numel()});
    }
    nodes.push_back(std::move(node));
    if (parent >= 0) nodes[parent].children.push_back(index);

    on_path_.push_back(&m);
    // named_children() rather than named_modules(): the latter needs the root in a shared_ptr.
    for (const auto& kv : m.named_children())
      walk(*kv.value(), join(path, kv.key()), kv.key(), index);
    on_path_.pop_back();
  }

 private:
  static std::string join(const std::string& prefix, const std::string& name) {
    return prefix.empty() ? name : prefix + "." + name;
  }
  std::unordered_set<const torch::nn::Module*> seen_;
  std::vector<const torch::nn::Module*> on_path_;  // cycle guard: the modules above this one
};

// Pass 2. Returns the index of the matching rule per node (-1: none); `free_numel` gets each
// node's unclaimed numel (what a size term compared), for the shadowed-rule check.
std::vector<int> match(const std::vector<Node>& nodes, const PolicyMatcher& matcher,
                       const torch::nn::Module& root, std::vector<int64_t>* free_numel_of) {
  const int n = static_cast<int>(nodes.size());
  std::vector<int> matched(n, -1);
  const bool needs_size = matcher.needs_size();
  free_numel_of->assign(n, 0);

  // free[i]: distinct tensors under node i that no matched descendant claimed. A child's set is
  // moved into its parent once consumed, so memory stays O(params * depth) at worst.
  std::vector<std::vector<ParamRef>> free(needs_size ? n : 0);
  for (int i = n - 1; i >= 1; --i) {  // the root (0) is never matched
    const Node& node = nodes[i];
    int64_t free_numel = 0;
    if (needs_size && !node.duplicate) {
      std::unordered_set<const c10::TensorImpl*> in_set;
      auto add = [&](const ParamRef& p) {
        if (in_set.insert(p.impl).second) {
          free[i].push_back(p);
          free_numel += p.numel;
        }
      };
      for (const auto& p : node.params) add(p);
      for (int c : node.children) {
        if (matched[c] < 0)
          for (const auto& p : free[c]) add(p);
        free[c].clear();
        free[c].shrink_to_fit();
      }
    }
    if (node.duplicate) continue;
    (*free_numel_of)[i] = free_numel;
    MatchSubject s = match_subject(root, node.path, *node.module);
    s.free_numel = free_numel;
    matched[i] = matcher.first_match(s);
  }
  return matched;
}

// Note [Shadowed rules]: a rule that matches no module although its terms hold on modules an
// earlier rule claimed (`type=X;recompute:type=X`: the first rule that matches wins, so the
// recompute never happens). One warning per such rule, naming both rules and a module. Tried
// children before parents, as pass 2 (a predicate sees the same order), and only on claimed
// modules against the rules that matched nothing.
std::vector<std::string> shadowed_rule_warnings(const std::vector<Node>& nodes,
                                                const std::vector<int>& matched,
                                                const std::vector<int64_t>& free_numel,
                                                const PolicyMatcher& matcher,
                                                const torch::nn::Module& root,
                                                const Policy& policy) {
  std::vector<char> unmatched(policy.rules.size(), 1);
  for (int r : matched)
    if (r >= 0) unmatched[static_cast<size_t>(r)] = 0;
  if (std::none_of(unmatched.begin(), unmatched.end(), [](char u) { return u != 0; })) return {};
  std::vector<int> shadowed_by(policy.rules.size(), -1), shadowed_at(policy.rules.size(), -1);
  for (int i = static_cast<int>(nodes.size()) - 1; i >= 1; --i) {
    if (matched[i] < 0) continue;
    MatchSubject s = match_subject(root, nodes[i].path, *nodes[i].module);
    s.free_numel = free_numel[i];
    for (int r : matcher.candidates(s, matched[i])) {
      if (!unmatched[r] || shadowed_by[r] >= 0) continue;
      if (matcher.rule_matches(static_cast<size_t>(r), s)) {
        shadowed_by[r] = matched[i];
        shadowed_at[r] = i;
      }
    }
  }
  std::vector<std::string> out;
  for (size_t r = 0; r < policy.rules.size(); ++r) {
    if (shadowed_by[r] < 0) continue;
    const Rule& first = policy.rules[static_cast<size_t>(shadowed_by[r])];
    out.push_back("policy rule " + std::to_string(r + 1) + " '" +
                  printable_escape(to_spec(policy.rules[r])) +
                  "' matches no module: its terms hold on '" +
                  printable_escape(nodes[shadowed_at[r]].path) + "', but rule " +
                  std::to_string(shadowed_by[r] + 1) + " '" + printable_escape(to_spec(first)) +
                  "' comes first and claimed it (a module goes to the first rule that matches), "
                  "so rule " + std::to_string(r + 1) +
                  "'s options never apply; put it before rule " +
                  std::to_string(shadowed_by[r] + 1) + ", or give that rule its options");
  }
  return out;
}

struct Group {
  std::vector<int> members;  // node indices, registration order
  int rule;
};

// Pass 3. Groups sorted by their first member's pre-order index.
std::vector<Group> group(const std::vector<Node>& nodes, const std::vector<int>& matched,
                         const Policy& policy) {
  std::vector<Group> groups;
  for (const Node& parent : nodes) {
    std::unordered_map<int, size_t> open;  // rule -> its group still filling under this parent
    for (int c : parent.children) {
      const int r = matched[c];
      if (r < 0) continue;
      const int64_t k = policy.rules[r].every;
      auto it = open.find(r);
      const bool room =
          it != open.end() && static_cast<int64_t>(groups[it->second].members.size()) < k;
      if (k > 1 && room) {
        groups[it->second].members.push_back(c);
        continue;
      }
      groups.push_back(Group{{c}, r});
      if (k > 1) open[r] = groups.size() - 1;
    }
  }
  std::stable_sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) {
    return a.members.front() < b.members.front();
  });
  return groups;
}

std::string group_name(const std::vector<Node>& nodes, const Group& g) {
  const Node& first = nodes[g.members.front()];
  if (g.members.size() == 1) return first.path;
  const Node& parent = nodes[first.parent];
  return (parent.path.empty() ? "" : parent.path + ".") + first.child_name + "-" +
         nodes[g.members.back()].child_name;
}

}  // namespace

Plan make_plan(const torch::nn::Module& model, const Policy& policy) {
  Walker walker;
  walker.walk(model, "", "", -1);
  const std::vector<Node>& nodes = walker.nodes;

  const PolicyMatcher matcher(policy);  // validates
  std::vector<int64_t> free_numel;
  const std::vector<int> matched = match(nodes, matcher, model, &free_numel);
  const std::vector<Group> groups = group(nodes, matched, policy);

  // Unit 0 is the root; group g is unit g + 1. unit_of[i]: innermost unit enclosing node i.
  const size_t num_units = groups.size() + 1;
  std::vector<int> unit_of(nodes.size(), 0);
  for (size_t g = 0; g < groups.size(); ++g)
    for (int m : groups[g].members) unit_of[m] = static_cast<int>(g + 1);
  for (size_t i = 1; i < nodes.size(); ++i)  // pre-order: parents are settled first
    if (matched[i] < 0) unit_of[i] = unit_of[nodes[i].parent];
  std::vector<int> unit_parent(num_units, -1), unit_depth(num_units, 0);
  for (size_t g = 0; g < groups.size(); ++g) {  // sorted by pre-order: enclosing units first
    unit_parent[g + 1] = unit_of[nodes[groups[g].members.front()].parent];
    unit_depth[g + 1] = unit_depth[unit_parent[g + 1]] + 1;
  }
  auto common_unit = [&](int a, int b) {
    while (a != b) {
      if (unit_depth[a] < unit_depth[b]) std::swap(a, b);
      a = unit_parent[a];
    }
    return a;
  };

  // Pass 4: every distinct tensor, in order of first appearance, with all its names.
  struct Param {
    const c10::TensorImpl* impl;
    int64_t numel;
    std::vector<std::string> names;
    int owner = -1;
  };
  std::vector<Param> params;
  std::unordered_map<const c10::TensorImpl*, size_t> index_of;
  for (size_t i = 0; i < nodes.size(); ++i) {
    for (const ParamRef& p : nodes[i].params) {
      auto [it, fresh] = index_of.emplace(p.impl, params.size());
      if (fresh) params.push_back(Param{p.impl, p.numel, {}, -1});
      Param& param = params[it->second];
      param.names.push_back(p.name);
      // Aliases through a duplicate module do not move ownership (see policy.h).
      if (!nodes[i].duplicate)
        param.owner = param.owner < 0 ? unit_of[i] : common_unit(param.owner, unit_of[i]);
    }
  }

  Plan plan;
  std::vector<UnitSpec> units(num_units);
  units[0].name = "<root>";
  units[0].is_root = true;
  units[0].options = policy.root_options;
  for (size_t g = 0; g < groups.size(); ++g) {
    UnitSpec& u = units[g + 1];
    u.name = group_name(nodes, groups[g]);
    for (int m : groups[g].members) u.module_paths.push_back(nodes[m].path);
    u.options = policy.rules[groups[g].rule].options;
  }
  for (const Param& p : params) {
    TORCH_INTERNAL_ASSERT(p.owner >= 0, "parameter '", p.names.front(), "' has no owner");
    units[p.owner].param_names.push_back(p.names.front());
    units[p.owner].numel += p.numel;
    if (p.names.size() > 1)
      plan.tied.emplace_back(p.names.front(),
                             std::vector<std::string>(p.names.begin() + 1, p.names.end()));
  }
  for (UnitSpec& u : units) {
    if (!u.is_root && u.param_names.empty())
      plan.empty_units.push_back(u.name);
    else
      plan.units.push_back(std::move(u));
  }
  plan.matched_modules =
      std::count_if(matched.begin(), matched.end(), [](int r) { return r >= 0; });
  plan.policy_rules = static_cast<int64_t>(policy.rules.size());
  plan.warnings = shadowed_rule_warnings(nodes, matched, free_numel, matcher, model, policy);
  if (plan.matched_modules == 0 && plan.policy_rules > 0) {
    // What Plan::unmatched_warning() lists: the names the user can write instead.
    plan.policy_spec = policy.to_spec();
    std::unordered_set<std::string> seen;
    for (const Node& n : nodes) {
      if (n.duplicate) continue;
      const std::string type = policy_type_name(n.module->name());
      if (n.parent >= 0 && seen.insert(type).second) plan.model_types.push_back(type);
      if (n.parent == 0) plan.top_level_paths.push_back(n.path);
    }
  }
  return plan;
}

}  // namespace flatshard
