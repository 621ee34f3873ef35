// Ranks that disagree: different models, plans, options or dtypes fail at fully_shard on every
// rank with the first difference named (fsdp/fingerprint.h); units called in different orders
// fail under FLATSHARD_DEBUG=1 (fsdp/order_check.h); the threads backend's size mismatch says
// what to check.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <mutex>

#include "fsdp/fingerprint.h"
#include "parity_util.h"
#include "reliability_util.h"
#include "tiny_net.h"

using namespace flatshard;
using namespace flatshard_test;

namespace {

// fully_shard on every rank with a per-rank model and options; returns each rank's error.
std::vector<std::string> shard_with(int world, std::function<int64_t(int)> width,
                                    std::function<std::vector<std::vector<std::string>>(int)> units,
                                    std::function<ShardingOptions(int)> options,
                                    std::function<at::ScalarType(int)> dtype = nullptr) {
  std::vector<std::string> errors(world);
  std::mutex mu;
  run_ranks(world, [&](Communicator& comm) {
    const int r = comm.rank();
    auto net = TinyNet(5, width(r), 4);
    init_params(*net, 1);
    if (dtype) net->to(dtype(r));
    try {
      auto fsdp = fully_shard(net.ptr(), manual_plan(*net, units(r)), comm, options(r));
    } catch (const c10::Error& e) {
      std::lock_guard<std::mutex> lock(mu);
      errors[r] = e.what_without_backtrace();
    }
  }, std::chrono::milliseconds(20000));
  return errors;
}

std::vector<std::vector<std::string>> per_layer() {
  return {{"blocks.0"}, {"blocks.1"}, {"blocks.2"}, {"blocks.3"}};
}

}  // namespace

TEST_CASE("ranks with different parameter shapes fail at setup, naming the parameter",
          "[reliability][fingerprint]") {
  auto errors = shard_with(
      3, [](int r) { return r == 2 ? 8 : 7; }, [](int) { return per_layer(); },
      [](int) { return ShardingOptions{}; });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r, errors[r]);
    // Every rank, not just the odd one, fails with the same description.
    CHECK_THAT(errors[r], Catch::Contains("rank 2 differs from rank 0 at unit 0 '<root>': param "
                                          "'inp.weight' shape [8, 5] vs [7, 5]"));
  }
}

TEST_CASE("ranks with different plans, options or dtypes fail at setup", "[reliability][fingerprint]") {
  SECTION("plan") {
    auto errors = shard_with(
        2, [](int) { return 7; },
        [](int r) {
          return r == 0 ? per_layer()
                        : std::vector<std::vector<std::string>>{{"blocks.0", "blocks.1"},
                                                                {"blocks.2", "blocks.3"}};
        },
        [](int) { return ShardingOptions{}; });
    for (auto& e : errors) CHECK_THAT(e, Catch::Contains("rank 1 differs from rank 0 at setup: plan units 3 vs 5"));
  }
  SECTION("options") {
    auto errors = shard_with(
        2, [](int) { return 7; }, [](int) { return per_layer(); },
        [](int r) {
          ShardingOptions o;
          if (r == 1) o.mixed_precision.param_dtype = at::kBFloat16;
          return o;
        });
    for (auto& e : errors)
      CHECK_THAT(e, Catch::Contains("at setup: option mixed_precision.param_dtype BFloat16 vs Float"));
  }
  SECTION("dtype") {
    auto errors = shard_with(
        2, [](int) { return 7; }, [](int) { return per_layer(); },
        [](int) { return ShardingOptions{}; },
        [](int r) { return r == 1 ? at::kDouble : at::kFloat; });
    for (auto& e : errors)
      CHECK_THAT(e, Catch::Contains("at unit 0 '<root>': param 'inp.weight' dtype Double vs Float"));
  }
  SECTION("agreeing ranks pass") {
    auto errors = shard_with(
        4, [](int) { return 7; }, [](int) { return per_layer(); },
        [](int) { return ShardingOptions{}; });
    for (auto& e : errors) CHECK(e.empty());
  }
}

TEST_CASE("describe_difference: first differing entry, or the extra one", "[reliability][fingerprint]") {
  std::vector<FingerprintEntry> a = {{"setup", "world size", "2"}, {"unit 1 'x'", "name", "x"}};
  auto b = a;
  CHECK(describe_difference(a, 0, b, 1).empty());
  b[1].value = "y";
  CHECK(describe_difference(a, 0, b, 1) == "rank 1 differs from rank 0 at unit 1 'x': name y vs x");
  b = a;
  b.push_back({"unit 2 'z'", "name", "z"});
  CHECK(describe_difference(a, 0, b, 3) ==
        "rank 3 differs from rank 0 at unit 2 'z': rank 3 has name z, which rank 0 lacks");
  b = {a[0], {"unit 1 'q'", "modules", "1"}};
  CHECK_THAT(describe_difference(a, 0, b, 1),
             Catch::Contains("at unit 1 'q': it has modules 1 where rank 0 has unit 1 'x': name x"));
}

TEST_CASE("units called in different orders: FLATSHARD_DEBUG=1 names them",
          "[reliability][order]") {
  // Two units of equal size: without the debug check, swapping them exchanges the wrong shards
  // silently (the collectives' sizes agree), which is what this mode exists for.
  auto run = [](bool debug) {
    if (debug) ::setenv("FLATSHARD_DEBUG", "1", 1);
    std::string error;
    std::mutex mu;
    try {
      run_ranks(2, [&](Communicator& comm) {
        auto net = TwoPath(comm.rank() == 1);
        auto fsdp = fully_shard(net.ptr(), manual_plan(*net, {{"a"}, {"b"}}), comm);
        auto y = flatshard::call(net, at::ones({2, 4}));
        y.sum().backward();
      }, std::chrono::milliseconds(20000));
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
    ::unsetenv("FLATSHARD_DEBUG");
    return error;
  };
  CHECK(run(false).empty());  // the hazard: nothing notices
  const std::string e = run(true);
  CHECK_THAT(e, Catch::Contains("FLATSHARD_DEBUG: ranks enter different units in forward at "
                                "position 1: rank 0 enters unit 1 'a', rank 1 enters unit 2 'b'"));
}

TEST_CASE("threads backend: mismatched collectives say what to check", "[reliability][order]") {
  // Rank 1 skips unit 'a' (different sizes): the backend reports the mismatch and the hint.
  std::string error;
  try {
    run_ranks(2, [&](Communicator& comm) {
      auto net = TwoPath(false, /*skip_a=*/comm.rank() == 1, /*b_width=*/6);
      auto fsdp = fully_shard(net.ptr(), manual_plan(*net, {{"a"}, {"b"}}), comm);
      flatshard::call(net, at::ones({2, 4})).sum().backward();
    }, std::chrono::milliseconds(20000));
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  }
  CHECK_THAT(error, Catch::Contains("ranks disagree in collective") &&
                        Catch::Contains("call the same units in the same order") &&
                        Catch::Contains("FLATSHARD_DEBUG=1"));
}
