// wrap_policies/policy.h + make_plan: every policy kind and combination against hand-computed
// plans of the small model in policy_test_model.h, nested units, tied weights, shared modules,
// the printed table and builder validation.
#include <catch2/catch.hpp>

#include <chrono>

#include "tests/policy_test_model.h"

using namespace flatshard;
using policy_test::block_params;
using policy_test::check_invariants;
using policy_test::kBlockNumel;
using policy_test::kRootNumel;
using policy_test::plan_of;
using policy_test::require_same;
using policy_test::Strings;
using policy_test::unit;
using policy_test::unit_names;
using TiedList = std::vector<std::pair<std::string, Strings>>;

TEST_CASE("module names: what LibTorch's name() returns and what by_type accepts", "[policy]") {
  // LibTorch names modules by their demangled Impl class, not by the holder.
  REQUIRE(torch::nn::Linear(2, 3)->name() == "torch::nn::LinearImpl");
  REQUIRE(torch::nn::LayerNorm(torch::nn::LayerNormOptions({3}))->name() ==
          "torch::nn::LayerNormImpl");
  REQUIRE(torch::nn::Embedding(4, 2)->name() == "torch::nn::EmbeddingImpl");
  REQUIRE(policy_test::Block()->name() == "policy_test::BlockImpl");
  REQUIRE(torch::nn::ModuleList()->name() == "torch::nn::ModuleListImpl");

  for (const char* t :
       {"Linear", "LinearImpl", "nn::Linear", "torch::nn::Linear", "torch::nn::LinearImpl"}) {
    CAPTURE(t);
    REQUIRE(type_name_matches("torch::nn::LinearImpl", t));
  }
  for (const char* t : {"", "inear", "Lin", "nn", "Impl", "torch", "LinearImplImpl", "linear"}) {
    CAPTURE(t);
    REQUIRE_FALSE(type_name_matches("torch::nn::LinearImpl", t));
  }
  REQUIRE(type_name_matches("gpt::BlockImpl", "Block"));
  REQUIRE(type_name_matches("BlockImpl", "Block"));
  REQUIRE(type_name_matches("Block", "Block"));  // a module constructed with an explicit name
  REQUIRE_FALSE(type_name_matches("gpt::MyBlockImpl", "Block"));
  REQUIRE_FALSE(type_name_matches("gpt::BlockImpl", "gpt"));
}

TEST_CASE("per-layer: type=Block makes one unit per block, the rest stays in the root",
          "[policy]") {
  auto model = policy_test::net();
  Plan p = plan_of(*model, "type=Block");
  REQUIRE(unit_names(p) == Strings{"<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"});
  REQUIRE(p.units[0].param_names ==
          Strings{"embed.weight", "norm.weight", "norm.bias", "head.weight"});
  REQUIRE(p.units[0].numel == kRootNumel);
  for (int i = 0; i < 4; ++i) {
    const std::string b = "blocks." + std::to_string(i);
    REQUIRE(unit(p, b).module_paths == Strings{b});
    REQUIRE(unit(p, b).param_names == block_params(b));
    REQUIRE(unit(p, b).numel == kBlockNumel);
    REQUIRE_FALSE(unit(p, b).options.strategy.has_value());
  }
  REQUIRE(p.matched_modules == 4);
  REQUIRE(p.total_numel() == kRootNumel + 4 * kBlockNumel);
  REQUIRE(p.tied.empty());
  REQUIRE(p.empty_units.empty());
  require_same(p, make_plan(*model, single(by_type("Block"))));
}

TEST_CASE("per-leaf: type=Linear|LayerNorm|Embedding leaves the root empty", "[policy]") {
  auto model = policy_test::net();
  Plan p = plan_of(*model, " type = Linear | LayerNorm|Embedding ");
  Strings expected = {"<root>", "embed"};
  for (int i = 0; i < 4; ++i)
    for (const char* leaf : {"ln", "fc1", "fc2"})
      expected.push_back("blocks." + std::to_string(i) + "." + leaf);
  expected.push_back("norm");
  expected.push_back("head");
  REQUIRE(unit_names(p) == expected);
  REQUIRE(p.units[0].param_names.empty());
  REQUIRE(p.units[0].numel == 0);
  REQUIRE(unit(p, "embed").param_names == Strings{"embed.weight"});
  REQUIRE(unit(p, "embed").numel == 40);
  REQUIRE(unit(p, "blocks.2.ln").numel == 8);
  REQUIRE(unit(p, "blocks.2.fc1").param_names ==
          Strings{"blocks.2.fc1.weight", "blocks.2.fc1.bias"});
  REQUIRE(unit(p, "blocks.2.fc1").numel == 40);
  REQUIRE(unit(p, "blocks.3.fc2").numel == 36);
  REQUIRE(unit(p, "head").param_names == Strings{"head.weight"});
  REQUIRE(p.matched_modules == 15);
  require_same(p, make_plan(*model, single(by_type({"Linear", "LayerNorm", "Embedding"}))));
}

TEST_CASE("every-k groups consecutive sibling matches; the last group may be smaller",
          "[policy]") {
  auto model = policy_test::net(5);
  Plan p = plan_of(*model, "every=2,type=Block");
  REQUIRE(unit_names(p) == Strings{"<root>", "blocks.0-1", "blocks.2-3", "blocks.4"});
  REQUIRE(unit(p, "blocks.0-1").module_paths == Strings{"blocks.0", "blocks.1"});
  Strings both = block_params("blocks.2");
  for (const auto& n : block_params("blocks.3")) both.push_back(n);
  REQUIRE(unit(p, "blocks.2-3").param_names == both);
  REQUIRE(unit(p, "blocks.0-1").numel == 2 * kBlockNumel);
  REQUIRE(unit(p, "blocks.2-3").numel == 2 * kBlockNumel);
  REQUIRE(unit(p, "blocks.4").module_paths == Strings{"blocks.4"});
  REQUIRE(unit(p, "blocks.4").numel == kBlockNumel);
  REQUIRE(p.units[0].numel == kRootNumel);
  REQUIRE(p.matched_modules == 5);
  require_same(p, make_plan(*model, single(every(2, by_type("Block")))));
  // The term order inside a rule does not matter.
  require_same(p, plan_of(*model, "type=Block,every=2"));

  Plan three = plan_of(*model, "every=3,type=Block");
  REQUIRE(unit_names(three) == Strings{"<root>", "blocks.0-2", "blocks.3-4"});
  REQUIRE(unit(three, "blocks.0-2").module_paths == Strings{"blocks.0", "blocks.1", "blocks.2"});
  require_same(plan_of(*model, "every=1,type=Block"), plan_of(*model, "type=Block"));
  REQUIRE(unit_names(plan_of(*model, "every=100,type=Block")) ==
          Strings{"<root>", "blocks.0-4"});

  // Groups never span parents: every block's two Linears pair up inside that block.
  Plan pairs = plan_of(*model, "every=2,type=Linear");
  REQUIRE(unit(pairs, "blocks.1.fc1-fc2").module_paths ==
          Strings{"blocks.1.fc1", "blocks.1.fc2"});
  REQUIRE(unit(pairs, "head").module_paths == Strings{"head"});  // alone under the root
  REQUIRE(pairs.units.size() == 1 + 5 + 1);                     // root, 5 blocks, head
}

TEST_CASE("every-k skips siblings the rule does not match", "[policy]") {
  auto root = std::make_shared<torch::nn::Module>();
  auto layers = root->register_module("layers", torch::nn::ModuleList());
  layers->push_back(torch::nn::Linear(2, 2));                                 // 6
  layers->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({2})));  // 4
  layers->push_back(torch::nn::Linear(2, 3));                                 // 9
  layers->push_back(torch::nn::Linear(3, 1));                                 // 4
  Plan p = make_plan(*root, single(every(2, by_type("Linear"))));
  check_invariants(p, *root);
  REQUIRE(unit_names(p) == Strings{"<root>", "layers.0-2", "layers.3"});
  REQUIRE(unit(p, "layers.0-2").module_paths == Strings{"layers.0", "layers.2"});
  REQUIRE(unit(p, "layers.0-2").numel == 15);
  REQUIRE(p.units[0].param_names == Strings{"layers.1.weight", "layers.1.bias"});
}

TEST_CASE("whole model: no rules, 'none', or a policy matching nothing give the root only",
          "[policy]") {
  auto model = policy_test::net();
  const int64_t total = kRootNumel + 4 * kBlockNumel;
  for (const std::string spec : {"none", "  none ", "type=Conv2d", "size>=1e7", "path=nothing",
                                 "type=Block,path=head", "root:noshard"}) {
    CAPTURE(spec);
    Plan p = plan_of(*model, spec);
    REQUIRE(unit_names(p) == Strings{"<root>"});
    REQUIRE(p.units[0].numel == total);
    REQUIRE(p.units[0].param_names.size() == 4 + 4 * 6);
    REQUIRE(p.match_count() == 0);
  }
  Plan p = make_plan(*model, Policy{});
  REQUIRE(unit_names(p) == Strings{"<root>"});
  REQUIRE(p.match_count() == 0);
  REQUIRE(Policy{}.to_spec() == "none");
  REQUIRE(plan_of(*model, "root:noshard").units[0].options == no_shard());

  // An empty model, even one living on the stack (no shared_ptr needed), is a valid plan.
  torch::nn::Module empty;
  Plan e = make_plan(empty, parse_policy("type=Block"));
  REQUIRE(unit_names(e) == Strings{"<root>"});
  REQUIRE(e.units[0].numel == 0);
  REQUIRE(e.total_numel() == 0);
  REQUIRE(e.match_count() == 0);
  REQUIRE(e.to_string().find("units: 1, total numel: 0, tied params: 0") != std::string::npos);
}

TEST_CASE("size: bottom-up on what matched descendants left unclaimed", "[policy]") {
  auto model = policy_test::net();
  // 84 per block >= 80, no leaf reaches 80, and the root is never a unit.
  require_same(plan_of(*model, "size>=80"), plan_of(*model, "type=Block"));

  // 40: fc1 (40), embed and head (40) qualify; a block then has ln + fc2 = 44 left, also >= 40;
  // fc2 (36), ln and norm (8) do not; the ModuleList has nothing left.
  Plan p = plan_of(*model, "size>=40");
  REQUIRE(unit_names(p) == Strings{"<root>", "embed", "blocks.0", "blocks.0.fc1", "blocks.1",
                                   "blocks.1.fc1", "blocks.2", "blocks.2.fc1", "blocks.3",
                                   "blocks.3.fc1", "head"});
  REQUIRE(p.units[0].param_names == Strings{"norm.weight", "norm.bias"});
  REQUIRE(unit(p, "blocks.1").param_names == Strings{"blocks.1.ln.weight", "blocks.1.ln.bias",
                                                     "blocks.1.fc2.weight", "blocks.1.fc2.bias"});
  REQUIRE(unit(p, "blocks.1").numel == 44);
  REQUIRE(unit(p, "blocks.1.fc1").numel == 40);
  REQUIRE(p.matched_modules == 10);
  require_same(p, make_plan(*model, single(by_size(40))));

  // 100: no block reaches it, so the ModuleList (all 4 blocks, 336) does.
  Plan list = plan_of(*model, "size>=100");
  REQUIRE(unit_names(list) == Strings{"<root>", "blocks"});
  REQUIRE(unit(list, "blocks").numel == 4 * kBlockNumel);
  REQUIRE(list.units[0].numel == kRootNumel);

  // 45: fc1 (40) misses, so a block has all 84: blocks match and fc1 does not.
  require_same(plan_of(*model, "size>=45"), plan_of(*model, "type=Block"));

  // 0: everything matches; modules left with no parameter are dropped and reported.
  Plan all = plan_of(*model, "size>=0");
  REQUIRE(all.matched_modules == 20);
  REQUIRE(all.empty_units == Strings{"blocks", "blocks.0", "blocks.1", "blocks.2", "blocks.3"});
  REQUIRE(all.units.size() == 1 + 15);
  REQUIRE(all.units[0].numel == 0);

  // AND with a type: only blocks, and only when big enough.
  require_same(plan_of(*model, "type=Block,size>=84"), plan_of(*model, "type=Block"));
  REQUIRE(plan_of(*model, "type=Block,size>=85").match_count() == 0);
}

TEST_CASE("path globs select modules by dotted path", "[policy]") {
  auto model = policy_test::net();
  require_same(plan_of(*model, "path=blocks.?"), plan_of(*model, "type=Block"));
  require_same(plan_of(*model, "path=blocks.[0-3]"), plan_of(*model, "type=Block"));
  REQUIRE(unit_names(plan_of(*model, "path=blocks.[!1-3]")) == Strings{"<root>", "blocks.0"});
  REQUIRE(unit_names(plan_of(*model, "path=head|embed")) == Strings{"<root>", "embed", "head"});
  REQUIRE(unit_names(plan_of(*model, "path=*.fc?")) ==
          Strings{"<root>", "blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2",
                  "blocks.2.fc1", "blocks.2.fc2", "blocks.3.fc1", "blocks.3.fc2"});
  // '*' crosses dots: "blocks.*" also matches every module inside a block, so the blocks' own
  // units end up empty (dropped) and the leaves hold the parameters.
  Plan deep = plan_of(*model, "path=blocks.*");
  REQUIRE(deep.matched_modules == 16);
  REQUIRE(deep.empty_units == Strings{"blocks.0", "blocks.1", "blocks.2", "blocks.3"});
  REQUIRE(deep.units.size() == 1 + 12);
  // "*" alone matches every module but never the root.
  REQUIRE(plan_of(*model, "path=*").matched_modules == 20);
  require_same(plan_of(*model, "path=*.fc1"), make_plan(*model, single(by_path("*.fc1"))));
}

TEST_CASE("predicate: any C++ condition on (path, module)", "[policy]") {
  auto model = policy_test::net();
  std::set<std::string> seen;
  ModulePredicate wide_linear = [&](const std::string& path, const torch::nn::Module& m) {
    seen.insert(path);
    const auto* lin = dynamic_cast<const torch::nn::LinearImpl*>(&m);
    return lin != nullptr && lin->options.out_features() == policy_test::kVocab;
  };
  Plan p = make_plan(*model, single(by_predicate(wide_linear, "wide_linear")));
  check_invariants(p, *model);
  REQUIRE(unit_names(p) == Strings{"<root>", "head"});
  REQUIRE(unit(p, "head").param_names == Strings{"head.weight"});
  REQUIRE(p.units[0].numel == kRootNumel - 40 + 4 * kBlockNumel);
  REQUIRE(seen.size() == 20);  // every module but the root
  REQUIRE(seen.count("") == 0);
  REQUIRE(seen.count("blocks.3.fc2") == 1);
  // Predicates compose with other terms and print (unparseably) in to_spec().
  Policy both = single(all_of({by_type("Linear"), by_predicate(wide_linear, "wide")}));
  REQUIRE(unit_names(make_plan(*model, both)) == Strings{"<root>", "head"});
  REQUIRE(both.to_spec() == "type=Linear,<predicate wide>");
}

TEST_CASE("options: prefixes per rule, root options, first matching rule wins", "[policy]") {
  auto model = policy_test::net();
  const std::string spec =
      "noshard:path=head;grad_op:type=Block;keep:type=Embedding;full:type=LayerNorm;root:keep";
  Plan p = plan_of(*model, spec);
  REQUIRE(unit_names(p) == Strings{"<root>", "embed", "blocks.0", "blocks.0.ln", "blocks.1",
                                   "blocks.1.ln", "blocks.2", "blocks.2.ln", "blocks.3",
                                   "blocks.3.ln", "norm", "head"});
  REQUIRE(p.units[0].options == full_shard_keep());
  REQUIRE(unit(p, "head").options == no_shard());
  REQUIRE(unit(p, "blocks.2").options == shard_grad_op());
  REQUIRE(unit(p, "blocks.2").numel == kBlockNumel - 8);
  REQUIRE(unit(p, "embed").options == UnitOptions{ShardingStrategy::kFullShard, false});
  REQUIRE(unit(p, "norm").options == UnitOptions{ShardingStrategy::kFullShard, std::nullopt});
  REQUIRE(unit(p, "blocks.2.ln").options == full_shard());

  Policy cpp = any_of({with_options(by_path("head"), no_shard()),
                       with_options(by_type("Block"), shard_grad_op()),
                       with_options(by_type("Embedding"), full_shard_keep()),
                       with_options(by_type("LayerNorm"), full_shard())});
  cpp.set_root_options(full_shard_keep());
  require_same(p, make_plan(*model, cpp));
  REQUIRE(cpp.to_spec() == spec);

  // First matching rule wins.
  Plan first = plan_of(*model, "noshard:type=Linear;grad_op:type=Linear|Block");
  REQUIRE(unit(first, "blocks.0.fc1").options == no_shard());
  REQUIRE(unit(first, "head").options == no_shard());
  REQUIRE(unit(first, "blocks.0").options == shard_grad_op());
  Plan swapped = plan_of(*model, "grad_op:type=Linear|Block;noshard:type=Linear");
  REQUIRE(unit(swapped, "head").options == shard_grad_op());

  // The table shows the strategy, or "default" when the rule set none.
  const std::string table = p.to_string();
  REQUIRE(table.find("FULL_SHARD keep") != std::string::npos);
  REQUIRE(table.find("NO_SHARD") != std::string::npos);
  REQUIRE(table.find("SHARD_GRAD_OP") != std::string::npos);
  REQUIRE(plan_of(*model, "type=Block").to_string().find("default") != std::string::npos);
}

TEST_CASE("nested units own only what inner units leave", "[policy]") {
  auto model = policy_test::net();
  Plan p = plan_of(*model, "type=Block;path=*.fc1");
  REQUIRE(unit_names(p) == Strings{"<root>", "blocks.0", "blocks.0.fc1", "blocks.1",
                                   "blocks.1.fc1", "blocks.2", "blocks.2.fc1", "blocks.3",
                                   "blocks.3.fc1"});
  REQUIRE(unit(p, "blocks.3").param_names == Strings{"blocks.3.ln.weight", "blocks.3.ln.bias",
                                                     "blocks.3.fc2.weight", "blocks.3.fc2.bias"});
  REQUIRE(unit(p, "blocks.3").numel == 44);
  REQUIRE(unit(p, "blocks.3.fc1").param_names ==
          Strings{"blocks.3.fc1.weight", "blocks.3.fc1.bias"});
  REQUIRE(unit(p, "blocks.3.fc1").numel == 40);

  // Three levels of units, each owning something: root, block (ln), leaf. The ModuleList unit
  // would own nothing once its blocks are units, so it is dropped and reported.
  Plan three = plan_of(*model, "path=blocks;type=Block;type=Linear");
  REQUIRE(three.empty_units == Strings{"blocks"});
  REQUIRE(three.matched_modules == 1 + 4 + 9);
  REQUIRE(three.units[0].numel == kRootNumel - 40);  // head is a Linear unit now
  REQUIRE(unit(three, "blocks.0").param_names ==
          Strings{"blocks.0.ln.weight", "blocks.0.ln.bias"});
  REQUIRE(unit(three, "blocks.0.fc2").numel == 36);
  REQUIRE(unit(three, "head").numel == 40);
}

TEST_CASE("tied weights inside one unit stay in that unit", "[policy]") {
  policy_test::Options o;
  o.tie_inside = true;  // blocks.i.proj.weight is blocks.i.fc1.weight
  auto model = policy_test::net(o);
  REQUIRE(model->named_parameters().size() == 4 + 4 * 7);  // LibTorch lists the alias too

  Plan p = plan_of(*model, "type=Block");
  for (int i = 0; i < 4; ++i) {
    const std::string b = "blocks." + std::to_string(i);
    REQUIRE(unit(p, b).param_names == block_params(b));  // first name only
    REQUIRE(unit(p, b).numel == kBlockNumel);            // counted once
  }
  REQUIRE(p.tied.size() == 4);
  REQUIRE(p.tied[2].first == "blocks.2.fc1.weight");
  REQUIRE(p.tied[2].second == Strings{"blocks.2.proj.weight"});

  // fc1 as its own unit holds only one of the two names: the block (the innermost unit holding
  // both) owns the weight, fc1 keeps its bias.
  Plan inner = plan_of(*model, "type=Block;type=Linear");
  REQUIRE(unit(inner, "blocks.1").param_names ==
          Strings{"blocks.1.ln.weight", "blocks.1.ln.bias", "blocks.1.fc1.weight"});
  REQUIRE(unit(inner, "blocks.1").numel == 8 + 32);
  REQUIRE(unit(inner, "blocks.1.fc1").param_names == Strings{"blocks.1.fc1.bias"});
  REQUIRE(unit(inner, "blocks.1.fc2").numel == 36);
  REQUIRE(inner.tied == p.tied);
}

TEST_CASE("tied weights across units go to the innermost common unit", "[policy]") {
  policy_test::Options o;
  o.tie_head = true;  // head.weight is embed.weight
  auto model = policy_test::net(o);
  Plan p = plan_of(*model, "type=Block");
  REQUIRE(p.units[0].param_names == Strings{"embed.weight", "norm.weight", "norm.bias"});
  REQUIRE(p.units[0].numel == kRootNumel - 40);
  REQUIRE(p.tied == TiedList{{"embed.weight", {"head.weight"}}});

  // Embedding and head as units: neither holds both names, so the root owns the weight and the
  // two units, left empty, are dropped.
  Plan split = plan_of(*model, "type=Embedding|Tied");
  REQUIRE(split.matched_modules == 2);
  REQUIRE(split.empty_units == Strings{"embed", "head"});
  REQUIRE(unit_names(split) == Strings{"<root>"});
  REQUIRE(split.units[0].param_names.front() == "embed.weight");

  // Cross-layer sharing: blocks.1.proj.weight is blocks.0.fc1.weight.
  policy_test::Options layers;
  layers.tie_layers = true;
  auto shared = policy_test::net(layers);
  Plan per_block = plan_of(*shared, "type=Block");
  REQUIRE(per_block.units[0].param_names == Strings{"embed.weight", "blocks.0.fc1.weight",
                                                    "norm.weight", "norm.bias", "head.weight"});
  REQUIRE(per_block.units[0].numel == kRootNumel + 32);
  REQUIRE(unit(per_block, "blocks.0").numel == kBlockNumel - 32);
  REQUIRE(unit(per_block, "blocks.1").numel == kBlockNumel);
  REQUIRE(per_block.tied == TiedList{{"blocks.0.fc1.weight", {"blocks.1.proj.weight"}}});
  // With the ModuleList as a unit around the blocks, it is the innermost common unit.
  Plan list = plan_of(*shared, "path=blocks;type=Block");
  REQUIRE(unit(list, "blocks").param_names == Strings{"blocks.0.fc1.weight"});
  REQUIRE(list.units[0].numel == kRootNumel);
  REQUIRE(unit(plan_of(*shared, "path=blocks"), "blocks").numel == 4 * kBlockNumel);
}

TEST_CASE("a module registered under two paths is one module", "[policy]") {
  auto root = std::make_shared<torch::nn::Module>();
  torch::nn::Linear lin(2, 2);
  root->register_module("a", lin);
  root->register_module("c", torch::nn::Linear(2, 3));
  root->register_module("b", lin);
  Plan p = make_plan(*root, parse_policy("type=Linear"));
  check_invariants(p, *root);
  REQUIRE(unit_names(p) == Strings{"<root>", "a", "c"});
  REQUIRE(p.matched_modules == 2);
  REQUIRE(unit(p, "a").param_names == Strings{"a.weight", "a.bias"});
  REQUIRE(unit(p, "a").numel == 6);
  REQUIRE(p.units[0].numel == 0);
  REQUIRE(p.tied == TiedList{{"a.weight", {"b.weight"}}, {"a.bias", {"b.bias"}}});
  // Only the first path can be matched.
  REQUIRE(make_plan(*root, parse_policy("path=b")).match_count() == 0);
  // Sizes count the shared module once: a (6) + c (9) = 15 under the root, which never matches;
  // and no child reaches 10.
  REQUIRE(make_plan(*root, parse_policy("size>=10")).match_count() == 0);
  REQUIRE(make_plan(*root, parse_policy("size>=6")).match_count() == 2);
}

TEST_CASE("a module graph with a cycle is an error, not a stack overflow", "[policy]") {
  auto a = std::make_shared<torch::nn::Module>();
  auto b = std::make_shared<torch::nn::Module>();
  a->register_module("b", b);
  b->register_module("a", a);
  REQUIRE_THROWS_WITH(make_plan(*a, parse_policy("type=Linear")), Catch::Contains("cycle"));
  b->unregister_module("a");  // break the ownership cycle
}

TEST_CASE("Plan::to_string is a table plus a summary", "[policy]") {
  auto model = policy_test::net(2);
  Plan p = plan_of(*model, "noshard:path=head;type=Block");
  REQUIRE(p.to_string() ==
          "#  unit      strategy  modules  params  numel\n"
          "0  <root>    default         0       3     48\n"
          "1  blocks.0  default         1       6     84\n"
          "2  blocks.1  default         1       6     84\n"
          "3  head      NO_SHARD        1       1     40\n"
          "units: 4, total numel: 256, tied params: 0\n");
  policy_test::Options o;
  o.blocks = 1;
  o.tie_head = true;
  auto tied = policy_test::net(o);
  const std::string s = plan_of(*tied, "every=2,type=Block").to_string();
  REQUIRE(s.find("units: 2, total numel: 132, tied params: 1\n") != std::string::npos);
  REQUIRE(s.find("tied: embed.weight = head.weight\n") != std::string::npos);
  REQUIRE(plan_of(*model, "size>=0").to_string().find("empty units dropped: 3") !=
          std::string::npos);
  REQUIRE(std::string(to_string(ShardingStrategy::kShardGradOp)) == "SHARD_GRAD_OP");
}

TEST_CASE("builders and validation reject malformed policies", "[policy]") {
  auto model = policy_test::net();
  REQUIRE_THROWS_AS(every(0, by_type("Block")), c10::Error);
  REQUIRE_THROWS_AS(all_of({every(2, by_type("A")), every(3, by_type("B"))}), c10::Error);
  REQUIRE_THROWS_AS(
      all_of({with_options(by_type("A"), no_shard()), with_options(by_type("B"), full_shard())}),
      c10::Error);
  Policy no_terms;
  no_terms.rules.push_back(Rule{});
  REQUIRE_THROWS_WITH(make_plan(*model, no_terms), Catch::Contains("no terms"));
  REQUIRE_THROWS_WITH(make_plan(*model, single(by_size(-1))),
                      Catch::Contains("size must be >= 0"));
  REQUIRE_THROWS_AS(make_plan(*model, single(by_predicate(nullptr))), c10::Error);
  REQUIRE_THROWS_AS(make_plan(*model, single(by_type(Strings{}))), c10::Error);
  Rule bad_every = by_type("Block");
  bad_every.every = 0;
  REQUIRE_THROWS_AS(make_plan(*model, single(bad_every)), c10::Error);
  // all_of ANDs the terms and keeps the one grouping and the one option set.
  Rule r = all_of({every(2, by_type("Linear")), with_options(by_path("*.fc?"), no_shard())});
  REQUIRE(r.every == 2);
  REQUIRE(r.options == no_shard());
  REQUIRE(single(r).to_spec() == "noshard:every=2,type=Linear,path=*.fc?");
  require_same(make_plan(*model, single(r)),
               plan_of(*model, "noshard:every=2,type=Linear,path=*.fc?"));
  REQUIRE(unit_names(make_plan(*model, single(r))).size() == 1 + 4);
}

TEST_CASE("matching a policy of 10,000 rules is not quadratic; more than the bound is refused",
          "[policy]") {
  // Before: every rule was tried on every module (10,000 x 8,000 here, ~10 s on CI's cores;
  // flatshard-bench took 57 s on one such policy). Now the rules' type names and literal paths
  // are looked up (wrap_policies/match.h).
  auto model = policy_test::net(2000);  // 8,006 modules
  std::string spec;
  for (int i = 0; i < 5000; ++i) spec += "type=T" + std::to_string(i) + ";";
  for (int i = 0; i < 5000; ++i) spec += "path=blocks." + std::to_string(i) + ".fc1;";
  spec += "type=Block";
  const Policy policy = parse_policy(spec);
  REQUIRE(policy.rules.size() == 10001);
  const auto start = std::chrono::steady_clock::now();
  const Plan p = make_plan(*model, policy);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(seconds < 2.0);  // ~0.1 s; generous for loaded CI cores
  REQUIRE(p.units.size() == 1 + 2 * 2000);  // each block, and its fc1 inside it
  CHECK(p.matched_modules == 4000);
  CHECK(p.units[1].name == "blocks.0");
  CHECK(p.units[2].name == "blocks.0.fc1");
  CHECK(p.units[2].param_names == Strings{"blocks.0.fc1.weight", "blocks.0.fc1.bias"});
  CHECK(p.warnings.empty());
  check_invariants(p, *model);

  // The first matching rule still wins when the index and the scanned rules mix: a glob rule
  // before the indexed ones takes the modules it matches.
  const Plan mixed = plan_of(*policy_test::net(3), "noshard:path=blocks.[1];type=Block;path=head");
  CHECK(unit_names(mixed) == Strings{"<root>", "blocks.0", "blocks.1", "blocks.2", "head"});
  CHECK(unit(mixed, "blocks.1").options == no_shard());
  CHECK(unit(mixed, "blocks.2").options == UnitOptions{});

  // A bound on what a policy holds: a clear error naming it.
  Policy huge;
  huge.rules.push_back(by_type(Strings(kMaxPolicyNames, "T")));
  REQUIRE_THROWS_WITH(make_plan(*model, huge),
                      Catch::Contains("more than the limit of 100000") &&
                          Catch::Contains("kMaxPolicyNames"));
}

TEST_CASE("a policy matching nothing names the model's types and top-level paths, escaped",
          "[policy]") {
  auto model = policy_test::net(2);
  const std::string w = plan_of(*model, "type=Blok").unmatched_warning();
  CHECK_THAT(w, Catch::Contains("the policy matched no module ('type=Blok')") &&
                    Catch::Contains("the model's types are Embedding, ModuleList, Block, "
                                    "LayerNorm, Linear;") &&
                    Catch::Contains("its top-level paths are embed, blocks, norm, head"));
  CHECK(plan_of(*model, "none").unmatched_warning().empty());
  CHECK(plan_of(*model, "type=Block").unmatched_warning().empty());
  // A name from a file reaches a terminal escaped.
  torch::nn::Module odd;
  odd.register_module("bad\x1b[2Jname", torch::nn::Linear(2, 2));
  const std::string e = make_plan(odd, parse_policy("type=Conv2d")).unmatched_warning();
  CHECK(e.find('\x1b') == std::string::npos);
  CHECK_THAT(e, Catch::Contains("bad\\x1b[2Jname"));
}
