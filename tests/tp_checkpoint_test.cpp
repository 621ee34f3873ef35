// Checkpoints of tensor-parallel models (issue 51 item 4; docs/tensor-parallel.md,
// "Checkpoints"), CPU ranks as threads on shard x tp meshes (collectives/thread_mesh.h):
// - GPT (fused qkv: colwise/3, fc colwise, rowwise projections with replicated biases) trained
//   3 clipped AdamW steps at tp 2 x shard 2, saved sharded with its optimizer state;
// - the manifest records tp_size 2, full shapes and each parameter's placement;
// - an unsharded model loads it (load_full_into_module): the independent reference. Every rank
//   of the saving run holds exactly (bit for bit) its tp slice of those full values
//   (TensorParallel::local_slice, the slicing parallelize() itself used);
// - reloaded at tp 1 x shard 4, tp 2 x shard 1 and tp 2 x shard 2 every rank again holds
//   exactly its slice, and the next two steps' losses match the uninterrupted run within 1e-5
//   relative (tests/checkpoint_test.cpp's tolerance across plans: the loaded state is exact,
//   only the batch split over ranks and the reduction order differ; a wrong slice or a lost
//   optimizer moment moves the loss by > 1e-3); at tp 2 x shard 2 the losses are identical;
// - the unsharded model's loss at step 3 matches the uninterrupted one;
// - a manifest that claims a placement its shape cannot take is refused (Note [Strict manifest]).
// Every rank sees the same global batch of 4 sequences and takes its data rank's rows, so the
// global mean loss is the same at every shard size.
// - a vocabulary-parallel embedding (the plan's `vocab` style): wte.weight is recorded colwise
//   (rows split) with its full shape, and the checkpoint reloads at tp 1 x shard 4, at tp 2 x
//   shard 1 with the vocab style and at tp 2 x shard 2 with wte replicated or split, slices bit
//   for bit and training continuing to match.
#include <catch2/catch.hpp>

#include <torch/optim/adamw.h>

#include <cmath>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "checkpoint/checkpoint.h"
#include "checkpoint/crc32.h"
#include "checkpoint/manifest.h"
#include "collectives/thread_mesh.h"
#include "fsdp/call.h"
#include "fsdp/sharded_model.h"
#include "fsdp/tensor_parallel.h"
#include "models/family.h"
#include "models/gpt.h"
#include "temp_dir.h"
#include "wrap_policies/spec.h"
#include "wrap_policies/tp_plan.h"

using namespace flatshard;
using namespace flatshard_test;

namespace {

namespace g = flatshard::gpt;

constexpr int kBatch = 4, kSaveAt = 3, kSteps = 5;

g::GPTConfig config() {
  g::GPTConfig c;
  c.vocab = 98;  // tp 2 divides it: the vocab-parallel embedding's case
  c.d_model = 36;  // head_dim 9: odd sizes, every flat parameter padded
  c.n_heads = 4;
  c.n_layers = 3;
  c.seq_len = 11;
  return c;
}

// Rows [d*B/D, (d+1)*B/D) of the global batch of `step`, for data rank d of D.
std::pair<at::Tensor, at::Tensor> batch(int step, int data_rank, int data_ranks) {
  auto [x, y] = g::synthetic_batch(config(), kBatch, 5, 0, step);
  const int64_t n = kBatch / data_ranks;
  return {x.narrow(0, data_rank * n, n), y.narrow(0, data_rank * n, n)};
}

at::Tensor loss_of(g::GPT& model, int step, int data_rank, int data_ranks) {
  auto [x, y] = batch(step, data_rank, data_ranks);
  return flatshard::enter(model, [&, &x = x, &y = y] { return model->loss(x, y); });
}

struct Run {
  int shard = 1, tp = 1, replicate = 1;  // replicate > 1: HSDP x TP
  int from = 0;              // the first step it trains
  std::string load_dir;      // load (with the optimizer) before training
  std::string save_dir;      // save after kSaveAt steps
  bool vocab_parallel = false;  // the family's plan plus vocab:path=wte
  std::map<std::string, at::Tensor> reference;  // full values every rank's slice must equal
};

struct Result {
  std::map<int, double> losses;  // step -> mean over the data ranks
  std::vector<std::string> mismatches;
};

// Every rank's gathered (tp-local) parameters against its slice of `full`, bit for bit.
void check_slices(const ShardedModel& fsdp, const TensorParallel* par,
                  const std::map<std::string, at::Tensor>& full, const std::string& when,
                  const std::string& rank, std::vector<std::string>& out) {
  for (const auto& [name, got] : fsdp.gather_full_params()) {
    auto it = full.find(name);
    if (it == full.end()) {
      out.push_back(rank + " " + when + ": '" + name + "' is not in the reference");
      continue;
    }
    const at::Tensor want = par ? par->local_slice(name, it->second) : it->second;
    if (!got.sizes().equals(want.sizes()) || !at::equal(got, want))
      out.push_back(rank + " " + when + ": '" + name + "' differs from its slice of the saved value");
  }
}

std::map<std::string, at::Tensor> load_unsharded(const std::string& dir) {
  g::GPT plain(config(), /*seed=*/123);  // other values than any run's, so a load must change all
  load_full_into_module(*plain, dir);
  std::map<std::string, at::Tensor> out;
  for (const auto& p : plain->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

Result run(const Run& r) {
  Result res;
  std::mutex mu;
  std::map<int, double> sums;
  const int data_ranks = r.replicate * r.shard;
  run_mesh(MeshShape(r.shard, r.replicate, r.tp), [&](const Mesh& mesh) {
    g::GPT model(config(), r.load_dir.empty() ? 11 : 99);  // a resumed run starts elsewhere
    std::unique_ptr<TensorParallel> par;
    if (r.tp > 1)
      par = parallelize(model.ptr(),
                        parse_tp_plan(g::GPTConfig::family().modules().tp_plan +
                                      (r.vocab_parallel ? ";vocab:path=wte" : "")),
                        mesh);
    auto fsdp = fully_shard(model.ptr(), parse_policy("type=Block"), mesh);
    torch::optim::AdamW opt(fsdp->parameters(),
                            torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    const int d = mesh.coord(MeshDim::kReplicate) * r.shard + mesh.coord(MeshDim::kShard);
    std::vector<std::string> bad;
    if (!r.load_dir.empty()) {
      load_checkpoint(*fsdp, &opt, r.load_dir);
      check_slices(*fsdp, par.get(), r.reference, "after load", mesh.describe_rank(), bad);
    }
    std::map<int, double> losses;
    for (int step = r.from; step < kSteps; ++step) {
      if (step == kSaveAt && !r.save_dir.empty()) {
        save_checkpoint(*fsdp, &opt, r.save_dir);
        // The unsharded model's load is the reference: this rank holds exactly its slice.
        check_slices(*fsdp, par.get(), load_unsharded(r.save_dir), "at save",
                     mesh.describe_rank(), bad);
      }
      opt.zero_grad();
      at::Tensor loss = loss_of(model, step, d, data_ranks);
      losses[step] = loss.item<double>();
      loss.backward();
      fsdp->clip_grad_norm_(1.0);
      opt.step();
    }
    std::lock_guard<std::mutex> lock(mu);
    res.mismatches.insert(res.mismatches.end(), bad.begin(), bad.end());
    if (mesh.coord(MeshDim::kTp) == 0)
      for (const auto& [step, l] : losses) sums[step] += l / data_ranks;
  });
  res.losses = sums;
  return res;
}

void require_losses(const Result& ref, const Result& got, double rtol) {
  REQUIRE(got.losses.size() == static_cast<size_t>(kSteps - kSaveAt));
  for (const auto& [step, loss] : got.losses) {
    const double want = ref.losses.at(step);
    CAPTURE(step, want, loss);
    if (rtol == 0)
      REQUIRE(loss == want);
    else
      REQUIRE(std::abs(loss - want) <= rtol * (1 + std::abs(want)));
  }
}

}  // namespace

TEST_CASE("tp checkpoints: saved at tp 2 x shard 2, resumed at other tp and shard sizes",
          "[tp][checkpoint]") {
  TempDir tmp;
  Run save;
  save.shard = 2;
  save.tp = 2;
  save.save_dir = tmp / "tp2";
  const Result uninterrupted = run(save);
  CHECK(uninterrupted.mismatches == std::vector<std::string>{});
  REQUIRE(uninterrupted.losses.size() == static_cast<size_t>(kSteps));

  const Manifest m = read_manifest(tmp / "tp2");
  CHECK(m.tp_size == 2);
  CHECK(m.world_size == 2);
  std::map<std::string, const ValueRecord*> rec;
  for (const auto& v : m.params) rec[v.name] = &v;
  const int d = config().d_model;
  REQUIRE(rec.count("blocks.0.attn.qkv.weight"));
  CHECK(to_string(rec.at("blocks.0.attn.qkv.weight")->tp) == "colwise/3");
  CHECK(rec.at("blocks.0.attn.qkv.weight")->shape == std::vector<int64_t>{3 * d, d});
  CHECK(to_string(rec.at("blocks.0.attn.proj.weight")->tp) == "rowwise");
  CHECK(rec.at("blocks.0.attn.proj.weight")->shape == std::vector<int64_t>{d, d});
  CHECK(to_string(rec.at("blocks.0.attn.proj.bias")->tp) == "replicate");
  CHECK(to_string(rec.at("blocks.0.mlp.fc.weight")->tp) == "colwise");
  CHECK(rec.at("blocks.0.mlp.fc.weight")->step == kSaveAt);

  const std::map<std::string, at::Tensor> saved = load_unsharded(tmp / "tp2");
  // The values reach an unsharded model in full, and it continues where training was.
  {
    g::GPT plain(config(), 123);
    load_full_into_module(*plain, tmp / "tp2");
    at::NoGradGuard no_grad;
    auto [x, y] = batch(kSaveAt, 0, 1);
    const double loss = plain->loss(x, y).item<double>();
    CHECK(std::abs(loss - uninterrupted.losses.at(kSaveAt)) <=
          1e-5 * (1 + std::abs(loss)));
  }
  for (const auto& [shard, tp] : std::vector<std::pair<int, int>>{{4, 1}, {1, 2}, {2, 2}}) {
    CAPTURE(shard, tp);
    Run resume;
    resume.shard = shard;
    resume.tp = tp;
    resume.from = kSaveAt;
    resume.load_dir = tmp / "tp2";
    resume.reference = saved;
    const Result got = run(resume);
    CHECK(got.mismatches == std::vector<std::string>{});
    require_losses(uninterrupted, got, shard == 2 && tp == 2 ? 0.0 : 1e-5);
  }
}

TEST_CASE("tp checkpoints: a vocabulary-parallel embedding round-trips", "[tp][checkpoint][vocab]") {
  TempDir tmp;
  Run save;
  save.shard = 2;
  save.tp = 2;
  save.vocab_parallel = true;
  save.save_dir = tmp / "vocab";
  const Result uninterrupted = run(save);
  CHECK(uninterrupted.mismatches == std::vector<std::string>{});
  REQUIRE(uninterrupted.losses.size() == static_cast<size_t>(kSteps));
  const Manifest m = read_manifest(tmp / "vocab");
  const ValueRecord* wte = nullptr;
  for (const auto& v : m.params) wte = v.name == "wte.weight" ? &v : wte;
  REQUIRE(wte != nullptr);
  CHECK(to_string(wte->tp) == "colwise");
  CHECK(wte->shape == std::vector<int64_t>{config().vocab, config().d_model});
  const std::map<std::string, at::Tensor> saved = load_unsharded(tmp / "vocab");
  struct At {
    int shard, tp;
    bool vocab;
  };
  for (const At& a : {At{4, 1, false}, At{1, 2, true}, At{2, 2, false}, At{2, 2, true}}) {
    CAPTURE(a.shard, a.tp, a.vocab);
    Run resume;
    resume.shard = a.shard;
    resume.tp = a.tp;
    resume.vocab_parallel = a.vocab;
    resume.from = kSaveAt;
    resume.load_dir = tmp / "vocab";
    resume.reference = saved;
    const Result got = run(resume);
    CHECK(got.mismatches == std::vector<std::string>{});
    require_losses(uninterrupted, got, a.shard == 2 && a.tp == 2 && a.vocab ? 0.0 : 1e-5);
  }
}

TEST_CASE("tp checkpoints: a placement the shape cannot take is refused", "[tp][checkpoint]") {
  TempDir tmp;
  Run save;
  save.shard = 1;
  save.tp = 2;
  save.save_dir = tmp / "tp2";
  run(save);
  const std::string path = tmp / "tp2/manifest.json";
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  // Each edit with the CRC recomputed, so that the strict checks, not the checksum, refuse it.
  auto refused = [&](const std::string& from, const std::string& to) {
    std::string edited = text;
    const size_t at = edited.find(from);
    REQUIRE(at != std::string::npos);
    edited.replace(at, from.size(), to);
    const std::string member = ",\n\"manifest_crc32\": ";
    const size_t c = edited.rfind(member);
    REQUIRE(c != std::string::npos);
    const std::string body = edited.substr(0, c);
    try {
      Manifest::parse(body + member + "\"" + crc32_hex(crc32(body.data(), body.size())) + "\"\n}\n",
                      path);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("accepted");
  };
  // fc.weight is [4d, d]: colwise/5 at tp 2 cannot split 144 rows.
  const std::string fc = "\"name\": \"blocks.0.mlp.fc.weight\", \"dtype\": \"F32\", \"shape\": [144,36], \"tp\": \"colwise";
  std::string msg = refused(fc + "\"", fc + "/5\"");
  CHECK_THAT(msg, Catch::Contains("blocks.0.mlp.fc.weight"));
  CHECK_THAT(msg, Catch::Contains("colwise/5"));
  CHECK_THAT(msg, Catch::Contains("[144, 36]"));
  CHECK_THAT(msg, Catch::Contains("tp_size 2"));
  // A placement flatshard does not know.
  msg = refused(fc + "\"", fc + "wise\"");
  CHECK_THAT(msg, Catch::Contains("unknown tp placement 'colwisewise'"));
  // Split placements without a tp size.
  msg = refused("\"tp_size\": 2,\n", "");
  CHECK_THAT(msg, Catch::Contains("the manifest's tp_size is 1"));
  msg = refused("\"tp_size\": 2,", "\"tp_size\": 1,");
  CHECK_THAT(msg, Catch::Contains("tp_size 1 is not in [2, 2^16]"));
}

TEST_CASE("tp checkpoints: HSDP x TP, saved at replicate 2 x shard 2 x tp 2 (8 ranks), reloaded",
          "[tp][checkpoint][hsdp]") {
  // Only replica 0's shard groups write (Note [HSDP checkpoints]), one file per shard and tp
  // rank; every rank of both replicas loads its slice back bit for bit, and training goes on
  // exactly (same mesh) or within 1e-5 (other meshes: another summation order).
  TempDir tmp;
  Run save;
  save.replicate = 2;
  save.shard = 2;
  save.tp = 2;
  save.save_dir = tmp / "hsdp_tp";
  const Result uninterrupted = run(save);
  CHECK(uninterrupted.mismatches == std::vector<std::string>{});
  REQUIRE(uninterrupted.losses.size() == static_cast<size_t>(kSteps));
  const Manifest m = read_manifest(tmp / "hsdp_tp");
  CHECK(m.tp_size == 2);
  CHECK(m.world_size == 2);
  const std::map<std::string, at::Tensor> saved = load_unsharded(tmp / "hsdp_tp");
  struct Mesh3 {
    int replicate, shard, tp;
  };
  for (const Mesh3& at_ : {Mesh3{2, 2, 2}, Mesh3{1, 4, 1}, Mesh3{1, 2, 2}}) {
    CAPTURE(at_.replicate, at_.shard, at_.tp);
    Run resume;
    resume.replicate = at_.replicate;
    resume.shard = at_.shard;
    resume.tp = at_.tp;
    resume.from = kSaveAt;
    resume.load_dir = tmp / "hsdp_tp";
    resume.reference = saved;
    const Result got = run(resume);
    CHECK(got.mismatches == std::vector<std::string>{});
    require_losses(uninterrupted, got, at_.replicate == 2 ? 0.0 : 1e-5);
  }
}
