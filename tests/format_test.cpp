// support/format.h: byte sizes against hand-computed texts (unit boundaries, rounding, the TiB
// cap, negative differences) and TextTable layouts written out character by character.
#include <catch2/catch.hpp>

#include <sstream>
#include <string>

#include "support/format.h"

using flatshard::format_bytes;
using flatshard::format_mib;
using flatshard::TextTable;

TEST_CASE("format_bytes: binary units, one decimal, exact bytes below 1 KiB", "[format]") {
  CHECK(format_bytes(0) == "0 B");
  CHECK(format_bytes(1) == "1 B");
  CHECK(format_bytes(1023) == "1023 B");
  CHECK(format_bytes(1024) == "1.0 KiB");
  CHECK(format_bytes(1536) == "1.5 KiB");
  CHECK(format_bytes(1024 * 1024 - 1) == "1024.0 KiB");  // 1023.999 KiB rounds up, still KiB
  CHECK(format_bytes(int64_t{1} << 20) == "1.0 MiB");
  CHECK(format_bytes(int64_t{16} << 20) == "16.0 MiB");
  CHECK(format_bytes(int64_t{3} << 29) == "1.5 GiB");
  CHECK(format_bytes(int64_t{1} << 40) == "1.0 TiB");
  CHECK(format_bytes(int64_t{1} << 50) == "1024.0 TiB");  // TiB is the largest unit
  CHECK(format_bytes(-1536) == "-1.5 KiB");
  CHECK(format_bytes(-5) == "-5 B");
}

TEST_CASE("format_mib: a bare number of MiB", "[format]") {
  CHECK(format_mib(0, 2) == "0.00");
  CHECK(format_mib(int64_t{3} << 19, 2) == "1.50");
  CHECK(format_mib(int64_t{5} << 20, 0) == "5");
  CHECK(format_mib(1024, 3) == "0.001");  // 1/1024 MiB
}

TEST_CASE("TextTable: first column left, numbers right, two spaces apart", "[format]") {
  TextTable t({"name", "n"});
  t.add_row({"a", "10"}).add_row({"long", "2"});
  CHECK(t.num_rows() == 2);
  CHECK(t.to_string() ==
        "name   n\n"
        "a     10\n"
        "long   2\n");
  std::ostringstream os;
  os << t;
  CHECK(os.str() == t.to_string());
}

TEST_CASE("TextTable: explicit alignments; a left last column gets no trailing blanks",
          "[format]") {
  using A = TextTable::Align;
  TextTable t({"#", "unit", "note"}, {A::kRight, A::kLeft, A::kLeft});
  t.add_row({"1", "x", "short"});
  t.add_row({"10", "yy", "z"});
  CHECK(t.to_string() ==
        " #  unit  note\n"
        " 1  x     short\n"
        "10  yy    z\n");
  // A header alone is a table too.
  CHECK(TextTable({"only"}).to_string() == "only\n");
}

TEST_CASE("TextTable: a row of the wrong width is an error naming both counts",
          "[format][errors]") {
  TextTable t({"a", "b"});
  t.add_row({"1", "2"});
  CHECK_THROWS_WITH(t.add_row({"x"}), Catch::Contains("row 1 has 1 cells, the header has 2"));
  CHECK(t.num_rows() == 1);  // the bad row was not added
  using A = TextTable::Align;
  CHECK_THROWS_WITH(TextTable({"a", "b"}, {A::kLeft}),
                    Catch::Contains("1 alignments for 2 header cells"));
}
