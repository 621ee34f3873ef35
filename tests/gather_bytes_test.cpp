// collectives/gather_bytes.h on the threads backend: every rank ends with every rank's bytes,
// in rank order, for world sizes 1..4 and lengths 0, 1, odd and unequal, every byte value
// 0..255 included (each must survive the trip through fp32). Expected strings are built from a
// closed form, not read back through the code under test.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "collectives/gather_bytes.h"
#include "collectives/thread_communicator.h"

using flatshard::Communicator;

namespace {

// Rank r's bytes: `n` of them, cycling through all 256 values from an offset of r.
std::string rank_bytes(int r, size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((r * 37 + i) % 256);
  return s;
}

}  // namespace

TEST_CASE("all_gather_bytes: every rank gets every rank's bytes, in rank order",
          "[collectives][gather_bytes]") {
  for (int world = 1; world <= 4; ++world) {
    for (const bool lengths_known : {false, true}) {
      CAPTURE(world, lengths_known);
      // Unequal lengths: 0 on rank 0, then odd and longer than 256 (every byte value).
      auto length = [](int r) { return r == 0 ? size_t{0} : size_t{1} + 300 * (r - 1) + r; };
      std::vector<std::vector<std::string>> got(world);
      flatshard::run_ranks(world, [&](Communicator& c) {
        const std::string mine = rank_bytes(c.rank(), length(c.rank()));
        std::vector<int64_t> lens;
        for (int r = 0; r < world; ++r) lens.push_back(static_cast<int64_t>(length(r)));
        got[c.rank()] = lengths_known ? flatshard::all_gather_bytes(c, mine, lens)
                                      : flatshard::all_gather_bytes(c, mine);
      });
      for (int me = 0; me < world; ++me) {
        REQUIRE(got[me].size() == static_cast<size_t>(world));
        for (int r = 0; r < world; ++r) CHECK(got[me][r] == rank_bytes(r, length(r)));
      }
    }
  }
}

TEST_CASE("all_gather_bytes: wrong lengths and oversized input are refused naming the rank",
          "[collectives][gather_bytes][errors]") {
  CHECK_THROWS_WITH(
      flatshard::run_ranks(1, [](Communicator& c) { flatshard::all_gather_bytes(c, "abc", {2}); }),
      Catch::Contains("rank 0: lengths[0] = 2 but this rank has 3 bytes"));
  CHECK_THROWS_WITH(flatshard::run_ranks(1,
                                         [](Communicator& c) {
                                           flatshard::all_gather_bytes(c, "abc", {3, 3});
                                         }),
                    Catch::Contains("expected 1 lengths (one per rank), got 2"));
  CHECK_THROWS_WITH(
      flatshard::run_ranks(
          1, [](Communicator& c) { flatshard::all_gather_bytes(c, std::string(1 << 24, 'x')); }),
      Catch::Contains("16777216 bytes on rank 0"));
}
