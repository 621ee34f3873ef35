#include "wrap_policies/tp_plan.h"

#include <c10/util/Exception.h>

#include "wrap_policies/spec.h"

namespace flatshard {

namespace {

const char* const kLabel = "tp plan";
const char* const kStyles =
    "one of: colwise, colwise/K, rowwise, vocab, replicate, sequence, or the option "
    "sequence_parallel "
    "or loss_parallel";
constexpr int kMaxParts = 64;

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}
bool is_word(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }

size_t skip_ws(const std::string& s, size_t i) {
  while (i < s.size() && is_space(s[i])) ++i;
  return i;
}

// style ':' at `i`; returns the index after ':'.
size_t parse_style(const std::string& s, size_t i, TpRule* rule) {
  const size_t start = i;
  while (i < s.size() && is_word(s[i])) ++i;
  const std::string word = s.substr(start, i - start);
  if (word == "colwise") {
    rule->style = TpStyle::kColwise;
  } else if (word == "rowwise") {
    rule->style = TpStyle::kRowwise;
  } else if (word == "vocab") {
    rule->style = TpStyle::kVocab;
  } else if (word == "replicate") {
    rule->style = TpStyle::kReplicate;
  } else if (word == "sequence") {
    rule->style = TpStyle::kSequence;
  } else if (word.empty()) {
    spec_error(s, start, i >= s.size() ? "missing style" : "unexpected '" + s.substr(i, 1) + "'",
               kStyles, kLabel);
  } else {
    spec_error(s, start, "unknown style '" + word + "'", kStyles, kLabel);
  }
  if (i < s.size() && s[i] == '/') {
    if (rule->style != TpStyle::kColwise)
      spec_error(s, i, "'/' after '" + word + "'", "':'; only colwise takes /K (fused blocks)",
                 kLabel);
    const size_t k_pos = ++i;
    int64_t k = 0;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9' && k <= kMaxParts) k = k * 10 + (s[i++] - '0');
    if (i == k_pos || k < 2 || k > kMaxParts)
      spec_error(s, k_pos, "bad block count after 'colwise/'",
                 "a whole number from 2 to " + std::to_string(kMaxParts) + ", as in colwise/3",
                 kLabel);
    rule->parts = static_cast<int>(k);
  }
  i = skip_ws(s, i);
  if (i >= s.size() || s[i] != ':')
    spec_error(s, i, i >= s.size() ? "missing ':' after '" + word + "'" : "unexpected '" + s.substr(i, 1) + "'",
               "':' and the rule's terms, as in " + word + ":path=*.q_proj", kLabel);
  return i + 1;
}

}  // namespace

const char* to_string(TpStyle style) {
  switch (style) {
    case TpStyle::kReplicate: return "replicate";
    case TpStyle::kColwise: return "colwise";
    case TpStyle::kRowwise: return "rowwise";
    case TpStyle::kSequence: return "sequence";
    case TpStyle::kVocab: return "vocab";
  }
  return "?";
}

std::string style_text(const TpRule& rule) {
  std::string t = to_string(rule.style);
  if (rule.parts > 1) t += "/" + std::to_string(rule.parts);
  return t;
}

TpPlan parse_tp_plan(const std::string& spec) {
  TpPlan plan;
  size_t i = skip_ws(spec, 0);
  if (i >= spec.size())
    spec_error(spec, i, "empty tp plan", "a rule such as colwise:path=*.q_proj, or 'none'", kLabel);
  if (spec.compare(i, 4, "none") == 0) {
    const size_t after = skip_ws(spec, i + 4);
    if (after >= spec.size()) return plan;
    if (i + 4 < spec.size() && !is_word(spec[i + 4]))
      spec_error(spec, after, "unexpected text after 'none'", "end of plan", kLabel);
  }
  while (true) {
    i = skip_ws(spec, i);
    if (i >= spec.size() || spec[i] == ';')
      spec_error(spec, i, "empty rule", "a rule such as rowwise:path=*.o_proj (remove the extra ';')",
                 kLabel);
    // An option: a bare word followed by ';' or the end.
    size_t w = i;
    while (w < spec.size() && is_word(spec[w])) ++w;
    const std::string word = spec.substr(i, w - i);
    const size_t after = skip_ws(spec, w);
    if ((word == "sequence_parallel" || word == "loss_parallel") &&
        (after >= spec.size() || spec[after] == ';')) {
      (word == "sequence_parallel" ? plan.sequence_parallel : plan.loss_parallel) = true;
      if (after >= spec.size()) return plan;
      i = after + 1;
      continue;
    }
    TpRule rule;
    i = parse_style(spec, i, &rule);
    size_t end = i;
    rule.match = parse_rule_terms(spec, i, &end, kLabel);
    plan.rules.push_back(std::move(rule));
    if (end >= spec.size()) return plan;
    i = end + 1;  // ';'
  }
}

std::string TpPlan::to_spec() const {
  if (empty()) return "none";
  std::string out;
  for (const TpRule& r : rules) {
    if (!out.empty()) out += ';';
    out += style_text(r) + ":" + flatshard::to_spec(r.match);
  }
  if (sequence_parallel) out += std::string(out.empty() ? "" : ";") + "sequence_parallel";
  if (loss_parallel) out += std::string(out.empty() ? "" : ";") + "loss_parallel";
  return out;
}

Policy TpPlan::match_policy() const {
  Policy p;
  for (const TpRule& r : rules) p.rules.push_back(r.match);
  return p;
}

}  // namespace flatshard
