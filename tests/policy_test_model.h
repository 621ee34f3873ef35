// The test model and plan checks shared by policy_test.cpp and spec_test.cpp.
//
// The model (numel in brackets), in registration order:
//   embed  Embedding(10, 4)                  [40]
//   blocks ModuleList of N Block             [84 each]
//     ln   LayerNorm(4)                      [8 = weight 4 + bias 4]
//     fc1  Linear(4, 8)                      [40 = 32 + 8]
//     fc2  Linear(8, 4)                      [36 = 32 + 4]
//   norm   LayerNorm(4)                      [8]
//   head   Linear(4, 10, bias=false)         [40]   (or a Tied view of embed.weight)
#pragma once

#include <catch2/catch.hpp>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <map>
#include <set>

#include "wrap_policies/plan.h"
#include "wrap_policies/policy.h"
#include "wrap_policies/spec.h"

namespace policy_test {

using namespace flatshard;
using Strings = std::vector<std::string>;

constexpr int64_t kD = 4, kHidden = 8, kVocab = 10;
constexpr int64_t kBlockNumel = 84, kRootNumel = 88;  // root = embed + norm + head

// Registers an existing tensor as its own parameter: LibTorch's way to tie weights, since a
// Linear's registered weight cannot be replaced after construction.
struct TiedImpl : torch::nn::Module {
  explicit TiedImpl(const at::Tensor& w) { register_parameter("weight", w); }
};
TORCH_MODULE(Tied);

struct BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  BlockImpl() {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})));
    fc1 = register_module("fc1", torch::nn::Linear(kD, kHidden));
    fc2 = register_module("fc2", torch::nn::Linear(kHidden, kD));
  }
};
TORCH_MODULE(Block);

struct Options {
  int blocks = 4;
  bool tie_head = false;    // head is a Tied view of embed.weight
  bool tie_inside = false;  // every block gets "proj", a Tied view of its own fc1.weight
  bool tie_layers = false;  // blocks.1 gets "proj", a Tied view of blocks.0.fc1.weight
};

struct NetImpl : torch::nn::Module {
  explicit NetImpl(Options o) {
    auto embed = register_module("embed", torch::nn::Embedding(kVocab, kD));
    auto blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < o.blocks; ++i) {
      Block b;
      if (o.tie_inside) b->register_module("proj", Tied(b->fc1->weight));
      if (o.tie_layers && i == 1)
        b->register_module("proj", Tied(blocks->ptr<BlockImpl>(0)->fc1->weight));
      blocks->push_back(b);
    }
    register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kD})));
    if (o.tie_head)
      register_module("head", Tied(embed->weight));
    else
      register_module("head", torch::nn::Linear(torch::nn::LinearOptions(kD, kVocab).bias(false)));
  }
};
TORCH_MODULE(Net);

inline Net net(Options o = {}) { return Net(o); }
inline Net net(int blocks) {
  Options o;
  o.blocks = blocks;
  return Net(o);
}

inline Strings block_params(const std::string& b) {
  return {b + ".ln.weight", b + ".ln.bias", b + ".fc1.weight",
          b + ".fc1.bias",  b + ".fc2.weight", b + ".fc2.bias"};
}

inline Strings unit_names(const Plan& p) {
  Strings s;
  for (const auto& u : p.units) s.push_back(u.name);
  return s;
}

inline const UnitSpec& unit(const Plan& p, const std::string& name) {
  const UnitSpec* u = p.find(name);
  INFO("unit " << name << " in\n" << p.to_string());
  REQUIRE(u != nullptr);
  return *u;
}

// Invariants every plan must satisfy, checked against the model itself: root first and only
// root; every distinct parameter tensor in exactly one unit under exactly one name; numel sums.
inline void check_invariants(const Plan& p, const torch::nn::Module& model) {
  INFO(p.to_string());
  REQUIRE(!p.units.empty());
  REQUIRE(p.units[0].is_root);
  REQUIRE(p.units[0].name == "<root>");
  REQUIRE(p.units[0].module_paths.empty());
  std::map<std::string, const c10::TensorImpl*> impl_of;
  std::map<const c10::TensorImpl*, int64_t> numel_of;
  for (const auto& kv : model.named_parameters()) {
    impl_of[kv.key()] = kv.value().unsafeGetTensorImpl();
    numel_of[kv.value().unsafeGetTensorImpl()] = kv.value().numel();
  }
  std::set<const c10::TensorImpl*> owned;
  int64_t total = 0;
  for (size_t i = 0; i < p.units.size(); ++i) {
    const auto& u = p.units[i];
    REQUIRE(u.is_root == (i == 0));
    if (i > 0) REQUIRE(!u.module_paths.empty());
    if (i > 0) REQUIRE(!u.param_names.empty());
    int64_t n = 0;
    for (const auto& name : u.param_names) {
      REQUIRE(impl_of.count(name) == 1);
      REQUIRE(owned.insert(impl_of[name]).second);  // never in two units, nor twice
      n += numel_of[impl_of[name]];
    }
    REQUIRE(u.numel == n);
    total += n;
  }
  REQUIRE(owned.size() == numel_of.size());
  REQUIRE(p.total_numel() == total);
}

inline Plan plan_of(const torch::nn::Module& model, const std::string& spec) {
  Plan p = make_plan(model, parse_policy(spec));
  check_invariants(p, model);
  return p;
}

inline void require_same(const Plan& a, const Plan& b) {
  REQUIRE(a.units.size() == b.units.size());
  for (size_t i = 0; i < a.units.size(); ++i) {
    REQUIRE(a.units[i].name == b.units[i].name);
    REQUIRE(a.units[i].module_paths == b.units[i].module_paths);
    REQUIRE(a.units[i].param_names == b.units[i].param_names);
    REQUIRE(a.units[i].numel == b.units[i].numel);
    REQUIRE(a.units[i].options == b.units[i].options);
  }
  REQUIRE(a.tied == b.tied);
  REQUIRE(a.matched_modules == b.matched_modules);
  REQUIRE(a.empty_units == b.empty_units);
}

}  // namespace policy_test
