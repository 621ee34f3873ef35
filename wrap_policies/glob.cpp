// flatshard/wrap_policies/glob.cpp — see glob.h for the syntax.
#include "wrap_policies/glob.h"

#include <c10/util/Exception.h>

namespace flatshard {

bool Glob::Atom::accepts(char c) const {
  switch (kind) {
    case Kind::kLiteral:
      return c == literal;
    case Kind::kAnyChar:
      return true;
    case Kind::kStar:
      return false;  // handled by the matcher
    case Kind::kSet: {
      bool in = false;
      for (const auto& [lo, hi] : ranges) in = in || (lo <= c && c <= hi);
      return in != negate;
    }
  }
  return false;
}

std::optional<Glob::Error> Glob::compile(const std::string& p, std::vector<Atom>* atoms) {
  for (size_t i = 0; i < p.size(); ++i) {
    Atom a;
    if (p[i] == '*') {
      a.kind = Atom::Kind::kStar;
      // "**" is the same as "*"; one atom keeps the matcher's backtracking simple.
      if (!atoms->empty() && atoms->back().kind == Atom::Kind::kStar) continue;
    } else if (p[i] == '?') {
      a.kind = Atom::Kind::kAnyChar;
    } else if (p[i] == '[') {
      const size_t open = i;
      a.kind = Atom::Kind::kSet;
      size_t j = i + 1;
      if (j < p.size() && (p[j] == '!' || p[j] == '^')) {
        a.negate = true;
        ++j;
      }
      const size_t first = j;
      bool closed = false;
      for (; j < p.size(); ++j) {
        if (p[j] == ']' && j > first) {
          closed = true;
          break;
        }
        char lo = p[j], hi = p[j];
        if (j + 2 < p.size() && p[j + 1] == '-' && p[j + 2] != ']') {
          hi = p[j + 2];
          if (hi < lo)
            return Error{j, std::string("empty range '") + lo + "-" + hi + "'",
                         "a range low-high with low <= high"};
          j += 2;
        }
        a.ranges.emplace_back(lo, hi);
      }
      if (!closed) return Error{open, "unterminated '['", "a closing ']'"};
      i = j;
    } else {
      a.kind = Atom::Kind::kLiteral;
      a.literal = p[i];
    }
    atoms->push_back(std::move(a));
  }
  return std::nullopt;
}

std::optional<Glob::Error> Glob::find_error(const std::string& pattern) {
  std::vector<Atom> atoms;
  return compile(pattern, &atoms);
}

Glob::Glob(const std::string& pattern) : pattern_(pattern) {
  auto err = compile(pattern, &atoms_);
  if (err)
    TORCH_CHECK(false, "path glob '", pattern, "': ", err->what, " at offset ", err->pos,
                " (expected ", err->expected, ")");
}

bool Glob::matches(const std::string& text) const {
  // Greedy match with one backtrack point: the most recent '*' and where in `text` it resumed.
  // Enough for globs because a later '*' can absorb anything an earlier one could.
  size_t a = 0, t = 0;
  size_t star = atoms_.size(), star_t = 0;
  while (t < text.size()) {
    if (a < atoms_.size() && atoms_[a].kind == Atom::Kind::kStar) {
      star = a++;
      star_t = t;
    } else if (a < atoms_.size() && atoms_[a].accepts(text[t])) {
      ++a;
      ++t;
    } else if (star != atoms_.size()) {
      a = star + 1;
      t = ++star_t;
    } else {
      return false;
    }
  }
  while (a < atoms_.size() && atoms_[a].kind == Atom::Kind::kStar) ++a;
  return a == atoms_.size();
}

}  // namespace flatshard
