// flatshard/cli/byte_size.cpp — see byte_size.h for the contract.
#include "cli/byte_size.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>
#include <stdexcept>

#include "support/input_file.h"

namespace flatshard {
namespace cli {

int64_t parse_byte_size(const std::string& text) {
  auto bad = [&](const std::string& why) {
    return std::invalid_argument("'" + printable_escape(text) + "' " + why);
  };
  const std::string kSuffixes =
      "(suffixes: K/M/G/T/P/E or KiB/MiB/GiB/TiB/PiB/EiB = binary, KB/MB/GB/TB/PB/EB = decimal)";
  // The number: digits [. digits] [e [+-] digits], at least one mantissa digit.
  size_t pos = 0;
  std::string digits;  // the mantissa's digits, the point left out
  int64_t exp10 = 0;   // the mantissa is digits x 10^exp10
  auto is_digit = [&](size_t i) { return i < text.size() && text[i] >= '0' && text[i] <= '9'; };
  while (is_digit(pos)) digits += text[pos++];
  if (pos < text.size() && text[pos] == '.') {
    ++pos;
    while (is_digit(pos)) {
      digits += text[pos++];
      --exp10;
    }
  }
  if (digits.empty()) throw bad("is not a size such as 40GiB (decimal digits, then a suffix)");
  if (pos < text.size() && (text[pos] == 'x' || text[pos] == 'X'))
    throw bad("is not a size such as 40GiB (decimal digits only: hexadecimal is not read)");
  if (pos < text.size() && (text[pos] == 'e' || text[pos] == 'E') &&
      (is_digit(pos + 1) || ((text[pos + 1] == '+' || text[pos + 1] == '-') && is_digit(pos + 2)))) {
    ++pos;
    const bool negative = text[pos] == '-';
    if (text[pos] == '+' || text[pos] == '-') ++pos;
    int64_t e = 0;
    while (is_digit(pos)) e = std::min<int64_t>(e * 10 + (text[pos++] - '0'), 100000);
    exp10 += negative ? -e : e;
  }
  std::string suffix = text.substr(pos);
  for (auto& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  struct Scale {
    int pow2, pow10;
  };
  static const std::map<std::string, Scale> scale = {
      {"", {0, 0}},    {"B", {0, 0}},    {"K", {10, 0}},  {"KIB", {10, 0}}, {"KB", {0, 3}},
      {"M", {20, 0}},  {"MIB", {20, 0}}, {"MB", {0, 6}},  {"G", {30, 0}},   {"GIB", {30, 0}},
      {"GB", {0, 9}},  {"T", {40, 0}},   {"TIB", {40, 0}}, {"TB", {0, 12}}, {"P", {50, 0}},
      {"PIB", {50, 0}}, {"PB", {0, 15}}, {"E", {60, 0}},  {"EIB", {60, 0}}, {"EB", {0, 18}}};
  auto it = scale.find(suffix);
  if (it == scale.end()) throw bad("is not a size " + kSuffixes);
  exp10 += it->second.pow10;
  const int pow2 = it->second.pow2;
  // digits x 10^exp10 x 2^pow2, exactly: leading zeros and trailing zeros of the digits go.
  digits.erase(0, std::min(digits.find_first_not_of('0'), digits.size()));
  while (!digits.empty() && digits.back() == '0') {
    digits.pop_back();
    ++exp10;
  }
  const std::string at_most = "at most " + std::to_string(std::numeric_limits<int64_t>::max()) +
                              " bytes (8 EiB - 1 B, int64's max)";
  if (digits.empty()) throw bad("is below 1 byte: a limit is at least 1 byte, " + at_most);
  // Magnitude first (log10 of the value), then the exact value where it can be an int64.
  const double log10_value = static_cast<double>(digits.size() - 1) + static_cast<double>(exp10) +
                             pow2 * std::log10(2.0) + std::log10(std::stod("0." + digits) * 10);
  if (log10_value >= 19) throw bad("is too large: " + at_most);
  if (log10_value < -1e-9) throw bad("is below 1 byte: a limit is at least 1 byte, " + at_most);
  // Now digits has at most ~20 + |exp10| significant digits, exp10 > -40: exact in 128 bits.
  if (digits.size() > 36) throw bad("has more digits than a byte count can use");
  using u128 = unsigned __int128;
  u128 m = 0;
  for (char c : digits) m = m * 10 + static_cast<unsigned>(c - '0');
  for (; exp10 > 0; --exp10) m *= 10;
  int twos = pow2;  // m x 2^twos / 10^(-exp10)
  for (; exp10 < 0; ++exp10) {
    if (m % 5 != 0) throw bad("is not a whole number of bytes");
    m /= 5;
    if (twos > 0) {
      --twos;
    } else if (m % 2 == 0) {
      m /= 2;
    } else {
      throw bad("is not a whole number of bytes");
    }
  }
  for (; twos > 0; --twos) {
    m *= 2;
    if (m > static_cast<u128>(std::numeric_limits<int64_t>::max())) throw bad("is too large: " + at_most);
  }
  if (m > static_cast<u128>(std::numeric_limits<int64_t>::max())) throw bad("is too large: " + at_most);
  if (m < 1) throw bad("is below 1 byte: a limit is at least 1 byte, " + at_most);
  // A bare number was read as bytes: "--memory-limit 40" meant 40 GiB, not 40 B. The unit is
  // asked for last, so a value wrong for another reason says that first.
  if (suffix.empty())
    throw bad("has no unit: write " + text + "GiB (binary), " + text + "GB (decimal), or " +
              text + "B if you mean bytes");
  return static_cast<int64_t>(m);
}

CLI::Validator byte_size() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        try {
          parse_byte_size(text);
          return "";
        } catch (const std::invalid_argument& e) {
          return e.what();
        }
      },
      "SIZE");
}

}  // namespace cli
}  // namespace flatshard
