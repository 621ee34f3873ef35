// flatshard/support/format.cpp — see format.h for the contract.
#include "support/format.h"

#include "support/input_file.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <sstream>
#include <utility>

namespace flatshard {

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int i = 0;
  while (std::abs(v) >= 1024.0 && i < 4) {
    v /= 1024.0;
    ++i;
  }
  std::ostringstream os;
  if (i == 0) {
    os << bytes << " B";
  } else {
    os << std::fixed << std::setprecision(1) << v << ' ' << units[i];
  }
  return os.str();
}

std::string format_fixed(double value, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, value);
  return buf;
}

std::string format_mib(int64_t bytes, int digits) {
  return format_fixed(static_cast<double>(bytes) / (1 << 20), digits);
}

TextTable::TextTable(std::vector<std::string> header)
    : TextTable(header, std::vector<Align>(header.size(), Align::kRight)) {
  if (!align_.empty()) align_[0] = Align::kLeft;
}

TextTable::TextTable(std::vector<std::string> header, std::vector<Align> align)
    : align_(std::move(align)) {
  TORCH_CHECK(align_.size() == header.size(), "TextTable: ", align_.size(),
              " alignments for ", header.size(), " header cells");
  rows_.push_back(std::move(header));
}

TextTable& TextTable::add_row(std::vector<std::string> cells) {
  TORCH_CHECK(cells.size() == rows_[0].size(), "TextTable: row ", num_rows(), " has ",
              cells.size(), " cells, the header has ", rows_[0].size());
  for (auto& c : cells) c = printable_escape(c);  // names from files (the contract)
  rows_.push_back(std::move(cells));
  return *this;
}

std::string TextTable::to_string() const {
  const size_t columns = rows_[0].size();
  std::vector<size_t> width(columns, 0);
  for (const auto& r : rows_)
    for (size_t c = 0; c < columns; ++c) width[c] = std::max(width[c], r[c].size());
  std::string out;
  for (const auto& r : rows_) {
    for (size_t c = 0; c < columns; ++c) {
      const std::string fill(width[c] - r[c].size(), ' ');
      if (c) out += "  ";
      if (align_[c] == Align::kRight) out += fill;
      out += r[c];
      if (align_[c] == Align::kLeft && c + 1 < columns) out += fill;
    }
    out += '\n';
  }
  return out;
}

std::ostream& operator<<(std::ostream& os, const TextTable& table) {
  return os << table.to_string();
}

}  // namespace flatshard
