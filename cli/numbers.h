// flatshard/cli/numbers.h — the numbers and values of a command line, read one way by every
// tool (flatshard-bench, flatshard-explain): decimal only, whole text, named on error.
//
// Contract
// - parse_integer(text, lo, hi): an optional '-' then decimal digits, nothing else (no sign '+',
//   no blanks, no base prefix: CLI11 alone reads "010" as 8 and "0x10" as 16), and a value in
//   [lo, hi]. Leading zeros are decimal ("010" is 10).
// - parse_unsigned(text): decimal digits only, in [0, 2^64 - 1] ("-1" is an error, not 2^64 - 1).
// - parse_number(text): a decimal real, [-]digits[.digits][e[+-]digits] (".5" and "5." too);
//   no hexadecimal ("0x10"), no inf or nan; finite.
// - Each throws std::invalid_argument with a one-line message carrying the text through
//   printable_escape() (support/input_file.h): "expected a decimal integer, got '0x10'",
//   "must be >= 1, got 0". The caller prefixes the flag.
// - The CLI11 validators (integer(), unsigned64(), number(), non_empty()) check an option's text
//   with the functions above before CLI11 converts it; integer() and unsigned64() also rewrite
//   it to its canonical decimal ("010" -> "10"), so CLI11's own conversion (base prefixes,
//   saturation) never sees anything but plain decimal: add those two with Option::transform()
//   (CLI11's check() runs a validator on a copy, and transforms run before every check, CLI::Range
//   included). CLI11 names the flag: "--world: expected a decimal integer, got '0x10'".
// - non_empty(what): "" is refused ("needs a size such as 40GiB, got ''"), for options whose
//   empty value would otherwise mean something (no limit, the default model).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <limits>
#include <string>

namespace flatshard {
namespace cli {

int64_t parse_integer(const std::string& text, int64_t lo = std::numeric_limits<int64_t>::min(),
                      int64_t hi = std::numeric_limits<int64_t>::max());
uint64_t parse_unsigned(const std::string& text);
double parse_number(const std::string& text);

// Validators (see the contract). integer()'s default range is an int's: most flags are ints.
CLI::Validator integer(int64_t lo = std::numeric_limits<int>::min(),
                       int64_t hi = std::numeric_limits<int>::max());
CLI::Validator unsigned64();
CLI::Validator number();
CLI::Validator non_empty(const std::string& what);

// `s` through printable_escape() line by line: control bytes shown as \xNN, the line breaks of a
// multi-line message (a policy spec's caret line) kept.
std::string escape_lines(const std::string& s);

}  // namespace cli
}  // namespace flatshard
