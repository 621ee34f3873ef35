// flatshard/wrap_policies/spec.cpp — recursive-descent parser for the grammar in spec.h.
//
// Every error goes through Parser::fail, so all of them carry the column, the offending token,
// what was expected and the caret line. The parser only ever moves forward over the input and
// never recurses on it, so any input terminates in O(length) steps.
#include "wrap_policies/spec.h"

#include <c10/util/Exception.h>

#include <optional>
#include <utility>

#include "wrap_policies/glob.h"

namespace flatshard {

namespace {

const char* const kKeys = "one of: type, size, path, every";
const char* const kOptions =
    "one of: noshard, grad_op, full, keep, recompute, offload, offload0, offload1, offload2, "
    "gather_param, gather_fp8, gather_int8, gather_fp8_delayed";
const char* const kRootOptions = "one of: noshard, grad_op, full, keep";
const char* const kCountHelp = "a whole number such as 10000000, 1e7, 10M or 1.5k";
constexpr int64_t kCountLimit = int64_t{1} << 62;

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_ident_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_ident(char c) { return is_ident_start(c) || (c >= '0' && c <= '9'); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
// Characters that end a value (globs and counts run up to one of these).
bool ends_value(char c) { return is_space(c) || c == ',' || c == ';' || c == '|'; }

// `s` for an error message: one byte per column (control characters would break the caret
// line, so they print as '?', tabs as a blank), long tokens cut.
std::string printable(std::string s, size_t max_len = 40) {
  if (s.size() > max_len) s = s.substr(0, max_len) + "...";
  for (char& c : s)
    if (c == '\t')
      c = ' ';
    else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      c = '?';
  return s;
}

// "offload" is level 1 (Note [CPU offload], flat_param/offload.h); "offload0" turns it off for
// the rule's units when ShardingOptions::offload is on.
std::optional<int> offload_level_named(const std::string& word) {
  if (word == "offload" || word == "offload1") return 1;
  if (word == "offload0") return 0;
  if (word == "offload2") return 2;
  return std::nullopt;
}

// "gather_fp8" -> kFp8 (flat_param/quantized_gather.h); "gather_param" turns it off for the
// rule's units when MixedPrecision::gather_dtype is on.
std::optional<GatherDtype> gather_named(const std::string& word) {
  if (word.rfind("gather_", 0) != 0) return std::nullopt;
  return gather_dtype_from_name(word.substr(7));
}

std::optional<UnitOptions> option_named(const std::string& word) {
  if (word == "noshard") return no_shard();
  if (word == "grad_op") return shard_grad_op();
  if (word == "full") return full_shard();
  if (word == "keep") return full_shard_keep();
  return std::nullopt;
}

// Value of a count token, or nullopt with `why` set. Exact integer arithmetic: the digits form
// an integer mantissa and everything else is a power of ten, so "1.5k" is 15 * 10^2 with no
// floating-point rounding.
std::optional<int64_t> count_value(const std::string& t, std::string* why) {
  size_t i = 0;
  std::string mantissa;
  int64_t exp10 = 0;
  while (i < t.size() && is_digit(t[i])) mantissa += t[i++];
  if (mantissa.empty()) {
    *why = "does not start with a digit";
    return std::nullopt;
  }
  if (i < t.size() && t[i] == '.') {
    ++i;
    const size_t start = i;
    while (i < t.size() && is_digit(t[i])) mantissa += t[i++];
    if (i == start) {
      *why = "no digits after '.'";
      return std::nullopt;
    }
    exp10 -= static_cast<int64_t>(i - start);
  }
  if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
    ++i;
    int sign = 1;
    if (i < t.size() && (t[i] == '+' || t[i] == '-')) sign = t[i++] == '-' ? -1 : 1;
    const size_t start = i;
    int64_t e = 0;
    // Clamped: any exponent this large is "too large" or "not whole" anyway.
    for (; i < t.size() && is_digit(t[i]); ++i)
      e = std::min<int64_t>(e * 10 + (t[i] - '0'), 100000);
    if (i == start) {
      *why = "no digits in the exponent";
      return std::nullopt;
    }
    exp10 += sign * e;
  }
  if (i < t.size()) {
    switch (t[i]) {
      case 'k': case 'K': exp10 += 3; ++i; break;
      case 'm': case 'M': exp10 += 6; ++i; break;
      case 'g': case 'G': case 'b': case 'B': exp10 += 9; ++i; break;
      default: break;
    }
  }
  if (i < t.size()) {
    *why = "unexpected '" + t.substr(i) + "' (suffixes: k, M, G/B)";
    return std::nullopt;
  }
  const size_t nz = mantissa.find_first_not_of('0');
  if (nz == std::string::npos) return 0;
  mantissa.erase(0, nz);
  while (mantissa.back() == '0') {
    mantissa.pop_back();
    ++exp10;
  }
  if (exp10 < 0) {
    *why = "not a whole number";
    return std::nullopt;
  }
  if (static_cast<int64_t>(mantissa.size()) + exp10 > 19) {
    *why = "too large";
    return std::nullopt;
  }
  // <= 19 digits fit in uint64_t; every multiplication is checked against the limit first.
  uint64_t v = 0;
  for (char c : mantissa) v = v * 10 + static_cast<uint64_t>(c - '0');
  const auto limit = static_cast<uint64_t>(kCountLimit);
  for (int64_t k = 0; k < exp10 && v < limit; ++k) v = v > limit / 10 ? limit : v * 10;
  if (v >= limit) {
    *why = "too large (limit 2^62)";
    return std::nullopt;
  }
  return static_cast<int64_t>(v);
}

class Parser {
 public:
  explicit Parser(const std::string& spec, std::string label = "policy spec",
                  bool allow_every = true)
      : s_(spec), label_(std::move(label)), allow_every_(allow_every) {}

  // term (',' term)* from `pos` up to the next ';' or the end (parse_rule_terms, spec.h).
  Rule parse_terms_at(size_t pos, size_t* end) {
    i_ = pos;
    Rule rule;
    parse_terms(rule);
    *end = i_;
    return rule;
  }

  [[noreturn]] void fail(size_t pos, const std::string& what, const std::string& expected) const {
    std::string echo = printable(s_, /*max_len=*/std::string::npos);
    TORCH_CHECK(false, label_, ": ", what, " at column ", pos + 1, " (expected ", expected,
                ")\n  ", echo, "\n  ", std::string(pos, ' '), "^");
  }

  Policy parse() {
    Policy policy;
    skip_ws();
    if (at_end()) fail(i_, "empty policy spec", "a rule such as type=Block, or 'none'");
    const size_t save = i_;
    if (ident() == "none") {
      skip_ws();
      if (at_end()) return policy;
      fail(i_, "unexpected " + quoted_token(i_) + " after 'none'", "end of spec");
    }
    i_ = save;
    while (true) {
      parse_item(policy);
      if (at_end()) return policy;
      ++i_;  // parse_item stops only at the end or at ';'
    }
  }

 private:
  // The token at `pos` for messages: a word or value up to the next delimiter, a single
  // punctuation character, or "end of spec".
  std::string quoted_token(size_t pos) const {
    if (pos >= s_.size()) return "end of spec";
    size_t end = pos;
    while (end < s_.size() && !ends_value(s_[end]) && s_[end] != '=' && s_[end] != ':' &&
           s_[end] != '>' && s_[end] != '<')
      ++end;
    if (end == pos) end = pos + 1;
    return "'" + printable(s_.substr(pos, end - pos)) + "'";
  }

  bool at_end() const { return i_ >= s_.size(); }
  char peek(size_t k = 0) const { return i_ + k < s_.size() ? s_[i_ + k] : '\0'; }
  bool peek_is(char c, size_t k = 0) const { return i_ + k < s_.size() && s_[i_ + k] == c; }
  void skip_ws() {
    while (!at_end() && is_space(s_[i_])) ++i_;
  }
  std::string ident() {
    const size_t start = i_;
    if (!at_end() && is_ident_start(s_[i_]))
      while (!at_end() && is_ident(s_[i_])) ++i_;
    return s_.substr(start, i_ - start);
  }
  // A single ':' (not the first of "::") follows, after optional blanks.
  bool colon_follows() {
    skip_ws();
    return peek_is(':') && !peek_is(':', 1);
  }

  void parse_item(Policy& policy) {
    skip_ws();
    const size_t start = i_;
    if (at_end() || peek_is(';'))
      fail(i_, "empty rule", "a rule such as type=Block (remove the extra ';')");
    Rule rule;
    const std::string word = ident();
    if (!word.empty() && (colon_follows() || peek_is('+'))) {
      if (word == "root" && peek_is(':')) {
        ++i_;  // ':'
        parse_root_options(policy, start);
        return;
      }
      if (peek_is(':') && (word == "type" || word == "path" || word == "every" || word == "size"))
        fail(i_, "unexpected ':' after '" + word + "'",
             std::string("'") + (word == "size" ? ">=" : "=") + "' after '" + word + "'");
      rule.options = parse_options(word, start);
    } else {
      i_ = start;
    }
    parse_terms(rule);
    policy.rules.push_back(std::move(rule));
  }

  void parse_terms(Rule& rule) {
    std::optional<size_t> every_pos;  // where this rule's every=K is, if it has one
    bool has_match_term = false;
    while (true) {
      skip_ws();
      parse_term(rule, &has_match_term, &every_pos);
      skip_ws();
      if (at_end() || peek_is(';')) break;
      if (!peek_is(','))
        fail(i_, "unexpected " + quoted_token(i_), "',' between terms or ';' between rules");
      const size_t comma = i_++;
      skip_ws();
      if (at_end() || peek_is(';'))
        fail(comma, "trailing ','", "another term after ',' (" + std::string(kKeys) + ")");
    }
    if (!has_match_term)
      fail(*every_pos, "'every' alone in a rule",
           "another term choosing what to group, as in every=2,type=Block");
  }

  // options := option ('+' option)* ':'  with `first` (at `first_pos`) already read; at most
  // one strategy word, one 'recompute' and one offload word.
  UnitOptions parse_options(const std::string& first, size_t first_pos) {
    UnitOptions o;
    std::string strategy_word;  // the strategy given so far, "" if none
    std::string word = first;
    size_t pos = first_pos;
    while (true) {
      if (word == "recompute") {
        if (o.recompute) fail(pos, "'recompute' given twice", "at most one 'recompute' per rule");
        o.recompute = true;
      } else if (auto level = offload_level_named(word)) {
        if (o.offload)
          fail(pos, "second offload option '" + word + "'", "at most one offload level per rule");
        o.offload = *level;
      } else if (auto gather = gather_named(word)) {
        if (o.gather_dtype)
          fail(pos, "second gather option '" + word + "'", "at most one gather dtype per rule");
        o.gather_dtype = *gather;
      } else {
        auto opts = option_named(word);
        if (!opts) fail(pos, "unknown option '" + word + "'", std::string(kOptions) + ", root");
        if (!strategy_word.empty())
          fail(pos, "second strategy '" + word + "' after '" + strategy_word + "'",
               "one strategy per rule (noshard, grad_op, full or keep), optionally +recompute");
        strategy_word = word;
        o.strategy = opts->strategy;
        o.reshard_after_forward = opts->reshard_after_forward;
      }
      skip_ws();
      if (!peek_is('+')) break;
      ++i_;
      skip_ws();
      pos = i_;
      word = ident();
      if (word.empty())
        fail(pos, at_end() ? "missing option after '+'" : "unexpected " + quoted_token(pos) +
                                                              " after '+'",
             kOptions);
    }
    if (!peek_is(':') || peek_is(':', 1))
      fail(i_, "unexpected " + quoted_token(i_) + " after the options",
           "':' and the rule's terms, as in keep+recompute:type=Block");
    ++i_;  // ':'
    return o;
  }

  void parse_root_options(Policy& policy, size_t root_pos) {
    if (root_seen_) fail(root_pos, "root options given twice", "at most one root:OPTION");
    root_seen_ = true;
    skip_ws();
    const size_t pos = i_;
    const std::string word = ident();
    if (word == "recompute")
      fail(pos, "'recompute' on the root unit",
           std::string(kRootOptions) + "; the root's forward is the whole model's, it is not "
           "recomputed (Note [Recompute])");
    auto opts = option_named(word);
    if (!opts)
      fail(pos, word.empty() ? "missing option after 'root:'" : "unknown option '" + word + "'",
           kRootOptions);
    policy.root_options = *opts;
    skip_ws();
    if (peek_is('+'))
      fail(i_, "'+' after the root option",
           "';' or end of spec; the root takes one strategy and is never recomputed");
    if (!at_end() && !peek_is(';'))
      fail(i_, "unexpected " + quoted_token(i_) + " after root option",
           "';' or end of spec; root:OPTION is a rule of its own");
  }

  void expect_operator(const std::string& key, const char* op) {
    skip_ws();
    const size_t pos = i_;
    for (const char* c = op; *c; ++c, ++i_)
      if (!peek_is(*c))
        fail(pos,
             at_end() ? std::string("missing '") + op + "'" : "unexpected " + quoted_token(pos),
             std::string("'") + op + "' after '" + key + "'");
    skip_ws();
  }

  void parse_term(Rule& rule, bool* has_match_term, std::optional<size_t>* every_pos) {
    const size_t pos = i_;
    const std::string key = ident();
    if (key.empty()) fail(pos, "unexpected " + quoted_token(pos), std::string("a term: ") + kKeys);
    const size_t after_key = i_;
    if (colon_follows()) {
      if (key == "root" || key == "recompute" || offload_level_named(key) || gather_named(key) ||
          option_named(key))
        fail(pos, "option prefix '" + key + ":' in the middle of a rule",
             "a term; a rule takes one prefix, first, and root:OPTION stands alone");
    }
    i_ = after_key;
    if (key == "type" || key == "path") {
      expect_operator(key, "=");
      Term t;
      t.kind = key == "type" ? Term::Kind::kType : Term::Kind::kPath;
      while (true) {
        t.names.push_back(key == "type" ? type_name() : glob());
        skip_ws();
        if (!peek_is('|')) break;
        ++i_;
        skip_ws();
      }
      rule.terms.push_back(std::move(t));
      *has_match_term = true;
    } else if (key == "size") {
      expect_operator(key, ">=");
      Term t;
      t.kind = Term::Kind::kSize;
      t.min_numel = count(key);
      rule.terms.push_back(std::move(t));
      *has_match_term = true;
    } else if (key == "every") {
      if (!allow_every_) fail(pos, "'every' in a " + label_, "one of: type, size, path");
      if (every_pos->has_value())
        fail(pos, "'every' given twice in one rule", "at most one every=K per rule");
      *every_pos = pos;
      expect_operator(key, "=");
      const size_t vpos = i_;
      const int64_t k = count(key);
      if (k < 1) fail(vpos, "group size " + std::to_string(k), "every=K with K >= 1");
      rule.every = k;
    } else {
      fail(pos, "unknown key '" + key + "'", kKeys);
    }
  }

  std::string type_name() {
    const size_t pos = i_;
    std::string name = ident();
    if (name.empty()) {
      const bool missing = at_end() || ends_value(peek());
      fail(pos, missing ? "missing value for 'type'" : "bad type name " + quoted_token(pos),
           "a type name such as Block or torch::nn::Linear");
    }
    while (peek_is(':') && peek_is(':', 1)) {
      i_ += 2;
      const size_t seg = i_;
      const std::string part = ident();
      if (part.empty())
        fail(seg, "unexpected " + quoted_token(seg) + " after '::'", "an identifier");
      name += "::" + part;
    }
    return name;
  }

  std::string glob() {
    const size_t pos = i_;
    while (!at_end() && !ends_value(peek())) ++i_;
    const std::string g = s_.substr(pos, i_ - pos);
    if (g.empty()) fail(pos, "missing value for 'path'", "a module path glob such as blocks.*");
    if (auto err = Glob::find_error(g))
      fail(pos + err->pos, err->what + " in glob '" + printable(g) + "'", err->expected);
    return g;
  }

  int64_t count(const std::string& key) {
    const size_t pos = i_;
    while (!at_end() && !ends_value(peek())) ++i_;
    const std::string tok = s_.substr(pos, i_ - pos);
    if (tok.empty()) fail(pos, "missing value for '" + key + "'", kCountHelp);
    std::string why;
    auto v = count_value(tok, &why);
    if (!v) fail(pos, "bad number '" + printable(tok) + "' (" + why + ")", kCountHelp);
    return *v;
  }

  const std::string& s_;
  std::string label_;  // what an error calls the input: "policy spec", "tp plan"
  bool allow_every_;
  size_t i_ = 0;
  bool root_seen_ = false;
};

}  // namespace

Policy parse_policy(const std::string& spec) { return Parser(spec).parse(); }

Rule parse_rule_terms(const std::string& spec, size_t pos, size_t* end, const std::string& label) {
  return Parser(spec, label, /*allow_every=*/false).parse_terms_at(pos, end);
}

void spec_error(const std::string& spec, size_t pos, const std::string& what,
                const std::string& expected, const std::string& label) {
  Parser(spec, label).fail(pos, what, expected);
}

int64_t parse_count(const std::string& text) {
  std::string why;
  auto v = count_value(text, &why);
  TORCH_CHECK(v, "bad count '", text, "': ", why, " (expected ", kCountHelp, ")");
  return *v;
}

}  // namespace flatshard
