// The training state a checkpoint carries (CheckpointOptions::training_state,
// LoadOptions::training_state; checkpoint/checkpoint.h): saved with the checkpoint, returned on
// load exactly, validated and bounded on save and on load like the rest of the manifest.
#include <catch2/catch.hpp>

#include <c10/util/Exception.h>

#include <functional>
#include <mutex>
#include <string>

#include "checkpoint/checkpoint.h"
#include "checkpoint/crc32.h"
#include "checkpoint/manifest.h"
#include "collectives/thread_communicator.h"
#include "fsdp/sharded_model.h"
#include "support/json.h"
#include "temp_dir.h"
#include "tiny_net.h"
#include "wrap_policies/policy.h"

namespace {

std::shared_ptr<torch::nn::Module> tiny_model() {
  auto net = flatshard_test::TinyNet(4, 6, 2);
  flatshard_test::init_params(*net, 3);
  return net.ptr();
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

// Saves a tiny sharded model at world 2 with `state`; returns rank 0's error ("" for none).
std::string save_with(const std::string& dir, const std::string& state) {
  std::string err;
  std::mutex mu;
  flatshard::run_ranks(2, [&](flatshard::Communicator& comm) {
    auto model = tiny_model();
    auto fsdp = flatshard::fully_shard(model, flatshard::Policy{}, comm);
    flatshard::CheckpointOptions o;
    o.training_state = state;
    const std::string e = error_of([&] { flatshard::save_checkpoint(*fsdp, nullptr, dir, o); });
    if (comm.rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      err = e == "(no error)" ? "" : e;
    }
  });
  return err;
}

}  // namespace

TEST_CASE("training state: saved with the checkpoint and returned on load", "[checkpoint]") {
  flatshard_test::TempDir tmp;
  const std::string dir = tmp / "ckpt";
  // Integers beyond 2^53, a double that needs 17 digits, UTF-8, nesting: all come back exact.
  const std::string state =
      R"({"step": 12, "data": {"seed": 18446744073709551615, "position": 12},)"
      R"( "lr": 0.30000000000000004, "rng": [1, 2, 3], "note": "café"})";
  REQUIRE(save_with(dir, state) == "");
  const flatshard::Manifest m = flatshard::read_manifest(dir);
  REQUIRE(m.training_state.has_value());
  CHECK(flatshard::json::parse(*m.training_state) == flatshard::json::parse(state));

  std::string got[2];
  flatshard::run_ranks(2, [&](flatshard::Communicator& comm) {
    auto model = tiny_model();
    auto fsdp = flatshard::fully_shard(model, flatshard::Policy{}, comm);
    flatshard::LoadOptions lo;
    lo.training_state = &got[comm.rank()];
    flatshard::load_checkpoint(*fsdp, nullptr, dir, lo);
  });
  for (const auto& g : got) {
    const auto j = flatshard::json::parse(g);
    CHECK(j == flatshard::json::parse(state));
    CHECK(j["data"]["seed"].get<uint64_t>() == 18446744073709551615ULL);
    CHECK(j["lr"].get<double>() == 0.30000000000000004);
  }

  // A save without a state: the manifest has none and a load returns "".
  REQUIRE(save_with(tmp / "plain", "") == "");
  CHECK_FALSE(flatshard::read_manifest(tmp / "plain").training_state.has_value());
}

TEST_CASE("training state: invalid documents are refused before anything is written",
          "[checkpoint]") {
  flatshard_test::TempDir tmp;
  auto refused = [&](const std::string& state, const std::string& part) {
    const std::string dir = tmp / "c";
    const std::string err = save_with(dir, state);
    INFO(err);
    CHECK(err.find("CheckpointOptions::training_state") != std::string::npos);
    CHECK(err.find(part) != std::string::npos);
    CHECK_FALSE(flatshard::path_exists(dir));
  };
  refused("[1, 2]", "expected a JSON object, got array");
  refused("{\"step\": 1,}", "invalid JSON");
  refused("{\"a\": 1, \"a\": 2}", "duplicate key 'a'");
  refused("{\"pad\": \"" + std::string(flatshard::kMaxTrainingStateBytes, 'x') + "\"}",
          "more than the limit of 1048576 bytes");

  // On load: a manifest whose training_state is not an object (CRC recomputed: an edit, not an
  // accident) is an error naming the field.
  const std::string dir = tmp / "edit";
  REQUIRE(save_with(dir, "{\"step\": 3}") == "");
  std::string text = flatshard_test::read_bytes(dir + "/manifest.json");
  const std::string from = "\"training_state\": {\"step\":3}";
  const size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  text.replace(at, from.size(), "\"training_state\": [3]");
  const std::string crc_member = ",\n\"manifest_crc32\": ";
  const size_t c = text.rfind(crc_member);
  const std::string body = text.substr(0, c);
  text = body + crc_member + "\"" +
         flatshard::crc32_hex(flatshard::crc32(body.data(), body.size())) + "\"\n}\n";
  flatshard_test::write_bytes(dir + "/manifest.json", text);
  const std::string err = error_of([&] { flatshard::read_manifest(dir); });
  INFO(err);
  CHECK(err.find("/training_state: training_state must be a JSON object") != std::string::npos);
}
