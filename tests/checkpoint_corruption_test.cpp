// Corrupt, truncated, incomplete or mismatched checkpoints are refused with an error naming the
// file and the tensor (and the rank), and a refused load changes nothing in the model.
#include <sys/stat.h>
#include <torch/optim/adam.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include "checkpoint/crc32.h"
#include "checkpoint/safetensors.h"
#include "checkpoint_util.h"

using namespace flatshard;
using namespace flatshard_test;

namespace {

constexpr const char* kPlan = "type=Block";
constexpr const char* kShard0 = "shard-00000-of-00002.safetensors";
constexpr const char* kShard1 = "shard-00001-of-00002.safetensors";

// A sharded and a full checkpoint after one and after two steps (world 2).
struct Saved {
  TempDir tmp;
  Params one_step;
  Saved() {
    run_ranks(2, [&](Communicator& comm) {
      auto model = g::GPT(ckpt_cfg(), 11);
      auto fsdp = fully_shard(model.ptr(), ckpt_plan(*model, kPlan), comm);
      torch::optim::AdamW opt(fsdp->parameters(), ckpt_adamw());
      for (int step = 0; step < 2; ++step) {
        opt.zero_grad();
        ckpt_loss(model, comm.rank(), 2, step).backward();
        opt.step();
        CheckpointOptions full;
        full.kind = CheckpointKind::kFull;
        save_checkpoint(*fsdp, &opt, tmp / ("sharded" + std::to_string(step + 1)));
        save_checkpoint(*fsdp, &opt, tmp / ("full" + std::to_string(step + 1)), full);
        if (step == 0) {
          auto p = to_map(fsdp->gather_full_params());
          if (comm.rank() == 0) one_step = p;
        }
      }
    });
  }
  // A private copy of checkpoint `name` to damage.
  std::string copy(const std::string& name, const std::string& as) const {
    copy_dir(tmp / name, tmp / as);
    return tmp / as;
  }
};

const Saved& saved() {
  static Saved s;
  return s;
}

// Loads `dir` on 2 ranks (plan `plan`, AdamW); checks that a failed load left the model as it was.
void load2(const std::string& dir, const std::string& plan = kPlan, bool tied = false,
           int64_t d_model = 36) {
  run_ranks(2, [&](Communicator& comm) {
    auto cfg = ckpt_cfg(tied);
    cfg.d_model = d_model;
    auto model = g::GPT(cfg, 3);
    auto fsdp = fully_shard(model.ptr(), ckpt_plan(*model, plan), comm);
    torch::optim::AdamW opt(fsdp->parameters(), ckpt_adamw());
    std::vector<at::Tensor> before;  // this rank's master shards (no collectives after a failure)
    for (const auto& p : fsdp->parameters()) before.push_back(p.detach().clone());
    try {
      load_checkpoint(*fsdp, &opt, dir);
    } catch (...) {
      for (size_t i = 0; i < before.size(); ++i)
        TORCH_CHECK(at::equal(before[i], fsdp->parameters()[i]), "a failed load changed the model");
      TORCH_CHECK(opt.state().empty(), "a failed load changed the optimizer");
      throw;
    }
  });
}

void load_plain(const std::string& dir) {
  auto model = g::GPT(ckpt_cfg(), 3);
  load_full_into_module(*model, dir);
}

// Offset in the file of byte `at` of tensor `name`'s data.
int64_t data_offset(const std::string& path, const std::string& name, int64_t at) {
  const SafetensorsHeader h = SafetensorsHeader::read(InputFile(path));
  const TensorEntry* e = h.find(name);
  TORCH_CHECK(e != nullptr, "no tensor ", name, " in ", path);
  return h.data_start() + e->begin + at;
}

void flip_byte(const std::string& path, int64_t offset) {
  std::string bytes = read_bytes(path);
  bytes.at(static_cast<size_t>(offset)) ^= 0x10;
  write_bytes(path, bytes);
}

std::string last_tensor(const std::string& path) {
  const SafetensorsHeader h = SafetensorsHeader::read(InputFile(path));
  return h.tensors().back().name;
}

using Catch::Contains;

}  // namespace

TEST_CASE("flipped data bytes are caught by the CRC, naming file and tensor",
          "[checkpoint][corrupt]") {
  const Saved& s = saved();
  for (const std::string tensor : {"blocks.0.attn.qkv.weight", "blocks.0.ln1.weight.exp_avg_sq"}) {
    CAPTURE(tensor);
    const std::string dir = s.copy("sharded1", "flip-" + tensor);
    flip_byte(dir + "/" + kShard0, data_offset(dir + "/" + kShard0, tensor, 5));
    REQUIRE_THROWS_WITH(load2(dir), Contains(kShard0) && Contains("checksum mismatch") &&
                                        Contains("'" + tensor + "'") && Contains("rank 0"));
  }
  const std::string full = s.copy("full1", "flip-full");
  flip_byte(full + "/model.safetensors", data_offset(full + "/model.safetensors", "wpe.weight", 0));
  // Rank 1 reads the other half of wpe: whichever rank hits it, every rank reports it.
  REQUIRE_THROWS_WITH(load2(full), Contains("model.safetensors") && Contains("checksum mismatch") &&
                                       Contains("'wpe.weight'"));
  REQUIRE_THROWS_WITH(load_plain(full), Contains("model.safetensors") && Contains("'wpe.weight'") &&
                                            Contains("checksum"));
}

TEST_CASE("a shard from another save is caught (same header, other data)",
          "[checkpoint][corrupt]") {
  const Saved& s = saved();
  const std::string dir = s.copy("sharded1", "mixed");
  write_bytes(dir + "/" + kShard1, read_bytes(s.tmp / ("sharded2/" + std::string(kShard1))));
  REQUIRE_THROWS_WITH(
      load2(dir), Contains(kShard1) && Contains("checksum mismatch") && Contains("failed on rank"));
}

TEST_CASE("corrupt headers and truncated files name the file (and the tensor cut off)",
          "[checkpoint][corrupt]") {
  const Saved& s = saved();
  {
    const std::string dir = s.copy("sharded1", "header");
    flip_byte(dir + "/" + kShard1, 30);
    REQUIRE_THROWS_WITH(load2(dir), Contains(kShard1) && Contains("header checksum mismatch"));
  }
  for (const char* which : {"sharded1", "full1"}) {
    CAPTURE(which);
    const std::string file = std::string(which) == "full1" ? "model.safetensors" : kShard1;
    const std::string dir = s.copy(which, std::string("trunc-") + which);
    const std::string path = dir + "/" + file;
    const std::string cut = last_tensor(path);
    REQUIRE(::truncate(path.c_str(), static_cast<off_t>(read_bytes(path).size()) - 3) == 0);
    REQUIRE_THROWS_WITH(load2(dir),
                        Contains(file) && Contains("truncated") && Contains("'" + cut + "'"));
    REQUIRE(::truncate(path.c_str(), 5) == 0);
    REQUIRE_THROWS_WITH(load2(dir), Contains(file) && Contains("only 5 bytes"));
    REQUIRE(::truncate(path.c_str(), 100) == 0);
    REQUIRE_THROWS_WITH(load2(dir),
                        Contains(file) && Contains("truncated inside the safetensors header"));
    REQUIRE(::unlink(path.c_str()) == 0);
    REQUIRE_THROWS_WITH(load2(dir), Contains("cannot open") && Contains(file));
  }
}

TEST_CASE("a damaged or missing manifest is refused", "[checkpoint][corrupt]") {
  const Saved& s = saved();
  const std::string dir = s.copy("sharded1", "manifest");
  const std::string path = dir + "/manifest.json";
  const std::string text = read_bytes(path);
  std::string tampered = text;
  const size_t at = tampered.find("\"world_size\": 2");
  REQUIRE(at != std::string::npos);
  tampered.replace(at, 15, "\"world_size\": 3");
  write_bytes(path, tampered);
  REQUIRE_THROWS_WITH(load2(dir),
                      Contains("manifest.json") && Contains("manifest checksum mismatch"));
  write_bytes(path, text.substr(0, text.size() / 2));
  REQUIRE_THROWS_WITH(load2(dir), Contains("manifest.json") && Contains("truncated"));
  REQUIRE(::unlink(path.c_str()) == 0);
  REQUIRE_THROWS_WITH(load2(dir),
                      Contains("no checkpoint at") && Contains("manifest.json is missing"));
  REQUIRE_THROWS_WITH(load_plain(dir), Contains("manifest.json is missing"));
}

TEST_CASE("a manifest with a duplicate key is refused, naming the key", "[checkpoint][corrupt]") {
  const Saved& s = saved();
  const std::string dir = s.copy("sharded1", "duplicate");
  const std::string path = dir + "/manifest.json";
  std::string text = read_bytes(path);
  const size_t at = text.find("\"world_size\": 2");
  REQUIRE(at != std::string::npos);
  text.insert(at, "\"world_size\": 3,\n");
  // A valid checksum: only the duplicate is wrong (the CRC covers the text before its member).
  const std::string member = ",\n\"manifest_crc32\": ";
  const size_t end = text.rfind(member);
  REQUIRE(end != std::string::npos);
  write_bytes(path,
              text.substr(0, end) + member + "\"" + crc32_hex(crc32(text.data(), end)) + "\"\n}\n");
  REQUIRE_THROWS_WITH(load2(dir), Contains("manifest.json: invalid JSON: duplicate key "
                                           "'world_size' in the object at the top level"));
}

TEST_CASE("a checkpoint of another model or optimizer is refused by name",
          "[checkpoint][corrupt]") {
  const Saved& s = saved();
  const std::string dir = s.tmp / "sharded1";
  REQUIRE_THROWS_WITH(load2(dir, kPlan, false, 48), Contains("parameter 'wte.weight'") &&
                                                        Contains("[97, 36]") &&
                                                        Contains("[97, 48]") && Contains("failed on rank"));
  REQUIRE_THROWS_WITH(load2(dir, kPlan, /*tied=*/true),
                      Contains("1 parameter(s) the model lacks: 'lm_head.weight'"));
  REQUIRE_THROWS_WITH(run_ranks(1,
                                [&](Communicator& comm) {
                                  auto model = g::GPT(ckpt_cfg(), 3);
                                  auto fsdp = fully_shard(model.ptr(), Policy{}, comm);
                                  torch::optim::Adam opt(fsdp->parameters());
                                  load_checkpoint(*fsdp, &opt, dir);
                                }),
                      Contains("holds AdamW state, the optimizer is Adam"));
  // The intact checkpoint still loads (and the copies above did not disturb it).
  load2(dir);
  auto plain = g::GPT(ckpt_cfg(), 3);
  load_full_into_module(*plain, dir);
  Params got;
  for (const auto& p : plain->named_parameters()) got[p.key()] = p.value().detach().clone();
  REQUIRE(diff_params(s.one_step, got) == "");
}
