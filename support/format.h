// flatshard/support/format.h — text for people: byte sizes and column-aligned tables. The one
// formatter every report of flatshard uses (flatshard-explain's plan, flatshard-bench's table,
// flatshard-trace's summary), so the same quantity reads the same everywhere.
//
// Contract
// - format_bytes(): binary units (1 KiB = 1024 B), the largest unit that keeps the number at
//   least 1, one decimal: "512 B" (exact below 1 KiB), "1.5 KiB", "16.0 MiB", "2.0 GiB", up to
//   TiB. Negative sizes (differences) keep their sign: "-1.5 KiB".
// - format_fixed(): a number with `digits` decimals ("95.2"), for times, rates and ratios.
// - format_mib(): bytes as a bare number of MiB with `digits` decimals ("1.50"), for table
//   columns whose header names the unit ("peak MiB"), where every row shares it.
// - TextTable: a header row and rows of cells, all strings. Columns are as wide as their widest
//   cell, header included, and separated by two spaces; a right-aligned column (numbers) pads
//   on the left, a left-aligned one (names) on the right, except in the last column: no line
//   ends in blanks. Cells are written through printable_escape() (support/input_file.h): a
//   module or tensor name from a file cannot send control bytes to the terminal. Widths count
//   bytes of the escaped cells. A row with another number of cells than the header throws
//   c10::Error naming both counts.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace flatshard {

std::string format_bytes(int64_t bytes);
std::string format_fixed(double value, int digits);
std::string format_mib(int64_t bytes, int digits);

class TextTable {
 public:
  enum class Align { kLeft, kRight };

  // The first column left-aligned (a name), the others right-aligned (numbers).
  explicit TextTable(std::vector<std::string> header);
  // One alignment per header cell.
  TextTable(std::vector<std::string> header, std::vector<Align> align);

  TextTable& add_row(std::vector<std::string> cells);
  size_t num_rows() const { return rows_.size() - 1; }  // not counting the header

  // The header line, then one line per row, each ending in '\n'.
  std::string to_string() const;

 private:
  std::vector<std::vector<std::string>> rows_;  // rows_[0] is the header
  std::vector<Align> align_;
};

std::ostream& operator<<(std::ostream& os, const TextTable& table);

}  // namespace flatshard
