// flatshard/wrap_policies/glob.h — shell-style globs over module paths ("blocks.1?", "*.mlp").
//
// Syntax (Python fnmatch without escapes; the whole path must match):
//   *        any run of characters, possibly empty, INCLUDING dots: "blocks.*" matches
//            "blocks.0" and also "blocks.0.mlp.fc1"; "*.mlp" matches "mlp" only under a parent
//   ?        exactly one character (a dot too)
//   [set]    one character from the set: single characters and ranges "a-z"; a ']' right after
//            '[' (or "[!") is a literal; "[!set]" (or "[^set]") negates
//   other    itself, case-sensitive
// A malformed pattern (an unterminated '[', a reversed range "[z-a]") is an error: see
// Glob::find_error. Matching is linear-time backtracking on the last '*' (no exponential
// blow-up on patterns like "*a*a*a*b").
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace flatshard {

class Glob {
 public:
  struct Error {
    size_t pos;            // byte offset into the pattern of the offending character
    std::string what;      // what is wrong, e.g. "unterminated '['"
    std::string expected;  // what would be right, e.g. "a closing ']'"
  };

  // Throws c10::Error (with the pattern and the position) when the pattern is malformed.
  explicit Glob(const std::string& pattern);

  // nullopt when `pattern` is well-formed.
  static std::optional<Error> find_error(const std::string& pattern);

  bool matches(const std::string& text) const;
  const std::string& pattern() const { return pattern_; }

 private:
  struct Atom {
    enum class Kind { kLiteral, kAnyChar, kStar, kSet } kind;
    char literal = 0;
    bool negate = false;
    std::vector<std::pair<char, char>> ranges;  // kSet: inclusive ranges (a char is {c, c})
    bool accepts(char c) const;
  };
  // Parses `pattern`; on error returns it and leaves `atoms` partial.
  static std::optional<Error> compile(const std::string& pattern, std::vector<Atom>* atoms);

  std::string pattern_;
  std::vector<Atom> atoms_;
};

}  // namespace flatshard
