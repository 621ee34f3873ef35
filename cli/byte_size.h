// flatshard/cli/byte_size.h — a byte count from a command line, with its unit: "40GiB", "40G"
// (binary), "40GB" (decimal), "1.5TiB", "1e3MB", "123456B" (bytes). flatshard-explain's
// --memory-limit (docs/vocabulary.md "memory limit").
//
// Contract
// - parse_byte_size(text): decimal digits [. digits] [e [+-] digits], then a suffix: K/M/G/T/P/E
//   or KiB/MiB/GiB/TiB/PiB/EiB (binary), KB/MB/GB/TB/PB/EB (decimal), B (bytes); any case. A unit
//   is required ("40" alone is an error showing how to write it: a bare 40 meant 40 GiB, not
//   40 B). Hexadecimal is not read ("0x10GiB"). The value must be a whole number of bytes, at
//   least 1 and at most int64's max (8 EiB - 1 B); computed exactly (128-bit), not in floating
//   point. Errors throw std::invalid_argument, one line, the text through printable_escape():
//   "'40' has no unit: write 40GiB (binary), 40GB (decimal), or 40B if you mean bytes".
// - byte_size(): the CLI11 validator of the same rule (CLI11 prefixes the flag).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

namespace flatshard {
namespace cli {

int64_t parse_byte_size(const std::string& text);
CLI::Validator byte_size();

}  // namespace cli
}  // namespace flatshard
