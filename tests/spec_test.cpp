// wrap_policies/spec.h + glob.h: the text form of a policy. Counts, glob syntax, errors with
// column and caret, canonical round trips, and a seeded fuzz run of 10,000 specs.
#include <catch2/catch.hpp>

#include <chrono>
#include <random>

#include "tests/policy_test_model.h"
#include "wrap_policies/glob.h"

using namespace flatshard;
using policy_test::check_invariants;
using policy_test::Strings;

namespace {

// The message of the c10::Error parse_policy(spec) throws; fails the test if it does not throw.
std::string spec_error(const std::string& spec) {
  try {
    parse_policy(spec);
  } catch (const c10::Error& e) {
    return e.msg();
  }
  FAIL("spec parsed but should not: '" << spec << "'");
  return "";
}

// Checks the error names `column` (1-based) and puts the caret under it, echoing the spec.
void require_error_at(const std::string& spec, int column, const std::string& what,
                      const std::string& expected) {
  const std::string msg = spec_error(spec);
  INFO("spec '" << spec << "' ->\n" << msg);
  REQUIRE(msg.rfind("policy spec: ", 0) == 0);
  REQUIRE(msg.find(what) != std::string::npos);
  REQUIRE(msg.find(" at column " + std::to_string(column) + " (expected ") != std::string::npos);
  REQUIRE(msg.find(expected) != std::string::npos);
  const size_t nl = msg.find('\n');
  REQUIRE(nl != std::string::npos);
  REQUIRE(msg.substr(nl + 1, spec.size() + 3) == "  " + spec + "\n");
  const std::string caret_line = msg.substr(nl + 1 + spec.size() + 3);
  REQUIRE(caret_line == std::string(2 + column - 1, ' ') + "^");
}

}  // namespace


TEST_CASE("glob syntax", "[policy][spec]") {
  struct Case {
    const char* pattern;
    const char* text;
    bool match;
  };
  const Case cases[] = {
      {"blocks.*", "blocks.0", true},   {"blocks.*", "blocks.0.mlp.fc1", true},
      {"blocks.*", "blocks", false},    {"blocks.*", "blocks.", true},
      {"*.mlp", "mlp", false},          {"*.mlp", "h.3.mlp", true},
      {"*.mlp", "h.3.mlp.fc", false},   {"blocks.1?", "blocks.12", true},
      {"blocks.1?", "blocks.1", false}, {"blocks.1?", "blocks.123", false},
      {"?", ".", true},                 {"[abc]", "b", true},
      {"[abc]", "d", false},            {"[!abc]", "d", true},
      {"[^abc]", "a", false},           {"[a-c]x", "bx", true},
      {"[]]", "]", true},               {"[!]]", "a", true},
      {"[a-]", "-", true},              {"**", "a.b", true},
      {"", "", true},                   {"", "a", false},
      {"a*b*c", "abbbc", true},         {"a*b*c", "acb", false},
      {"head", "head", true},           {"head", "Head", false},
  };
  for (const auto& c : cases) {
    CAPTURE(c.pattern, c.text);
    REQUIRE(Glob(c.pattern).matches(c.text) == c.match);
  }
  // Backtracking stays linear: this would take ages with naive recursion.
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE_FALSE(Glob("*a*a*a*a*a*a*a*a*a*a*a*b").matches(std::string(5000, 'a')));
  REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2));

  auto err = Glob::find_error("blocks.[0");
  REQUIRE(err.has_value());
  REQUIRE(err->pos == 7);
  REQUIRE(err->what == "unterminated '['");
  err = Glob::find_error("x[z-a]");
  REQUIRE(err.has_value());
  REQUIRE(err->pos == 2);
  REQUIRE_FALSE(Glob::find_error("a[]]b").has_value());
  REQUIRE_THROWS_AS(Glob("[!]"), c10::Error);
  REQUIRE_THROWS_AS(by_path("blocks.[0"), c10::Error);
}

TEST_CASE("counts: plain, scientific, suffixed, exact", "[policy][spec]") {
  const std::pair<const char*, int64_t> good[] = {
      {"0", 0},
      {"007", 7},
      {"10000000", 10000000},
      {"1e7", 10000000},
      {"1E7", 10000000},
      {"10M", 10000000},
      {"10m", 10000000},
      {"1.5k", 1500},
      {"1.5K", 1500},
      {"2.5e3", 2500},
      {"1.25M", 1250000},
      {"100e-2", 1},
      {"1e+3", 1000},
      {"2B", 2000000000},
      {"3G", 3000000000},
      {"0.001k", 1},
      {"1.50000000000000000000000k", 1500},
      {"0e999999", 0},
      {"4611686018427387903", 4611686018427387903},  // 2^62 - 1
  };
  for (const auto& [text, value] : good) {
    CAPTURE(text);
    REQUIRE(parse_count(text) == value);
  }
  for (const char* bad : {"", "1.5", "1e", "1.", ".5", "k", "1kk", "1e100", "-1", "+1", "1 k",
                          "4611686018427387904", "99999999999999999999", "9999999999999999999",
                          "1e-1", "0x10", "1,5"}) {
    CAPTURE(bad);
    REQUIRE_THROWS_AS(parse_count(bad), c10::Error);
  }
}

TEST_CASE("spec errors point at the offending token", "[policy][spec]") {
  // The documented example, character for character.
  REQUIRE(spec_error("type=Block;sise>=1e7") ==
          "policy spec: unknown key 'sise' at column 12 (expected one of: type, size, path, "
          "every)\n"
          "  type=Block;sise>=1e7\n"
          "             ^");
  struct Case {
    const char* spec;
    int column;
    const char* what;
    const char* expected;
  };
  const Case cases[] = {
      {"", 1, "empty policy spec", "a rule such as type=Block"},
      {"   ", 4, "empty policy spec", "'none'"},
      {"type=", 6, "missing value for 'type'", "a type name such as Block"},
      {"type=Block|", 12, "missing value for 'type'", "a type name"},
      {"path= ,type=Block", 7, "missing value for 'path'", "a module path glob"},
      {"size>=", 7, "missing value for 'size'", "a whole number"},
      {"size>=1x7", 7, "bad number '1x7'", "such as 10000000, 1e7, 10M or 1.5k"},
      {"size>=1.5", 7, "bad number '1.5' (not a whole number)", "a whole number"},
      {"size>=1e99", 7, "(too large", "a whole number"},
      {"size=10", 5, "unexpected '='", "'>=' after 'size'"},
      {"size>10", 5, "unexpected '>'", "'>=' after 'size'"},
      {"type:Block", 5, "unexpected ':' after 'type'", "'=' after 'type'"},
      {"every=0,type=Block", 7, "group size 0", "every=K with K >= 1"},
      {"every=x,type=Block", 7, "bad number 'x'", "a whole number"},
      {"every=2", 1, "'every' alone in a rule", "every=2,type=Block"},
      {"every=2,type=Block,every=3", 20, "'every' given twice in one rule", "at most one"},
      {"type=Block;;path=head", 12, "empty rule", "remove the extra ';'"},
      {"type=Block;", 12, "empty rule", "a rule such as type=Block"},
      {" ; type=Block", 2, "empty rule", "a rule such as"},
      {"nosahrd:type=Block", 1, "unknown option 'nosahrd'",
       "noshard, grad_op, full, keep, recompute, offload, offload0, offload1, offload2, "
       "gather_param, gather_fp8, gather_int8, gather_fp8_delayed, root"},
      {"gather_bf16:type=Block", 1, "unknown option 'gather_bf16'", "gather_fp8, gather_int8"},
      {"gather_fp8+keep+gather_int8:type=Block", 17, "second gather option 'gather_int8'",
       "at most one gather dtype per rule"},
      {"root:gather_fp8", 6, "unknown option 'gather_fp8'", "noshard, grad_op, full, keep"},
      {"type=Block,gather_fp8:path=x", 12, "option prefix 'gather_fp8:' in the middle",
       "a rule takes one prefix"},
      {"root:sideways", 6, "unknown option 'sideways'", "noshard, grad_op, full, keep"},
      {"root:", 6, "missing option after 'root:'", "noshard"},
      {"root:keep,type=Block", 10, "unexpected ',' after root option", "';' or end of spec"},
      {"root:keep;root:full", 11, "root options given twice", "at most one root:OPTION"},
      {"type=Block,noshard:path=x", 12, "option prefix 'noshard:' in the middle of a rule",
       "a rule takes one prefix"},
      {"noshard:keep:type=Block", 9, "option prefix 'keep:' in the middle",
       "a rule takes one prefix, first"},
      {"grad_op:", 9, "unexpected end of spec", "a term: one of: type, size, path, every"},
      {"path=blocks.[0", 13, "unterminated '[' in glob 'blocks.[0'", "a closing ']'"},
      {"path=head|x[z-a]", 13, "empty range 'z-a'", "low <= high"},
      {"type=Block,", 11, "trailing ','", "another term after ','"},
      {"type=Block , ;size>=1", 12, "trailing ','", "another term"},
      {"type=Block,,size>=1", 12, "unexpected ','", "a term"},
      {"type=Bl ock", 9, "unexpected 'ock'", "',' between terms or ';' between rules"},
      {"type=torch::", 13, "unexpected end of spec after '::'", "an identifier"},
      {"type=torch:::nn", 13, "unexpected ':' after '::'", "an identifier"},
      {"type=1Block", 6, "bad type name '1Block'", "a type name"},
      {"none;type=Block", 5, "unexpected ';' after 'none'", "end of spec"},
      {"=Block", 1, "unexpected '='", "a term"},
      {"type=Block;#", 12, "unexpected '#'", "a term"},
  };
  for (const auto& c : cases) require_error_at(c.spec, c.column, c.what, c.expected);
}

TEST_CASE("to_spec prints a canonical spec that parses back to the same policy",
          "[policy][spec]") {
  const std::pair<const char*, const char*> cases[] = {
      {"type=Block", "type=Block"},
      {" every = 2 , type = Block ", "every=2,type=Block"},
      {"type=Block,every=2", "every=2,type=Block"},
      {"size>=1e7", "size>=10M"},
      {"size>=1.5k", "size>=1500"},
      {"size>=12345", "size>=12345"},
      {"size>=0", "size>=0"},
      {"size>=2B", "size>=2G"},
      {"type=Linear|LayerNorm|Embedding", "type=Linear|LayerNorm|Embedding"},
      {"noshard:path=lm_head;grad_op:type=Block;full:type=torch::nn::Linear;"
       "keep:path=*.mlp|blocks.1?;root:noshard",
       "noshard:path=lm_head;grad_op:type=Block;full:type=torch::nn::Linear;"
       "keep:path=*.mlp|blocks.1?;root:noshard"},
      {"root:grad_op;type=Block", "type=Block;root:grad_op"},
      {"none", "none"},
      {"root:keep", "root:keep"},
      // flat_param/quantized_gather.h's wire formats per rule.
      {"gather_fp8:type=Block", "gather_fp8:type=Block"},
      {"gather_int8+keep+offload0:type=Block;gather_param:path=head",
       "keep+offload0+gather_int8:type=Block;gather_param:path=head"},
      {"\tpath=blocks.[!0-3]* ,\nsize>=1e3", "path=blocks.[!0-3]*,size>=1k"},
  };
  for (const auto& [spec, canonical] : cases) {
    CAPTURE(spec);
    const Policy p = parse_policy(spec);
    REQUIRE(p.to_spec() == canonical);
    REQUIRE(parse_policy(p.to_spec()).to_spec() == canonical);
  }
  const Policy p = parse_policy("keep:every=3,type=Block,size>=1.5M;path=head");
  REQUIRE(p.rules.size() == 2);
  REQUIRE(p.rules[0].every == 3);
  REQUIRE(p.rules[0].options == full_shard_keep());
  REQUIRE(p.rules[0].terms.size() == 2);
  REQUIRE(p.rules[0].terms[0].kind == Term::Kind::kType);
  REQUIRE(p.rules[0].terms[0].names == Strings{"Block"});
  REQUIRE(p.rules[0].terms[1].kind == Term::Kind::kSize);
  REQUIRE(p.rules[0].terms[1].min_numel == 1500000);
  REQUIRE(p.rules[1].terms[0].kind == Term::Kind::kPath);
  REQUIRE(p.rules[1].terms[0].names == Strings{"head"});
  REQUIRE(p.rules[1].options == UnitOptions{});
  REQUIRE(p.root_options == UnitOptions{});
  const Policy g = parse_policy("recompute+gather_int8:type=Block");
  REQUIRE(g.rules[0].options.gather_dtype == GatherDtype::kInt8);
  REQUIRE(g.rules[0].options.recompute == true);
  REQUIRE_FALSE(g.rules[0].options.strategy.has_value());
}

// Random and mutated specs: each must parse or throw c10::Error with a located message, never
// crash or hang; whatever parses must round-trip and yield a valid plan.
TEST_CASE("fuzz: 10,000 random and mutated specs", "[policy][spec]") {
  const Strings seeds = {"type=Block",
                         "every=2,type=Block",
                         "size>=1e7",
                         "path=blocks.*",
                         "noshard:path=lm_head;type=Block;root:grad_op",
                         "type=Linear|LayerNorm|Embedding",
                         "keep:path=blocks.[0-3],size>=1.5k",
                         "full:type=torch::nn::Linear",
                         "none",
                         "grad_op:every=3,path=*.fc?|head"};
  const Strings pieces = {"type", "size",   "path",  "every", "=",    ">=",  ",",    ";",
                          "|",    ":",      "::",    "noshard", "grad_op", "full", "keep",
                          "root", "none",   "Block", "*",     "?",    "[",   "]",    "!",
                          "-",    "1e7",    "1.5k",  "0",     "10M",  " ",   "\t",   ".",
                          "blocks", "e",    "k",     "\x01",  std::string(1, '\0'), "\xff",
                          "<",    "#"};
  const std::string chars = "typesizpathevry=>,;|:.*?[]!-0123456789eEkKMBG noshardfulkeeproot_\t";
  std::mt19937 rng(20240611);
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  auto model = policy_test::net(3);
  int parsed = 0, rejected = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int iter = 0; iter < 10000; ++iter) {
    std::string spec;
    switch (iter % 3) {
      case 0:  // random characters
        for (size_t n = pick(30); n > 0; --n) spec += chars[pick(chars.size())];
        break;
      case 1:  // random grammar pieces
        for (size_t n = pick(12); n > 0; --n) spec += pieces[pick(pieces.size())];
        break;
      default: {  // a valid seed with 1-3 edits
        spec = seeds[pick(seeds.size())];
        for (size_t n = 1 + pick(3); n > 0; --n) {
          const size_t at = pick(spec.size() + 1);
          switch (pick(4)) {
            case 0:
              spec.insert(at, pieces[pick(pieces.size())]);
              break;
            case 1:
              if (at < spec.size()) spec.erase(at, 1 + pick(3));
              break;
            case 2:
              if (at < spec.size()) spec[at] = chars[pick(chars.size())];
              break;
            default:
              spec.insert(at, spec.substr(pick(spec.size() + 1)));
              break;
          }
        }
      }
    }
    CAPTURE(iter, spec);
    Policy p;
    try {
      p = parse_policy(spec);
    } catch (const c10::Error& e) {
      ++rejected;
      const std::string msg = e.msg();
      REQUIRE(msg.rfind("policy spec: ", 0) == 0);
      REQUIRE(msg.find(" at column ") != std::string::npos);
      REQUIRE(msg.find('^') != std::string::npos);
      continue;
    }
    ++parsed;
    const std::string canonical = p.to_spec();
    REQUIRE(parse_policy(canonical).to_spec() == canonical);
    if (parsed % 10 == 0) check_invariants(make_plan(*model, p), *model);
  }
  // Both outcomes are exercised, and nothing was slow.
  CAPTURE(parsed, rejected);
  REQUIRE(parsed > 300);
  REQUIRE(rejected > 3000);
  REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60));
}
