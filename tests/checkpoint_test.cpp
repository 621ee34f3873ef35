// Checkpoints resume training exactly (CPU, ranks as threads, reference GPT):
// - same world size and plan: the resumed run is bit-identical to an uninterrupted one;
// - sharded and full checkpoints saved at world 3 (a NO_SHARD unit among per-layer units)
//   resume at worlds 1-4 with the same and with another plan: the loaded parameters and
//   optimizer state are bit-identical to the saved ones (a full re-save is byte-identical) and
//   the losses of the following steps match the uninterrupted run within 1e-5 relative;
// - the plain unwrapped model loads both kinds; tied embeddings round-trip under both names;
// - Python reads the files with the README's snippet (bit-exact, zlib CRCs agree).
//
// Tolerance across world sizes and plans: the loaded state is exact, so the first resumed loss
// differs from the uninterrupted one only in how the batch is split over ranks (a per-rank
// mean, then a mean over ranks); later steps add the summation-order differences of the
// gradient reduction (the same effects as tests/gpt_parity_test.cpp, observed ~1e-7). A wrong
// slice, a lost optimizer moment or a step count off by one moves the loss by > 1e-3.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "checkpoint/crc32.h"
#include "checkpoint/file_io.h"
#include "checkpoint/safetensors.h"
#include "checkpoint_util.h"

#include <torch/nn/modules/linear.h>

using namespace flatshard;
using namespace flatshard_test;

namespace {

CheckpointOptions kind(CheckpointKind k) {
  CheckpointOptions o;
  o.kind = k;
  return o;
}

void require_losses(const CkptResult& ref, const CkptResult& got, double rtol) {
  REQUIRE(!got.losses.empty());
  for (const auto& [step, loss] : got.losses) {
    const double want = ref.losses.at(step);
    CAPTURE(step, want, loss);
    if (rtol == 0) {
      REQUIRE(loss == want);
    } else {
      REQUIRE(std::abs(loss - want) <= rtol * (1 + std::abs(want)));
    }
  }
}

}  // namespace

TEST_CASE("resume at the same world size and plan is bit-identical", "[checkpoint]") {
  for (const std::string plan : {"type=Block", "noshard:path=lm_head|wpe;type=Block"}) {
    CAPTURE(plan);
    TempDir tmp;
    CkptRun ref;
    ref.plan = plan;
    ref.save_at = 3;
    ref.saves = {{tmp / "sharded", kind(CheckpointKind::kSharded)},
                 {tmp / "full", kind(CheckpointKind::kFull)}};
    const CkptResult uninterrupted = run_ckpt(ref);
    for (const char* which : {"sharded", "full"}) {
      CAPTURE(which);
      CkptRun resume = ref;
      resume.saves.clear();
      resume.save_at = -1;
      resume.seed = 99;  // different initial values: the load must overwrite all of them
      resume.from = 3;
      resume.load_dir = tmp / which;
      const CkptResult got = run_ckpt(resume);
      REQUIRE(diff_params(uninterrupted.at_save, got.at_save) == "");
      require_losses(uninterrupted, got, 0.0);
      REQUIRE(diff_params(uninterrupted.final_params, got.final_params) == "");
    }
  }
}

TEST_CASE("bf16 AdamW moments: a resumed run is bit-identical to an uninterrupted one",
          "[checkpoint]") {
  // Note [Low-precision moments] (optim/fused_adamw.h): the moments are saved in their dtype
  // or as fp32 of equal value, and the loaded state continues exactly.
  TempDir tmp;
  CkptRun ref;
  ref.bf16_moments = true;
  ref.save_at = 3;
  ref.saves = {{tmp / "sharded", kind(CheckpointKind::kSharded)},
               {tmp / "full", kind(CheckpointKind::kFull)}};
  const CkptResult uninterrupted = run_ckpt(ref);
  for (const char* which : {"sharded", "full"}) {
    CAPTURE(which);
    CkptRun resume = ref;
    resume.saves.clear();
    resume.save_at = -1;
    resume.seed = 99;
    resume.from = 3;
    resume.load_dir = tmp / which;
    const CkptResult got = run_ckpt(resume);
    require_losses(uninterrupted, got, 0.0);
    REQUIRE(diff_params(uninterrupted.final_params, got.final_params) == "");
  }
  // The fp32-moment run differs (the rounding is real), so the comparison above can fail.
  CkptRun fp32 = ref;
  fp32.bf16_moments = false;
  fp32.saves.clear();
  fp32.save_at = -1;
  CHECK(diff_params(uninterrupted.final_params, run_ckpt(fp32).final_params) != "");
}

TEST_CASE("resume at world sizes 1-4 and with another plan (reshard on load)", "[checkpoint]") {
  TempDir tmp;
  CkptRun ref;
  ref.world = 3;
  ref.plan = "noshard:path=lm_head;type=Block";
  ref.save_at = 3;
  ref.saves = {{tmp / "sharded", kind(CheckpointKind::kSharded)},
               {tmp / "full", kind(CheckpointKind::kFull)}};
  const CkptResult uninterrupted = run_ckpt(ref);
  const std::string model_bytes = read_bytes(tmp / "full/model.safetensors");
  const std::string optim_bytes = read_bytes(tmp / "full/optim.safetensors");
  REQUIRE(model_bytes.size() > 100000);
  const Manifest m = read_manifest(tmp / "sharded");
  CHECK(m.kind == "sharded");
  CHECK(m.world_size == 3);
  CHECK(m.params.front().step == 3);

  int n = 0;
  for (const char* which : {"sharded", "full"})
    for (int world = 1; world <= 4; ++world)
      for (const std::string plan : {"same", "other"}) {
        CAPTURE(which, world, plan);
        CkptRun resume;
        resume.world = world;
        // Alternate the other plans so each kind meets per-leaf, every-2 and whole-model units.
        const char* others[] = {"type=Linear|LayerNorm|Embedding", "every=2,type=Block", ""};
        resume.plan = plan == "same" ? ref.plan : others[n++ % 3];
        resume.seed = 77;
        resume.from = 3;
        resume.load_dir = tmp / which;
        resume.full_save_after_load = tmp / ("resaved-" + std::to_string(n));
        const CkptResult got = run_ckpt(resume);
        REQUIRE(diff_params(uninterrupted.at_save, got.at_save) == "");
        // Parameters and optimizer state (exp_avg, exp_avg_sq, step) came through exactly.
        REQUIRE(read_bytes(resume.full_save_after_load + "/model.safetensors") == model_bytes);
        REQUIRE(read_bytes(resume.full_save_after_load + "/optim.safetensors") == optim_bytes);
        const bool exact = world == 3 && plan == "same";
        require_losses(uninterrupted, got, exact ? 0.0 : 1e-5);
      }
}

TEST_CASE("plain model loads full and sharded checkpoints; tied weights under both names",
          "[checkpoint]") {
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    TempDir tmp;
    CkptRun ref;
    ref.world = 4;
    ref.plan = "type=Linear|LayerNorm|Embedding";
    ref.tied = tied;
    ref.to = 4;
    ref.save_at = 2;
    ref.saves = {{tmp / "sharded", kind(CheckpointKind::kSharded)},
                 {tmp / "full", kind(CheckpointKind::kFull)}};
    const CkptResult uninterrupted = run_ckpt(ref);

    for (const char* which : {"sharded", "full"}) {
      CAPTURE(which);
      auto plain = g::GPT(ckpt_cfg(tied), /*seed=*/123);
      load_full_into_module(*plain, tmp / which);
      Params got;
      for (const auto& p : plain->named_parameters()) got[p.key()] = p.value().detach().clone();
      REQUIRE(diff_params(uninterrupted.at_save, got) == "");
      if (tied) REQUIRE(plain->lm_head->weight.is_same(plain->wte->weight));
      // The plain model continues training from there like the sharded one (world 1, exact
      // data split); loss of the next step:
      auto [x, y] = g::synthetic_batch(plain->config(), kGlobalRows, 5, 0, 2);
      const double loss = plain->loss(x, y).item<double>();
      CHECK(std::abs(loss - uninterrupted.losses.at(2)) <= 1e-5 * (1 + loss));
    }
    // model.safetensors lists every name of the model, tied ones included.
    InputFile f(tmp / "full/model.safetensors");
    const SafetensorsHeader h = SafetensorsHeader::read(f);
    REQUIRE(h.find("wte.weight") != nullptr);
    REQUIRE(h.find("lm_head.weight") != nullptr);
    const SafetensorsHeader o = SafetensorsHeader::read(InputFile(tmp / "full/optim.safetensors"));
    CHECK(o.find("wte.weight.exp_avg") != nullptr);
    CHECK((o.find("lm_head.weight.exp_avg") != nullptr) == !tied);  // state once per tensor

    // Resume at worlds 1 and 3 with other plans.
    for (auto [world, plan] : {std::pair<int, std::string>{1, ""}, {3, "type=Block"}}) {
      CAPTURE(world, plan);
      CkptRun resume = ref;
      resume.saves.clear();
      resume.save_at = -1;
      resume.world = world;
      resume.plan = plan;
      resume.from = 2;
      resume.seed = 5;
      resume.load_dir = tmp / "sharded";
      const CkptResult got = run_ckpt(resume);
      REQUIRE(diff_params(uninterrupted.at_save, got.at_save) == "");
      require_losses(uninterrupted, got, 1e-5);
    }
  }
}

namespace {
// Parameters plus buffers of two dtypes (the GPT has no buffers).
struct BufNetImpl : torch::nn::Module {
  explicit BufNetImpl(float fill)
      : fc(register_module("fc", torch::nn::Linear(5, 3))),
        scale(register_buffer("scale", at::full({3}, fill))),
        count(register_buffer("count", at::full({2, 2}, static_cast<int64_t>(fill), at::kLong))) {}
  torch::nn::Linear fc;
  at::Tensor scale, count;
};
TORCH_MODULE(BufNet);
}  // namespace

TEST_CASE("buffers are saved from rank 0 and restored everywhere", "[checkpoint]") {
  TempDir tmp;
  Params saved;
  run_ranks(2, [&](Communicator& comm) {
    BufNet net(7.0f);
    auto fsdp = fully_shard(net.ptr(), Policy{}, comm);
    auto p = to_map(fsdp->gather_full_params());
    if (comm.rank() == 0) saved = p;
    save_checkpoint(*fsdp, nullptr, tmp / "sharded");
    save_checkpoint(*fsdp, nullptr, tmp / "full", kind(CheckpointKind::kFull));
  });
  for (const char* which : {"sharded", "full"}) {
    CAPTURE(which);
    std::vector<at::Tensor> got(3);
    run_ranks(3, [&](Communicator& comm) {
      BufNet net(1.0f);
      auto fsdp = fully_shard(net.ptr(), Policy{}, comm);
      load_checkpoint(*fsdp, nullptr, tmp / which);
      got[comm.rank()] = net->count.clone();
      TORCH_CHECK(at::equal(net->scale, at::full({3}, 7.0f)), "scale not restored");
    });
    for (const auto& c : got) REQUIRE(at::equal(c, at::full({2, 2}, 7, at::kLong)));
    BufNet plain(2.0f);
    load_full_into_module(*plain, tmp / which);
    REQUIRE(at::equal(plain->count, at::full({2, 2}, 7, at::kLong)));
    REQUIRE(at::equal(plain->fc->weight, saved.at("fc.weight")));
  }
}

TEST_CASE("progress callback reports every unit", "[checkpoint]") {
  TempDir tmp;
  std::vector<std::vector<CheckpointProgress>> seen(2);
  run_ranks(2, [&](Communicator& comm) {
    auto model = g::GPT(ckpt_cfg(), 1);
    auto fsdp = fully_shard(model.ptr(), ckpt_plan(*model, "type=Block"), comm);
    CheckpointOptions o;
    o.progress = [&](const CheckpointProgress& p) { seen[comm.rank()].push_back(p); };
    save_checkpoint(*fsdp, nullptr, tmp / "c", o);
    LoadOptions lo;
    lo.progress = o.progress;
    load_checkpoint(*fsdp, nullptr, tmp / "c", lo);
  });
  for (const auto& s : seen) {
    REQUIRE(s.size() == 8);  // 4 units saved, 4 loaded
    CHECK(s[3].units_done == 4);
    CHECK(s[3].units_total == 4);
    CHECK(s[3].bytes_done > s[0].bytes_done);
    CHECK(s[7].units_done == 4);
  }
  // Saved without optimizer: loading with one is refused, naming the reason.
  REQUIRE_THROWS_WITH(run_ranks(1,
                                [&](Communicator& comm) {
                                  auto model = g::GPT(ckpt_cfg(), 1);
                                  auto fsdp = fully_shard(model.ptr(), Policy{}, comm);
                                  torch::optim::AdamW opt(fsdp->parameters(), ckpt_adamw());
                                  load_checkpoint(*fsdp, &opt, tmp / "c");
                                }),
                      Catch::Contains("saved without optimizer state"));
}

#ifdef FLATSHARD_PYTHON_EXE
// The README's Python snippet, extracted from README.md, reads a full and a sharded checkpoint;
// it prints the zlib CRC-32 of every tensor's bytes, which must equal ours.
TEST_CASE("Python reads checkpoints with the README snippet", "[checkpoint][python]") {
  const std::string python = FLATSHARD_PYTHON_EXE;
  if (python.find('/') != std::string::npos && !path_exists(python)) {
    WARN("python not found: " << python);
    return;
  }
  const std::string readme = read_bytes(std::string(FLATSHARD_SOURCE_DIR) + "/README.md");
  const size_t sec = readme.find("## Checkpoints");
  REQUIRE(sec != std::string::npos);
  const size_t begin = readme.find("```python\n", sec);
  const size_t end = readme.find("```\n", begin + 10);
  REQUIRE(begin != std::string::npos);
  REQUIRE(end != std::string::npos);
  const std::string snippet = readme.substr(begin + 10, end - begin - 10);

  TempDir tmp;
  CkptRun ref;
  ref.world = 3;
  ref.tied = true;
  ref.to = 2;
  ref.save_at = 1;
  ref.saves = {{tmp / "sharded", kind(CheckpointKind::kSharded)},
               {tmp / "full", kind(CheckpointKind::kFull)}};
  const CkptResult r = run_ckpt(ref);
  write_bytes(tmp / "check.py", snippet + R"(
import sys, zlib
for ckpt in sys.argv[1:]:
    full = read_safetensors(ckpt + "/model.safetensors") if "full" in ckpt else None
    for name, t in sorted(load_flatshard(ckpt).items()):
        b = bytes(t.contiguous().view(torch.uint8).flatten().tolist())
        if full is not None:
            assert torch.equal(full[name], t), name
        print(ckpt[-4:], name, "%08x" % zlib.crc32(b))
)");
  const std::string cmd = python + " " + (tmp / "check.py") + " " + (tmp / "sharded") + " " +
                          (tmp / "full") + " > " + (tmp / "out.txt") + " 2> " + (tmp / "err.txt");
  const int rc = std::system(cmd.c_str());
  const std::string out = read_bytes(tmp / "out.txt");
  INFO(out << read_bytes(tmp / "err.txt"));
  REQUIRE(rc == 0);
  std::ostringstream want;
  for (const char* which : {"rded", "full"})
    for (const auto& [name, t] : r.at_save)
      want << which << " " << name << " " << crc32_hex(crc32(t.data_ptr(), t.nbytes())) << "\n";
  REQUIRE(out == want.str());
}
#endif
