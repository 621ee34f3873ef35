// The TP plan as data (wrap_policies/tp_plan.h): parsing, printing back, caret errors, and each
// model family's default plan (it parses, prints back to itself and names modules that exist).
#include <catch2/catch.hpp>

#include <torch/nn/module.h>

#include "models/family.h"
#include "models/gpt.h"
#include "models/llama.h"
#include "wrap_policies/match.h"
#include "wrap_policies/tp_plan.h"

using namespace flatshard;

TEST_CASE("tp plan: parse and print back", "[tp][plan]") {
  const TpPlan p = parse_tp_plan(
      " colwise:path=*.q_proj|*.k_proj ; rowwise : path=*.o_proj;colwise/3:type=Linear,path=*.qkv;"
      "replicate:type=Embedding");
  REQUIRE(p.rules.size() == 4);
  CHECK(p.rules[0].style == TpStyle::kColwise);
  CHECK(p.rules[0].parts == 1);
  CHECK(p.rules[0].match.terms.size() == 1);
  CHECK(p.rules[0].match.terms[0].names == std::vector<std::string>{"*.q_proj", "*.k_proj"});
  CHECK(p.rules[1].style == TpStyle::kRowwise);
  CHECK(p.rules[2].parts == 3);
  CHECK(p.rules[2].match.terms.size() == 2);
  CHECK(p.rules[3].style == TpStyle::kReplicate);
  const std::string text =
      "colwise:path=*.q_proj|*.k_proj;rowwise:path=*.o_proj;colwise/3:type=Linear,path=*.qkv;"
      "replicate:type=Embedding";
  CHECK(p.to_spec() == text);
  CHECK(parse_tp_plan(text).to_spec() == text);
  CHECK(parse_tp_plan("none").empty());
  CHECK(parse_tp_plan(" none ").to_spec() == "none");
  CHECK(p.match_policy().rules.size() == 4);
}

TEST_CASE("tp plan: the vocab style", "[tp][plan][vocab]") {
  const TpPlan p = parse_tp_plan("vocab:path=wte|embed_tokens;colwise:path=lm_head;loss_parallel");
  REQUIRE(p.rules.size() == 2);
  CHECK(p.rules[0].style == TpStyle::kVocab);
  CHECK(p.rules[0].parts == 1);
  CHECK(p.to_spec() == "vocab:path=wte|embed_tokens;colwise:path=lm_head;loss_parallel");
  CHECK(parse_tp_plan(p.to_spec()).to_spec() == p.to_spec());
  try {
    parse_tp_plan("vocab/2:path=wte");
    FAIL("accepted vocab/2");
  } catch (const c10::Error& e) {
    CHECK_THAT(e.what_without_backtrace(), Catch::Contains("only colwise takes /K"));
  }
}

TEST_CASE("tp plan: the sequence style and the sequence_parallel / loss_parallel options",
          "[tp][plan]") {
  const TpPlan p = parse_tp_plan(
      "sequence_parallel ; colwise:path=*.fc;rowwise:path=*.proj;sequence:type=LayerNorm;"
      "colwise:path=lm_head; loss_parallel");
  REQUIRE(p.rules.size() == 4);
  CHECK(p.rules[2].style == TpStyle::kSequence);
  CHECK(p.sequence_parallel);
  CHECK(p.loss_parallel);
  // Printed last, whatever their place in the text.
  const std::string text =
      "colwise:path=*.fc;rowwise:path=*.proj;sequence:type=LayerNorm;colwise:path=lm_head;"
      "sequence_parallel;loss_parallel";
  CHECK(p.to_spec() == text);
  CHECK(parse_tp_plan(text).to_spec() == text);
  CHECK_FALSE(parse_tp_plan("colwise:path=*.fc").sequence_parallel);
  CHECK(parse_tp_plan("loss_parallel").to_spec() == "loss_parallel");
  CHECK_FALSE(parse_tp_plan("loss_parallel").empty());
  auto error_of = [](const std::string& spec) {
    try {
      parse_tp_plan(spec);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  CHECK_THAT(error_of("sequence/2:type=LayerNorm"), Catch::Contains("'/' after 'sequence'"));
  CHECK_THAT(error_of("sequence_parallel:path=x"),
             Catch::Contains("unknown style 'sequence_parallel'"));
  CHECK_THAT(error_of("colwise:path=x;sequence_paralel"),
             Catch::Contains("unknown style 'sequence_paralel'"));
}

TEST_CASE("tp plan: errors name the column and show a caret", "[tp][plan]") {
  auto error_of = [](const std::string& spec) {
    try {
      parse_tp_plan(spec);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  const std::string unknown = error_of("colwise:path=*.q;rowwize:path=*.o");
  CHECK_THAT(unknown, Catch::StartsWith("tp plan: unknown style 'rowwize' at column 18"));
  CHECK_THAT(unknown, Catch::Contains("colwise:path=*.q;rowwize:path=*.o\n                   ^"));
  CHECK_THAT(error_of("colwise:pth=*.q"), Catch::Contains("tp plan: unknown key 'pth' at column 9"));
  CHECK_THAT(error_of("colwise:"), Catch::Contains("at column 9"));
  CHECK_THAT(error_of("colwise path=*.q"), Catch::Contains("at column 9 (expected ':'"));
  CHECK_THAT(error_of("colwise:path=*.q;;"), Catch::Contains("empty rule at column 18"));
  CHECK_THAT(error_of("colwise/1:path=*.qkv"), Catch::Contains("bad block count"));
  CHECK_THAT(error_of("rowwise/2:path=*.o"), Catch::Contains("'/' after 'rowwise'"));
  CHECK_THAT(error_of("colwise:every=2,path=*.q"), Catch::Contains("'every' in a tp plan"));
  CHECK_THAT(error_of("colwise:path=[x"), Catch::StartsWith("tp plan:"));
  CHECK_THAT(error_of(""), Catch::Contains("empty tp plan"));
  CHECK_THAT(error_of("none;colwise:path=x"), Catch::Contains("after 'none'"));
}

TEST_CASE("tp plan: every family's default plan parses, prints back and matches", "[tp][plan]") {
  for (const models::Family* f : models::families()) {
    CAPTURE(f->name());
    const std::string spec = f->modules().tp_plan;
    REQUIRE(!spec.empty());
    const TpPlan plan = parse_tp_plan(spec);
    CHECK(plan.to_spec() == spec);
    auto cfg = f->preset("tiny");
    auto model = f->build(*cfg, 1);
    const Policy policy = plan.match_policy();
    PolicyMatcher m(policy);
    std::vector<int> hits(plan.rules.size());
    for (const auto& item : model->named_modules("", /*include_self=*/false)) {
      const int r = m.first_match(match_subject(*model, item.key(), *item.value()));
      if (r >= 0) ++hits[r];
    }
    for (size_t r = 0; r < hits.size(); ++r) {
      CAPTURE(r);
      // Every layer has at least one module per rule.
      CHECK(hits[r] >= cfg->n_layers);
    }
  }
}
