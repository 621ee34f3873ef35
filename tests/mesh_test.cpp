// The rank layout of collectives/mesh.h over replicate x shard x tp, ranks as threads
// (collectives/thread_mesh.h run_mesh): global ranks are row-major in MeshDim order (tp
// innermost, as torchtitan's [dp_replicate, dp_shard, tp]), every group holds exactly the ranks
// that differ from it only on its dimension (checked with a closed form: the all-reduced sum of
// the members' global ranks), and the printed forms.
#include <catch2/catch.hpp>

#include "rank_require.h"

#include <ATen/ATen.h>

#include <mutex>
#include <set>
#include <tuple>
#include <vector>

#include "collectives/mesh.h"
#include "collectives/thread_mesh.h"

using namespace flatshard;

namespace {

// The sum of the global ranks of `r`'s group along `dim` in `shape`, from the row-major formula.
int group_rank_sum(const MeshShape& shape, int r, MeshDim dim) {
  int stride = 1;
  for (int d = kNumMeshDims - 1; d > static_cast<int>(dim); --d) stride *= shape.sizes[d];
  const int n = shape.size(dim), c = (r / stride) % n, base = r - c * stride;
  int sum = 0;
  for (int i = 0; i < n; ++i) sum += base + i * stride;
  return sum;
}

}  // namespace

TEST_CASE("MeshShape with tp: sizes and text", "[mesh]") {
  const MeshShape s(/*shard=*/2, /*replicate=*/3, /*tp=*/4);
  CHECK(s.tp() == 4);
  CHECK(s.global_size() == 24);
  CHECK(s.data_parallel_size() == 6);
  CHECK(s.to_string() == "replicate 3 x shard 2 x tp 4");
  CHECK(MeshShape(2, 1, 2).to_string() == "shard 2 x tp 2");
  CHECK(MeshShape(4, 1).to_string() == "shard 4");
  CHECK(MeshShape(4, 1).tp() == 1);
  CHECK(std::string(to_string(MeshDim::kTp)) == "tp");
}

TEST_CASE("run_mesh: row-major global ranks and the groups of every dimension", "[mesh]") {
  for (auto [R, S, T] : {std::tuple{1, 1, 2}, std::tuple{1, 2, 2}, std::tuple{2, 2, 2},
                         std::tuple{2, 1, 3}, std::tuple{1, 3, 1}, std::tuple{2, 3, 2}}) {
    const MeshShape shape(S, R, T);
    CAPTURE(shape.to_string());
    std::mutex mu;
    std::set<int> seen;
    std::vector<std::string> described(shape.global_size());
    run_mesh(shape, [&](const Mesh& mesh) {
      const int g = mesh.global_rank();
      RANK_CHECK(mesh.shape().sizes == shape.sizes);
      RANK_CHECK(g == (mesh.coord(MeshDim::kReplicate) * S + mesh.coord(MeshDim::kShard)) * T +
                     mesh.coord(MeshDim::kTp));
      RANK_CHECK((mesh.tp() != nullptr) == (T > 1));
      RANK_CHECK((mesh.replicate() != nullptr) == (R > 1));
      RANK_CHECK(mesh.global_rank_at(MeshDim::kTp, 0) == g - mesh.coord(MeshDim::kTp));
      RANK_CHECK(mesh.first_along_others(MeshDim::kTp) ==
            (mesh.coord(MeshDim::kShard) == 0 && mesh.coord(MeshDim::kReplicate) == 0));
      for (MeshDim d : {MeshDim::kReplicate, MeshDim::kShard, MeshDim::kTp}) {
        Communicator* c = d == MeshDim::kShard ? &mesh.shard() : mesh.group(d);
        if (c == nullptr) continue;
        at::Tensor t = at::full({3}, static_cast<float>(g));
        c->all_reduce(t, ReduceOp::kSum, c->current_stream());
        TORCH_CHECK(t[2].item<float>() == static_cast<float>(group_rank_sum(shape, g, d)), "rank ",
                    g, ": the ", to_string(d), " group's sum is ", t[2].item<float>());
      }
      // The mesh-wide sum reaches every rank once.
      at::Tensor all = at::full({1}, static_cast<float>(g));
      all_reduce(mesh, all, ReduceOp::kSum, mesh.shard().current_stream());
      const int n = shape.global_size();
      RANK_CHECK(all.item<float>() == static_cast<float>(n * (n - 1) / 2));
      std::lock_guard<std::mutex> lock(mu);
      seen.insert(g);
      described[g] = mesh.describe_rank();
    });
    CHECK(static_cast<int>(seen.size()) == shape.global_size());
    if (R == 1 && S == 2 && T == 2) CHECK(described[3] == "rank 3 (shard 1 of 2, tp 1 of 2)");
    if (R == 2 && S == 2 && T == 2)
      CHECK(described[6] == "rank 6 (replicate 1 of 2, shard 1 of 2, tp 0 of 2)");
  }
}

TEST_CASE("run_mesh: a failing rank fails the run with its cause", "[mesh]") {
  CHECK_THROWS_WITH(run_mesh(MeshShape(2, 1, 2),
                             [](const Mesh& mesh) {
                               if (mesh.global_rank() == 3) TORCH_CHECK(false, "boom on 3");
                               at::Tensor t = at::ones({1});
                               mesh.tp()->all_reduce(t, ReduceOp::kSum,
                                                     mesh.shard().current_stream());
                             }),
                    Catch::Contains("boom on 3"));
}
