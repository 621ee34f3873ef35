// Closed-form checks of every collective of the CPU (threads) backend: world sizes 1..4, counts
// 0, 1, odd and large, float32, bfloat16 and float16, in-place variants, and argument errors.
#include <catch2/catch.hpp>

#include <ATen/ATen.h>

#include <cmath>

#include "collectives/thread_communicator.h"
#include "rank_require.h"

using flatshard::Communicator;
using flatshard::ReduceOp;

namespace {

// Rank r's element i is `value(r, i)`: small integers, exact in bf16 and in sums of <= 4 ranks.
double value(int r, int64_t i) { return static_cast<double>((r + 1) * 10 + (i % 7)); }

at::Tensor rank_tensor(int r, int64_t n, at::ScalarType dt, int64_t offset = 0) {
  auto t = at::empty({n}, at::kDouble);
  auto* p = t.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) p[i] = value(r, i + offset);
  return t.to(dt);
}

const std::vector<int64_t> kCounts = {0, 1, 7, 1000, 65537};
const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16, at::kHalf};

}  // namespace

TEST_CASE("all_gather: output slot r holds rank r's input", "[collectives]") {
  for (int world = 1; world <= 4; ++world)
    for (int64_t n : kCounts)
      for (auto dt : kDtypes)
        for (bool in_place : {false, true}) {
          CAPTURE(world, n, dt, in_place);
          flatshard::run_ranks(world, [&](Communicator& c) {
            const int r = c.rank();
            auto out = at::full({n * world}, -1.0, at::TensorOptions().dtype(dt));
            at::Tensor in = rank_tensor(r, n, dt);
            if (in_place) {
              out.narrow(0, r * n, n).copy_(in);
              in = out.narrow(0, r * n, n);
            }
            c.all_gather(in, out, c.current_stream());
            for (int q = 0; q < world; ++q)
              RANK_REQUIRE(at::equal(out.narrow(0, q * n, n), rank_tensor(q, n, dt)));
          });
        }
}

TEST_CASE("reduce_scatter: sum and avg over ranks of the rank's slice", "[collectives]") {
  for (int world = 1; world <= 4; ++world)
    for (int64_t n : kCounts)
      for (auto dt : kDtypes)
        for (auto op : {ReduceOp::kSum, ReduceOp::kAvg})
          for (bool in_place : {false, true}) {
            CAPTURE(world, n, dt, flatshard::to_string(op), in_place);
            flatshard::run_ranks(world, [&](Communicator& c) {
              const int r = c.rank();
              auto in = rank_tensor(r, n * world, dt);
              at::Tensor out = in_place ? in.narrow(0, r * n, n) : at::empty({n}, in.options());
              c.reduce_scatter(in, out, op, c.current_stream());
              // Closed form: sum_q value(q, r*n + i) = sum_q (q+1)*10 + world * ((r*n+i) % 7).
              auto expect = at::empty({n}, at::kDouble);
              auto* p = expect.data_ptr<double>();
              for (int64_t i = 0; i < n; ++i) {
                double s = 10.0 * world * (world + 1) / 2 + world * ((r * n + i) % 7);
                p[i] = op == ReduceOp::kAvg ? s / world : s;
              }
              RANK_REQUIRE(at::equal(out, expect.to(dt)));
            });
          }
}

TEST_CASE("all_reduce: sum and avg, in place", "[collectives]") {
  for (int world = 1; world <= 4; ++world)
    for (int64_t n : kCounts)
      for (auto dt : kDtypes)
        for (auto op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          CAPTURE(world, n, dt, flatshard::to_string(op));
          flatshard::run_ranks(world, [&](Communicator& c) {
            auto t = rank_tensor(c.rank(), n, dt);
            c.all_reduce(t, op, c.current_stream());
            auto expect = at::empty({n}, at::kDouble);
            auto* p = expect.data_ptr<double>();
            for (int64_t i = 0; i < n; ++i) {
              double s = 10.0 * world * (world + 1) / 2 + world * (i % 7);
              p[i] = op == ReduceOp::kAvg ? s / world : s;
            }
            RANK_REQUIRE(at::equal(t, expect.to(dt)));
          });
        }
}

TEST_CASE("broadcast: every rank ends with the root's tensor", "[collectives]") {
  for (int world = 1; world <= 4; ++world)
    for (int64_t n : kCounts)
      for (auto dt : kDtypes)
        for (int root = 0; root < world; ++root) {
          CAPTURE(world, n, dt, root);
          flatshard::run_ranks(world, [&](Communicator& c) {
            auto t = rank_tensor(c.rank(), n, dt);
            c.broadcast(t, root, c.current_stream());
            RANK_REQUIRE(at::equal(t, rank_tensor(root, n, dt)));
          });
        }
}

TEST_CASE("counters count calls and bytes", "[collectives]") {
  flatshard::run_ranks(2, [](Communicator& c) {
    auto in = at::ones({5});
    auto out = at::empty({10});
    c.all_gather(in, out, c.current_stream());
    c.reduce_scatter(out, in, ReduceOp::kSum, c.current_stream());
    c.all_reduce(in, ReduceOp::kSum, c.current_stream());
    c.barrier();
    RANK_REQUIRE(c.counters().all_gathers == 1);
    RANK_REQUIRE(c.counters().reduce_scatters == 1);
    RANK_REQUIRE(c.counters().all_reduces == 1);
    RANK_REQUIRE(c.counters().bytes == (5 + 10 + 5) * 4);
  });
}

TEST_CASE("all_reduce max: the largest rank's values; uint8 all_gather; NaN propagates",
          "[collectives]") {
  // kMax and uint8 exist for the quantized gathers (flat_param/quantized_gather.h).
  for (int world = 1; world <= 4; ++world)
    for (int64_t n : kCounts) {
      CAPTURE(world, n);
      flatshard::run_ranks(world, [&](Communicator& c) {
        // Rank r's element i is value(r, i) for even i and value(world - 1 - r, i) for odd i:
        // either way the max over ranks is value(world - 1, i).
        auto t = at::empty({n}, at::kDouble);
        for (int64_t i = 0; i < n; ++i)
          t[i] = value(i % 2 ? world - 1 - c.rank() : c.rank(), i);
        t = t.to(at::kFloat);
        c.all_reduce(t, ReduceOp::kMax, c.current_stream(), flatshard::Lane::kAllGather);
        RANK_REQUIRE(at::equal(t, rank_tensor(world - 1, n, at::kFloat)));
        // Bytes: rank r sends n bytes of value r.
        auto out = at::zeros({n * world}, at::kByte);
        c.all_gather(at::full({n}, c.rank() + 200, at::kByte), out, c.current_stream());
        for (int q = 0; q < world; ++q)
          RANK_REQUIRE(at::equal(out.narrow(0, q * n, n), at::full({n}, q + 200, at::kByte)));
      });
    }
  flatshard::run_ranks(3, [](Communicator& c) {
    auto t = at::full({2}, 1.0f);
    if (c.rank() == 1) t[1] = std::nanf("");
    c.all_reduce(t, ReduceOp::kMax, c.current_stream());
    RANK_REQUIRE(t[0].item<float>() == 1.0f);
    RANK_REQUIRE(std::isnan(t[1].item<float>()));
  });
}

TEST_CASE("bad arguments give clear errors naming call and rank", "[collectives][errors]") {
  flatshard::run_ranks(1, [](Communicator& c) {
    auto s = c.current_stream();
    REQUIRE_THROWS_WITH(c.all_gather(at::ones({3}), at::empty({4}), s),
                        Catch::Contains("all_gather (rank 0): output has 4 elements") &&
                            Catch::Contains("3 * 1 = 3"));
    REQUIRE_THROWS_WITH(c.all_gather(at::ones({3}), at::empty({3}, at::kBFloat16), s),
                        Catch::Contains("input dtype Float differs from output dtype BFloat16"));
    REQUIRE_THROWS_WITH(c.all_reduce(at::ones({3}, at::kDouble), ReduceOp::kSum, s),
                        Catch::Contains("dtype Double") &&
                            Catch::Contains("float32, bfloat16 and float16"));
    auto nc = at::ones({4, 4}).t();
    REQUIRE_THROWS_WITH(c.all_reduce(nc, ReduceOp::kSum, s), Catch::Contains("must be contiguous"));
    REQUIRE_THROWS_WITH(c.reduce_scatter(at::ones({5}), at::empty({2}), ReduceOp::kSum, s),
                        Catch::Contains("reduce_scatter (rank 0): input has 5 elements"));
    REQUIRE_THROWS_WITH(c.broadcast(at::ones({2}), 3, s), Catch::Contains("root 3 out of range"));
    // Bytes are gathered, never reduced.
    REQUIRE_THROWS_WITH(c.all_reduce(at::ones({3}, at::kByte), ReduceOp::kMax, s),
                        Catch::Contains("all_reduce (rank 0): tensor has dtype Byte"));
    REQUIRE_THROWS_WITH(c.reduce_scatter(at::ones({3}, at::kByte), at::empty({3}, at::kByte),
                                         ReduceOp::kSum, s),
                        Catch::Contains("dtype Byte"));
  });
}

TEST_CASE("ranks that disagree fail on every rank with the first difference", "[collectives][errors]") {
  REQUIRE_THROWS_WITH(flatshard::run_ranks(2,
                                           [](Communicator& c) {
                                             auto t = at::ones({c.rank() == 0 ? 4 : 5});
                                             c.all_reduce(t, ReduceOp::kSum, c.current_stream());
                                           }),
                      Catch::Contains("ranks disagree") && Catch::Contains("input numel=4") &&
                          Catch::Contains("input numel=5"));
}

TEST_CASE("a missing rank ends the others with a timeout error, not a hang", "[collectives][errors]") {
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE_THROWS_WITH(flatshard::run_ranks(
                          3,
                          [](Communicator& c) {
                            if (c.rank() == 2) return;  // rank 2 skips the collective
                            auto t = at::ones({4});
                            c.all_reduce(t, ReduceOp::kSum, c.current_stream());
                          },
                          std::chrono::milliseconds(300)),
                      Catch::Contains("timed out after 300 ms") &&
                          Catch::Contains("have not reached it: 2"));
  REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
}

TEST_CASE("a rank that throws makes the others fail fast", "[collectives][errors]") {
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE_THROWS_WITH(flatshard::run_ranks(
                          2,
                          [](Communicator& c) {
                            if (c.rank() == 1) throw std::runtime_error("boom on purpose");
                            c.barrier();
                          },
                          std::chrono::milliseconds(30000)),
                      Catch::Contains("rank 1: boom on purpose"));
  REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
}
