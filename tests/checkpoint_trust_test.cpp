// The checkpoint loader is a trust boundary and a save never destroys the user's data
// (Note [Checkpoint publication], Note [Checkpoint confinement], Note [Strict manifest]).
// Each case is a probe a careless or hostile user made against the previous code, where it
// was accepted (or hung, or deleted files):
// - confinement: a manifest naming ../ paths or absolute paths, a checkpoint file that is a
//   symlink out of the directory, a FIFO (in a child process with a timeout: the old open()
//   blocked forever);
// - tampered manifests with recomputed CRCs: overlapping pieces, a dtype that is not the file's,
//   negative step counts, a shape whose product wraps int64, unknown fields, a newer format
//   version (duplicate keys: tests/checkpoint_corruption_test.cpp, checkpoint_format_test.cpp);
// - saves: a user's `<dir>.old` / `<dir>.saving` beside the checkpoint, a missing `<dir>` with
//   a user's `<dir>.old` (never loaded in its place), foreign files inside an existing
//   checkpoint (refused, kept), a checkpoint path that is a symlink (followed, kept).
// The reference for "loaded correctly" is the parameters the saving run had (bit for bit).
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "checkpoint/crc32.h"
#include "checkpoint_util.h"
#include "support/json.h"

extern char** environ;

using namespace flatshard;
using namespace flatshard_test;
using Catch::Contains;

namespace {

constexpr const char* kPlan = "type=Block";
constexpr const char* kShard1 = "shard-00001-of-00002.safetensors";

// One step of training at world 2, saved sharded; its full parameters.
struct Saved {
  TempDir tmp;
  Params params;
  Saved() {
    run_ranks(2, [&](Communicator& comm) {
      auto model = g::GPT(ckpt_cfg(), 11);
      auto fsdp = fully_shard(model.ptr(), ckpt_plan(*model, kPlan), comm);
      torch::optim::AdamW opt(fsdp->parameters(), ckpt_adamw());
      opt.zero_grad();
      ckpt_loss(model, comm.rank(), 2, 0).backward();
      opt.step();
      save_checkpoint(*fsdp, &opt, tmp / "ckpt");
      auto p = to_map(fsdp->gather_full_params());
      if (comm.rank() == 0) params = p;
    });
  }
  std::string copy(const std::string& as) const {
    copy_dir(tmp / "ckpt", tmp / as);
    return tmp / as;
  }
};

const Saved& saved() {
  static Saved s;
  return s;
}

// A fresh model (initial values from `seed`) saved to `dir` at world 1; its parameters.
Params save1(const std::string& dir, uint64_t seed, const CheckpointOptions& o = {}) {
  Params out;
  run_ranks(1, [&](Communicator& comm) {
    auto model = g::GPT(ckpt_cfg(), seed);
    auto fsdp = fully_shard(model.ptr(), ckpt_plan(*model, kPlan), comm);
    torch::optim::AdamW opt(fsdp->parameters(), ckpt_adamw());
    save_checkpoint(*fsdp, &opt, dir, o);
    out = to_map(fsdp->gather_full_params());
  });
  return out;
}

// Rewrites `dir`'s manifest through `edit` and recomputes its CRC, as a tamperer would: only
// the edit is wrong with it.
template <class F>
void tamper(const std::string& dir, F&& edit) {
  const std::string path = dir + "/manifest.json";
  json::Json doc = json::parse(read_bytes(path), path);
  doc.erase("manifest_crc32");
  edit(doc);
  const std::string dumped = doc.dump(1);
  const std::string body = dumped.substr(0, dumped.size() - 2);  // without "\n}"
  write_bytes(path, body + ",\n\"manifest_crc32\": \"" +
                        crc32_hex(crc32(body.data(), body.size())) + "\"\n}\n");
}

// The first parameter whose pieces are split over both shards.
json::Json& split_param(json::Json& doc) {
  for (auto& p : doc["params"])
    if (p["pieces"].size() == 2) return p;
  FAIL("no parameter spans both shards");
  return doc;
}

}  // namespace

TEST_CASE("trust: tampering helper leaves a loadable manifest", "[checkpoint][trust]") {
  const std::string dir = saved().copy("untouched");
  tamper(dir, [](json::Json&) {});
  REQUIRE(diff_params(saved().params, load_fresh(dir)) == "");
}

TEST_CASE("trust: file names in the manifest cannot leave the checkpoint directory",
          "[checkpoint][trust]") {
  const Saved& s = saved();
  // A shard moved to ../outside/ with the manifest pointing there (it loaded normally).
  const std::string dir = s.copy("traversal");
  make_dirs(s.tmp / "outside");
  write_bytes(s.tmp / ("outside/" + std::string(kShard1)), read_bytes(dir + "/" + kShard1));
  ::unlink((dir + "/" + kShard1).c_str());
  const std::string moved = "../outside/" + std::string(kShard1);
  tamper(dir, [&](json::Json& doc) {
    for (auto& f : doc["files"])
      if (f["name"] == kShard1) f["name"] = moved;
    for (auto& p : doc["params"])
      for (auto& piece : p["pieces"])
        if (piece["file"] == kShard1) piece["file"] = moved;
  });
  REQUIRE_THROWS_WITH(load_fresh(dir), Contains("'" + moved + "'") && Contains("not a plain name"));
  // An absolute path to a file that is not ours: refused by name; nothing of it is echoed.
  const std::string abs = s.copy("absolute");
  const std::string secret = s.tmp / "secret.txt";
  write_bytes(secret, "TOPSECRETTOPSECRET");
  tamper(abs, [&](json::Json& doc) {
    for (auto& f : doc["files"])
      if (f["name"] == kShard1) f["name"] = secret;
    for (auto& p : doc["params"])
      for (auto& piece : p["pieces"])
        if (piece["file"] == kShard1) piece["file"] = secret;
  });
  try {
    load_fresh(abs);
    FAIL("an absolute file name was accepted");
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    CHECK_THAT(msg, Contains("not a plain name"));
    CHECK_THAT(msg, !Contains("TOPSECRET") && !Contains("18 bytes"));
  }
  // A checkpoint file that is a symlink (here to an intact copy outside): refused.
  const std::string link = s.copy("symlinked-file");
  ::unlink((link + "/" + kShard1).c_str());
  REQUIRE(::symlink((s.tmp / ("outside/" + std::string(kShard1))).c_str(),
                    (link + "/" + kShard1).c_str()) == 0);
  REQUIRE_THROWS_WITH(load_fresh(link), Contains(kShard1) && Contains("symbolic link"));
}

// Child side of the FIFO test (this binary re-executed): loads FLATSHARD_TRUST_CHILD_DIR and
// passes if the load throws naming a FIFO. The old code never returned from open().
TEST_CASE("trust child process", "[.trust_child]") {
  const char* dir = std::getenv("FLATSHARD_TRUST_CHILD_DIR");
  if (dir == nullptr) return;
  auto model = g::GPT(ckpt_cfg(), 3);
  REQUIRE_THROWS_WITH(load_full_into_module(*model, dir), Contains("FIFO"));
}

TEST_CASE("trust: a FIFO in the checkpoint fails at once instead of hanging",
          "[checkpoint][trust]") {
  if (!path_exists("/proc/self/exe")) {
    WARN("no /proc/self/exe; skipped");
    return;
  }
  const Saved& s = saved();
  for (const std::string& which : {std::string(kShard1), std::string("manifest.json")}) {
    CAPTURE(which);
    const std::string dir = s.copy("fifo-" + which);
    ::unlink((dir + "/" + which).c_str());
    REQUIRE(::mkfifo((dir + "/" + which).c_str(), 0644) == 0);
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
    env_strings.push_back("FLATSHARD_TRUST_CHILD_DIR=" + dir);
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe", name = "trust child process";
    char* argv[] = {exe.data(), name.data(), nullptr};
    const std::string log = s.tmp / "child.log";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, envp.data());
    posix_spawn_file_actions_destroy(&fa);
    REQUIRE(rc == 0);
    int status = 0;
    bool exited = false;
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) {
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        exited = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!exited) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    INFO(read_bytes(log));
    REQUIRE(exited);  // no hang
    REQUIRE(WIFEXITED(status));
    REQUIRE(WEXITSTATUS(status) == 0);  // the child saw the FIFO refused by name
  }
}

TEST_CASE("trust: overlapping or gapped pieces are refused before any read",
          "[checkpoint][trust]") {
  const Saved& s = saved();
  // Shift the second piece back by one element: the lengths still add up to the whole value
  // (the old coverage check summed them) but element end-1 is covered by nobody.
  const std::string dir = s.copy("overlap");
  std::string name;
  tamper(dir, [&](json::Json& doc) {
    json::Json& p = split_param(doc);
    name = p["name"].get<std::string>();
    auto& second = p["pieces"][1];
    second["begin"] = second["begin"].get<int64_t>() - 1;
    second["end"] = second["end"].get<int64_t>() - 1;
  });
  REQUIRE_THROWS_WITH(load_fresh(dir), Contains("'" + name + "'") && Contains("overlaps"));
  const std::string gap = s.copy("gap");
  tamper(gap, [&](json::Json& doc) {
    auto& second = split_param(doc)["pieces"][1];
    second["begin"] = second["begin"].get<int64_t>() + 1;
  });
  REQUIRE_THROWS_WITH(load_fresh(gap), Contains("uncovered"));
}

TEST_CASE("trust: a manifest dtype must be the file's", "[checkpoint][trust]") {
  const Saved& s = saved();
  for (const char* dtype : {"I8", "BOOL"}) {
    CAPTURE(dtype);
    const std::string dir = s.copy(std::string("dtype-") + dtype);
    tamper(dir, [&](json::Json& doc) { doc["params"][0]["dtype"] = dtype; });
    REQUIRE_THROWS_WITH(load_fresh(dir),
                        Contains(std::string("the value is ") + dtype) && Contains("is F32"));
    auto plain = g::GPT(ckpt_cfg(), 3);
    REQUIRE_THROWS_WITH(load_full_into_module(*plain, dir), Contains("is F32"));
  }
}

TEST_CASE("trust: optimizer step counts are >= 0 and agree within a unit", "[checkpoint][trust]") {
  const Saved& s = saved();
  const std::string dir = s.copy("negative-step");
  tamper(dir, [](json::Json& doc) {
    for (auto& p : doc["params"]) p["step"] = -5;  // all of them: only the sign is wrong
  });
  REQUIRE_THROWS_WITH(load_fresh(dir), Contains("negative optimizer step count -5"));
  const std::string mixed = s.copy("mixed-step");
  tamper(mixed, [](json::Json& doc) { doc["params"][1]["step"] = 7; });
  REQUIRE_THROWS_WITH(read_manifest(mixed), Contains("step count 7 differs"));
}

TEST_CASE("trust: shapes whose product overflows int64 are refused", "[checkpoint][trust]") {
  const Saved& s = saved();
  const std::string dir = s.copy("overflow");
  // wte.weight is [97, 36] = 3492 elements; (2^62 + 1) * 3492 wraps around to 3492 in int64.
  tamper(dir, [](json::Json& doc) {
    for (auto& p : doc["params"])
      if (p["name"] == "wte.weight") p["shape"] = json::Json::array({(int64_t{1} << 62) + 1, 3492});
  });
  REQUIRE_THROWS_WITH(read_manifest(dir),
                      Contains("'wte.weight'") && Contains("more elements than int64 holds"));
  REQUIRE_THROWS_WITH(load_fresh(dir), Contains("more elements than int64 holds"));
}

TEST_CASE("trust: unknown fields and newer format versions are refused by name",
          "[checkpoint][trust]") {
  const Saved& s = saved();
  const std::string dir = s.copy("unknown");
  tamper(dir, [](json::Json& doc) { doc["params"][0]["checksum_ok"] = true; });
  REQUIRE_THROWS_WITH(read_manifest(dir), Contains("/params/0: unknown field 'checksum_ok'"));
  const std::string top = s.copy("unknown-top");
  tamper(top, [](json::Json& doc) { doc["encryption"] = "none"; });
  REQUIRE_THROWS_WITH(read_manifest(top), Contains("unknown field 'encryption'"));
  const std::string newer = s.copy("newer");
  tamper(newer, [](json::Json& doc) { doc["version"] = 2; });
  REQUIRE_THROWS_WITH(read_manifest(newer),
                      Contains("/version: format version 2 was written by a newer flatshard"));
}

TEST_CASE("trust: a save deletes nothing beside the checkpoint that flatshard did not make",
          "[checkpoint][trust]") {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  // The user's backup and an unrelated folder with flatshard's old side names.
  for (const char* side : {".old", ".saving"}) {
    make_dirs(dir + side);
    write_bytes(dir + side + "/keep.txt", std::string("mine") + side);
  }
  save1(dir, 1);
  const Params second = save1(dir, 2);
  CHECK(read_bytes(dir + ".old/keep.txt") == "mine.old");
  CHECK(read_bytes(dir + ".saving/keep.txt") == "mine.saving");
  CHECK(side_dirs(dir, kManifestName).empty());
  CHECK(diff_params(second, load_fresh(dir)) == "");
  // A path whose parents do not exist yet ("ckpt/step-1000") is created.
  const Params nested = save1(tmp / "runs/a/step-1", 5);
  CHECK(diff_params(nested, load_fresh(tmp / "runs/a/step-1")) == "");
  // An unmarked directory with flatshard's new side name is not flatshard's either.
  const std::string lookalike = dir + kStagingInfix + "0000000000000000";
  make_dirs(lookalike);
  write_bytes(lookalike + "/keep.txt", "mine");
  save1(dir, 3);
  CHECK(read_bytes(lookalike + "/keep.txt") == "mine");
}

TEST_CASE("trust: a load never substitutes a backup; recovery is explicit", "[checkpoint][trust]") {
  const Saved& s = saved();
  // A missing <dir> beside the user's own <dir>.old (a complete checkpoint): not loaded.
  const std::string dir = s.tmp / "gone";
  copy_dir(s.tmp / "ckpt", dir + ".old");
  REQUIRE_THROWS_WITH(load_fresh(dir),
                      Contains("no checkpoint at") && Contains("manifest.json is missing"));
  REQUIRE_THROWS_WITH(recover_checkpoint(dir), Contains("no complete flatshard backup"));
  // A save into it creates a fresh checkpoint and leaves the user's .old alone.
  const Params fresh = save1(dir, 4);
  CHECK(diff_params(fresh, load_fresh(dir)) == "");
  CHECK(path_exists(dir + ".old/manifest.json"));
  // flatshard's own backup (what a save stopped between its two renames leaves): the load
  // names it; recover_checkpoint restores it.
  const std::string d2 = s.tmp / "interrupted";
  const std::string backup = d2 + kBackupInfix + "0123456789abcdef";
  copy_dir(s.tmp / "ckpt", backup);
  write_bytes(backup + "/" + kMarkerName,
              "flatshard checkpoint directory\ntoken 0123456789abcdef\n");
  REQUIRE_THROWS_WITH(load_fresh(d2), Contains("recover_checkpoint") && Contains(backup));
  REQUIRE(recover_checkpoint(d2));
  CHECK(diff_params(s.params, load_fresh(d2)) == "");
  CHECK(!recover_checkpoint(d2));
}

TEST_CASE("trust: foreign files inside an existing checkpoint make a save refuse",
          "[checkpoint][trust]") {
  TempDir tmp;
  const std::string dir = tmp / "ck";
  const Params first = save1(dir, 1);
  write_bytes(dir + "/notes.txt", "my notes");
  make_dirs(dir + "/eval");
  REQUIRE_THROWS_WITH(save1(dir, 2), Contains("refusing to replace") && Contains("'notes.txt'") &&
                                         Contains("'eval'") && Contains("did not write"));
  CHECK(read_bytes(dir + "/notes.txt") == "my notes");
  CHECK(is_directory(dir + "/eval"));
  CHECK(diff_params(first, load_fresh(dir)) == "");   // the checkpoint is untouched
  CHECK(side_dirs(dir, kManifestName).empty());  // and the refused save left nothing behind
  // Once they are moved out, the save goes ahead.
  ::unlink((dir + "/notes.txt").c_str());
  ::rmdir((dir + "/eval").c_str());
  const Params second = save1(dir, 2);
  CHECK(diff_params(second, load_fresh(dir)) == "");
}

TEST_CASE("trust: a checkpoint path that is a symlink is followed and kept",
          "[checkpoint][trust]") {
  TempDir tmp;
  make_dirs(tmp / "real");
  const std::string link = tmp / "ck";
  // Dangling: an error naming the link, nothing created.
  REQUIRE(::symlink((tmp / "real/ck").c_str(), link.c_str()) == 0);
  REQUIRE_THROWS_WITH(save1(link, 1), Contains("symbolic link") && Contains(link));
  make_dirs(tmp / "real/ck");
  save1(link, 1);
  const Params second = save1(link, 2);
  struct stat st;
  REQUIRE(::lstat(link.c_str(), &st) == 0);
  CHECK(S_ISLNK(st.st_mode));  // the link is kept and names the new checkpoint
  CHECK(path_exists(tmp / "real/ck/manifest.json"));
  CHECK(diff_params(second, load_fresh(link)) == "");
  CHECK(side_dirs(tmp / "real/ck", kManifestName).empty());
}
