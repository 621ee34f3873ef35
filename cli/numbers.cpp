// flatshard/cli/numbers.cpp — see numbers.h for the contract.
#include "cli/numbers.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <stdexcept>

#include "support/input_file.h"

namespace flatshard {
namespace cli {

namespace {

bool all_digits(const std::string& s, size_t from) {
  return from < s.size() && s.find_first_not_of("0123456789", from) == std::string::npos;
}

std::string quoted(const std::string& text) { return "'" + printable_escape(text) + "'"; }

// Digits without their leading zeros ("" -> "0").
std::string strip_zeros(const std::string& digits) {
  const size_t first = digits.find_first_not_of('0');
  return first == std::string::npos ? "0" : digits.substr(first);
}

// a <= b for digit strings without leading zeros.
bool digits_le(const std::string& a, const std::string& b) {
  return a.size() != b.size() ? a.size() < b.size() : a <= b;
}

}  // namespace

int64_t parse_integer(const std::string& text, int64_t lo, int64_t hi) {
  const bool negative = !text.empty() && text[0] == '-';
  if (!all_digits(text, negative ? 1 : 0))
    throw std::invalid_argument("expected a decimal integer, got " + quoted(text));
  const std::string digits = strip_zeros(text.substr(negative ? 1 : 0));
  // |int64 min| = 9223372036854775808: beyond it the text is out of any range below.
  const std::string limit = negative ? "9223372036854775808" : "9223372036854775807";
  const bool fits = digits_le(digits, limit);
  int64_t v = 0;
  if (fits) {
    const uint64_t magnitude = std::strtoull(digits.c_str(), nullptr, 10);
    v = negative ? static_cast<int64_t>(0 - magnitude) : static_cast<int64_t>(magnitude);
  }
  if (!fits ? negative : v < lo)
    throw std::invalid_argument("must be >= " + std::to_string(lo) + ", got " + text);
  if (!fits || v > hi)
    throw std::invalid_argument("must be <= " + std::to_string(hi) + ", got " + text);
  return v;
}

uint64_t parse_unsigned(const std::string& text) {
  const std::string max = std::to_string(std::numeric_limits<uint64_t>::max());
  if (!all_digits(text, 0))
    throw std::invalid_argument("expected a decimal integer in [0, " + max + "], got " +
                                quoted(text));
  const std::string digits = strip_zeros(text);
  if (!digits_le(digits, max))
    throw std::invalid_argument(text + " is out of range [0, " + max + "] (2^64 - 1)");
  return std::strtoull(digits.c_str(), nullptr, 10);
}

double parse_number(const std::string& text) {
  // [-]digits[.digits][e[+-]digits], at least one mantissa digit.
  size_t pos = text.size() > 0 && text[0] == '-' ? 1 : 0;
  auto digits_at = [&](size_t i) {
    size_t n = 0;
    while (i + n < text.size() && text[i + n] >= '0' && text[i + n] <= '9') ++n;
    return n;
  };
  size_t mantissa = digits_at(pos);
  pos += mantissa;
  if (pos < text.size() && text[pos] == '.') {
    const size_t fraction = digits_at(pos + 1);
    mantissa += fraction;
    pos += 1 + fraction;
  }
  bool ok = mantissa > 0;
  if (ok && pos < text.size() && (text[pos] == 'e' || text[pos] == 'E')) {
    ++pos;
    if (pos < text.size() && (text[pos] == '+' || text[pos] == '-')) ++pos;
    const size_t exponent = digits_at(pos);
    ok = exponent > 0;
    pos += exponent;
  }
  if (!ok || pos != text.size())
    throw std::invalid_argument("expected a decimal number, got " + quoted(text));
  errno = 0;
  const double v = std::strtod(text.c_str(), nullptr);
  if (!std::isfinite(v) || errno == ERANGE)
    throw std::invalid_argument("is out of a double's range, got " + text);
  return v;
}

CLI::Validator integer(int64_t lo, int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        try {
          text = std::to_string(parse_integer(text, lo, hi));  // canonical: CLI11 reads decimal
          return "";
        } catch (const std::invalid_argument& e) {
          return e.what();
        }
      },
      "");  // the option's own type name (INT) says it
}

CLI::Validator unsigned64() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        try {
          text = std::to_string(parse_unsigned(text));
          return "";
        } catch (const std::invalid_argument& e) {
          return e.what();
        }
      },
      "");
}

CLI::Validator number() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        try {
          parse_number(text);
          return "";
        } catch (const std::invalid_argument& e) {
          return e.what();
        }
      },
      "NUMBER");
}

CLI::Validator non_empty(const std::string& what) {
  return CLI::Validator(
      [what](std::string& text) -> std::string {
        return text.empty() ? "needs " + what + ", got ''" : "";
      },
      "");
}

std::string escape_lines(const std::string& s) {
  std::string out;
  size_t begin = 0;
  while (true) {
    const size_t nl = s.find('\n', begin);
    out += printable_escape(s.substr(begin, nl == std::string::npos ? nl : nl - begin));
    if (nl == std::string::npos) return out;
    out += '\n';
    begin = nl + 1;
  }
}

}  // namespace cli
}  // namespace flatshard
