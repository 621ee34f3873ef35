// Catch2 assertions inside run_ranks threads.
//
// Catch2 (v2) assertions are not thread-safe: ranks asserting at the same time race on the test
// runner's state (seen as heap corruption when a rank thread exits). These serialise them; a
// failure still throws, and run_ranks rethrows it on the test's thread. CAPTURE and INFO are no
// safer: use them on the test's thread, outside run_ranks (tests/rank_thread_lint.py checks).
#pragma once

#include <catch2/catch.hpp>

#include <mutex>

namespace flatshard_test {
inline std::mutex& catch_mutex() {
  static std::mutex m;
  return m;
}
}  // namespace flatshard_test

#define FLATSHARD_RANK_ASSERT(macro, ...)                                           \
  do {                                                                              \
    std::lock_guard<std::mutex> rank_assert_lock_(::flatshard_test::catch_mutex()); \
    macro(__VA_ARGS__);                                                             \
  } while (false)
#define RANK_REQUIRE(...) FLATSHARD_RANK_ASSERT(REQUIRE, __VA_ARGS__)
#define RANK_REQUIRE_FALSE(...) FLATSHARD_RANK_ASSERT(REQUIRE_FALSE, __VA_ARGS__)
#define RANK_REQUIRE_THROWS_WITH(...) FLATSHARD_RANK_ASSERT(REQUIRE_THROWS_WITH, __VA_ARGS__)
#define RANK_CHECK(...) FLATSHARD_RANK_ASSERT(CHECK, __VA_ARGS__)
#define RANK_REQUIRE_THAT(...) FLATSHARD_RANK_ASSERT(REQUIRE_THAT, __VA_ARGS__)
