// A save never leaves a hidden copy behind silently (Note [Checkpoint publication], "no hidden
// copy"): each case is a save that cannot do everything it needs, run as a user WITHOUT
// override capabilities — CI runs as root, whose CAP_DAC_OVERRIDE would let every save
// succeed — so each runs in a child process (this binary, re-executed) that first drops to uid
// 65534 (the temporary directory is chown'ed to it) and checks that it can no longer write into
// a 0555 directory. Each save must fail naming the path, with the previous checkpoint intact
// and no side directory left, or succeed with every side directory it left named on stderr:
// - a read-only (0555) checkpoint directory (the old code published, then could not remove the
//   replaced checkpoint and left it, full size, at `<dir>.flatshard-saving-<hex>`, silently);
// - a read-only parent, for an existing and for a new checkpoint directory;
// - the checkpoint directory made read-only during the save (reported late: a warning naming
//   the side directory, its size and the command that removes it);
// - a full disk (RLIMIT_FSIZE: 0 bytes, the old code left an empty staging directory behind;
//   4 KiB; 60 KB);
// - directories removed during the save: the staging directory (fails), the checkpoint
//   directory (the save publishes anyway), the checkpoint directory replaced by a user's
//   directory (the old code swapped it to a hidden side name).
// Also here, issue 36's item 7 (each a clear error or a documented rule): the setup fingerprint
// and offload, recompute on the root's type, a name map sending two parameters to one tensor,
// flatshard-bench's --seed range and its usage errors under RANK=1.
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "checkpoint/load_into_shards.h"
#include "checkpoint/tensor_file.h"
#include "checkpoint_util.h"
#include "fsdp/fingerprint.h"

extern char** environ;

using namespace flatshard;
using namespace flatshard_test;
using Catch::Contains;

namespace {

constexpr const char* kPlan = "type=Block";
constexpr uid_t kNobody = 65534;
std::string g_capture;  // where save2 sends stderr (in the child's writable scratch directory)

// What one save did: its error (rank 0's) and what the process wrote to stderr meanwhile.
struct Outcome {
  bool threw = false;
  std::string error;
  std::string err_text;
  Params params;  // the saved model's parameters
};

// A fresh model (initial values from `seed`) saved to `dir` at world 2, sharded.
Outcome save2(const std::string& dir, uint64_t seed, const CheckpointOptions& o = {}) {
  Outcome out;
  std::fflush(stderr);
  const int saved = ::dup(2);
  const int fd = ::open(g_capture.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  ::dup2(fd, 2);
  std::mutex mu;
  run_ranks(2, [&](Communicator& comm) {
    auto model = g::GPT(ckpt_cfg(), seed);
    auto fsdp = fully_shard(model.ptr(), ckpt_plan(*model, kPlan), comm);
    torch::optim::AdamW opt(fsdp->parameters(), ckpt_adamw());
    std::string error;
    try {
      save_checkpoint(*fsdp, &opt, dir, o);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
    auto p = to_map(fsdp->gather_full_params());
    std::lock_guard<std::mutex> lock(mu);
    if (comm.rank() == 0) {
      out.threw = !error.empty();
      out.error = error;
      out.params = p;
    }
  });
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(fd);
  ::close(saved);
  out.err_text = read_bytes(g_capture);
  ::unlink(g_capture.c_str());
  std::fprintf(stderr, "save to %s: %s%s\n", dir.c_str(),
               out.threw ? "failed: " : "ok", out.error.c_str());
  if (!out.err_text.empty()) std::fprintf(stderr, "  stderr: %s", out.err_text.c_str());
  return out;
}

// The rule: every side directory beside `dir` is named in what the save printed.
void check_side_dirs_reported(const std::string& dir, const Outcome& o) {
  for (const SideDir& s : side_dirs(dir, kManifestName)) {
    INFO("side directory " << s.path << " (" << tree_bytes(s.path) << " bytes)");
    CHECK_THAT(o.err_text, Contains(s.path));
  }
}

// A failed save: loud (names `names`), nothing beside `dir`, `dir` still holds `before`.
void check_failed_cleanly(const std::string& dir, const Outcome& o, const Params& before,
                          const std::string& names) {
  CHECK(o.threw);
  CHECK_THAT(o.error, Contains(names));
  CHECK(side_dirs(dir, kManifestName).empty());
  check_side_dirs_reported(dir, o);
  CHECK(diff_params(before, load_fresh(dir)) == "");
}

void set_mode(const std::string& path, mode_t mode) { REQUIRE(::chmod(path.c_str(), mode) == 0); }

// Calls `fn` once, at rank 0's first write of a data file.
IoHook at_first_write(std::function<void(const IoPoint&)> fn) {
  auto done = std::make_shared<std::atomic<bool>>(false);
  return [done, fn](const IoPoint& p) {
    if (p.kind == IoPoint::Kind::kWrite && p.path.find("shard-00000") != std::string::npos &&
        !done->exchange(true))
      fn(p);
  };
}

// --- the child's scenarios (run as uid 65534 when started as root) ----------------------------

void read_only_dir(const std::string& tmp) {
  const std::string dir = tmp + "/ckpt";
  const Params a = save2(dir, 1).params;
  set_mode(dir, 0555);
  const Outcome o = save2(dir, 2);
  check_failed_cleanly(dir, o, a, "'" + dir + "'");
  CHECK_THAT(o.error, Contains("permission"));
  set_mode(dir, 0755);
  const Outcome ok = save2(dir, 2);  // now it can: published, nothing left beside it
  CHECK(!ok.threw);
  CHECK(side_dirs(dir, kManifestName).empty());
  CHECK(diff_params(ok.params, load_fresh(dir)) == "");
}

void read_only_parent(const std::string& tmp) {
  const std::string parent = tmp + "/runs", dir = parent + "/ckpt", fresh = parent + "/new";
  make_dirs(parent);
  const Params a = save2(dir, 1).params;
  set_mode(parent, 0555);
  const Outcome o = save2(dir, 2);
  check_failed_cleanly(dir, o, a, "'" + parent + "'");
  CHECK_THAT(o.error, Contains("permission"));
  const Outcome n = save2(fresh, 2);  // a new checkpoint directory in a read-only parent
  CHECK(n.threw);
  CHECK_THAT(n.error, Contains("'" + parent + "'"));
  CHECK(!path_exists(fresh));
  CHECK(side_dirs(fresh, kManifestName).empty());
  set_mode(parent, 0755);
}

void late_read_only_dir(const std::string& tmp) {
  const std::string dir = tmp + "/ckpt";
  const Params a = save2(dir, 1).params;
  CheckpointOptions o;
  o.fault_hook = at_first_write([&](const IoPoint&) { ::chmod(dir.c_str(), 0555); });
  const Outcome late = save2(dir, 2, o);
  if (late.threw) {
    check_failed_cleanly(dir, late, a, dir);
  } else {
    CHECK(diff_params(late.params, load_fresh(dir)) == "");
    check_side_dirs_reported(dir, late);
    for (const SideDir& s : side_dirs(dir, kManifestName)) {
      CHECK_THAT(late.err_text, Contains("rm -rf '" + s.path + "'"));
      CHECK_THAT(late.err_text, Contains("KiB"));  // its size
      ::chmod(s.path.c_str(), 0755);
    }
  }
  ::chmod(dir.c_str(), 0755);
  // The next save that can removes what was left.
  const Outcome next = save2(dir, 3);
  CHECK(!next.threw);
  CHECK(side_dirs(dir, kManifestName).empty());
}

void full_disk(const std::string& tmp) {
  const std::string dir = tmp + "/ckpt";
  const Params a = save2(dir, 1).params;
  ::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead of killing us
  rlimit before{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &before) == 0);
  for (const rlim_t limit : {rlim_t{0}, rlim_t{4096}, rlim_t{60000}}) {
    CAPTURE(limit);
    rlimit small = before;
    small.rlim_cur = limit;
    REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
    Outcome o;
    try {
      o = save2(dir, 2);
    } catch (...) {
      ::setrlimit(RLIMIT_FSIZE, &before);
      throw;
    }
    ::setrlimit(RLIMIT_FSIZE, &before);
    check_failed_cleanly(dir, o, a, dir);
  }
}

void removed_mid_save(const std::string& tmp) {
  const std::string dir = tmp + "/ckpt";
  const Params a = save2(dir, 1).params;
  {  // the staging directory, under a file being written: fails, nothing left
    CheckpointOptions o;
    o.fault_hook = at_first_write([](const IoPoint& p) {
      remove_tree(p.path.substr(0, p.path.find_last_of('/')));
    });
    const Outcome r = save2(dir, 2, o);
    // The ranks write in parallel: another rank's file can land in the directory after it was
    // removed (its marker gone). Then it stays — reported, never silent (abandon_save).
    CHECK(r.threw);
    CHECK_THAT(r.error, Contains(dir));
    check_side_dirs_reported(dir, r);
    CHECK(diff_params(a, load_fresh(dir)) == "");
    for (const SideDir& s : side_dirs(dir, kManifestName)) remove_tree(s.path);
  }
  {  // the checkpoint directory itself: the save publishes anyway
    CheckpointOptions o;
    o.fault_hook = at_first_write([&](const IoPoint&) { remove_tree(dir); });
    const Outcome r = save2(dir, 2, o);
    CHECK(!r.threw);
    CHECK(side_dirs(dir, kManifestName).empty());
    CHECK(diff_params(r.params, load_fresh(dir)) == "");
  }
  {  // ... replaced by a user's directory: never replaced by the save nor hidden beside it
    const Params b = load_fresh(dir);
    CheckpointOptions o;
    o.fault_hook = at_first_write([&](const IoPoint&) {
      remove_tree(dir);
      make_dirs(dir);
      write_bytes(dir + "/notes.txt", "mine");
    });
    const Outcome r = save2(dir, 3, o);
    check_side_dirs_reported(dir, r);
    if (r.threw) {
      CHECK_THAT(r.error, Contains("'" + dir + "'"));
      CHECK(read_bytes(dir + "/notes.txt") == "mine");
      CHECK(side_dirs(dir, kManifestName).empty());
    } else {
      bool kept = read_bytes(dir + "/notes.txt") == "mine";
      for (const SideDir& s : side_dirs(dir, kManifestName))
        kept = kept || read_bytes(s.path + "/notes.txt") == "mine";
      CHECK(kept);
    }
    (void)b;
  }
}

// Runs the child scenario `name` in a re-executed child; the child's own checks decide.
void run_child(const std::string& name) {
  TempDir tmp;
  if (::geteuid() == 0) REQUIRE(::chown(tmp.path().c_str(), kNobody, kNobody) == 0);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
  env_strings.push_back("FLATSHARD_SAVE_TRUST_SCENARIO=" + name);
  env_strings.push_back("FLATSHARD_SAVE_TRUST_DIR=" + tmp.path());
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe", test = "save trust child";
  char* argv[] = {exe.data(), test.data(), nullptr};
  TempDir logs;
  const std::string log = logs / "child.log";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&fa);
  REQUIRE(rc == 0);
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(300);
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // Whatever the child left read-only must not stop TempDir's removal (as a non-root user).
  ::nftw(tmp.path().c_str(),
         [](const char* p, const struct stat* st, int, struct FTW*) {
           if (S_ISDIR(st->st_mode)) ::chmod(p, 0755);
           return 0;
         },
         16, FTW_PHYS);
  INFO(read_bytes(log));
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
}

}  // namespace

TEST_CASE("save trust child", "[.save_trust_child]") {
  const char* scenario = std::getenv("FLATSHARD_SAVE_TRUST_SCENARIO");
  const char* tmp = std::getenv("FLATSHARD_SAVE_TRUST_DIR");
  if (scenario == nullptr || tmp == nullptr) return;
  if (::geteuid() == 0) {  // drop root and its capabilities for good
    REQUIRE(::setgroups(0, nullptr) == 0);
    REQUIRE(::setgid(kNobody) == 0);
    REQUIRE(::setuid(kNobody) == 0);
  }
  {  // the point of the exercise: this process cannot write into a read-only directory
    const std::string probe = std::string(tmp) + "/probe";
    make_dirs(probe);
    set_mode(probe, 0555);
    const bool denied = ::mkdir((probe + "/x").c_str(), 0755) != 0 && errno == EACCES;
    set_mode(probe, 0755);
    remove_tree(probe);
    REQUIRE(denied);
  }
  g_capture = std::string(tmp) + "/stderr.txt";
  const std::string s = scenario;
  if (s == "read-only dir") read_only_dir(tmp);
  else if (s == "read-only parent") read_only_parent(tmp);
  else if (s == "late read-only dir") late_read_only_dir(tmp);
  else if (s == "full disk") full_disk(tmp);
  else if (s == "removed mid-save") removed_mid_save(tmp);
  else FAIL("unknown scenario " << s);
}

TEST_CASE("a save over a read-only checkpoint directory fails before writing anything",
          "[checkpoint][save_trust]") {
  run_child("read-only dir");
}

TEST_CASE("a save into a read-only parent fails naming it", "[checkpoint][save_trust]") {
  run_child("read-only parent");
}

TEST_CASE("a checkpoint directory made read-only during the save: the copy left is reported",
          "[checkpoint][save_trust]") {
  run_child("late read-only dir");
}

TEST_CASE("a save on a full disk fails and leaves nothing beside the checkpoint",
          "[checkpoint][save_trust]") {
  run_child("full disk");
}

TEST_CASE("directories removed during a save: a clear outcome, nothing hidden",
          "[checkpoint][save_trust]") {
  run_child("removed mid-save");
}

// --- issue 36, item 7 ------------------------------------------------------------------------

namespace {

struct WarningCollector : c10::WarningHandler {
  void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
  std::vector<std::string> messages;
};

// The error every rank of a 2-rank fully_shard got ("" if it succeeded), rank 0's.
std::string shard2_error(const std::function<std::string(int)>& spec_of,
                         const std::function<int(int)>& offload_of) {
  std::string error;
  std::mutex mu;
  run_ranks(2, [&](Communicator& comm) {
    auto model = g::GPT(ckpt_cfg(), 11);
    ShardingOptions o;
    o.offload = offload_of(comm.rank());
    std::string e;
    try {
      auto fsdp = fully_shard(model.ptr(), ckpt_plan(*model, spec_of(comm.rank())), comm, o);
    } catch (const c10::Error& x) {
      e = x.what_without_backtrace();
    }
    std::lock_guard<std::mutex> lock(mu);
    if (comm.rank() == 0) error = e;
  });
  return error;
}

}  // namespace

TEST_CASE("ranks that disagree on offload fail the setup fingerprint naming it",
          "[fingerprint][issue36]") {
  // ShardingOptions::offload on rank 1 only.
  const std::string a = shard2_error([](int) { return kPlan; }, [](int r) { return r; });
  CHECK_THAT(a, Contains("rank 1 differs from rank 0"));
  CHECK_THAT(a, Contains("option offload 1 vs 0"));
  // A plan rule's offload on rank 1 only.
  const std::string b = shard2_error(
      [](int r) { return std::string(r == 1 ? "offload:" : "") + kPlan; }, [](int) { return 0; });
  CHECK_THAT(b, Contains("rank 1 differs from rank 0"));
  CHECK_THAT(b, Contains("offload 1 vs default"));
  // Agreeing ranks still pass.
  CHECK(shard2_error([](int) { return kPlan; }, [](int) { return 1; }) == "");
}

TEST_CASE("recompute on the root's type is an error naming the unit", "[recompute][issue36]") {
  run_ranks(1, [&](Communicator& comm) {
    auto model = g::GPT(ckpt_cfg(), 11);
    CHECK_THROWS_WITH(fully_shard(model.ptr(), parse_policy("recompute:type=GPT"), comm),
                      Contains("unit '<root>'") && Contains("recompute:type=GPT") &&
                          Contains("recompute:type=Block"));
    // A recompute rule that recomputes layers too is fine (the root is never a rule's unit).
    auto m2 = g::GPT(ckpt_cfg(), 11);
    CHECK_NOTHROW(fully_shard(m2.ptr(), parse_policy("recompute:type=Block"), comm));
    auto m3 = g::GPT(ckpt_cfg(), 11);
    CHECK_NOTHROW(fully_shard(m3.ptr(), parse_policy("recompute:type=Block|GPT"), comm));
  });
}

TEST_CASE("a name map sending two parameters to one tensor loads copies and warns",
          "[load][issue36]") {
  TempDir tmp;
  {
    std::vector<TensorEntry> entries(2);
    entries[0].name = "emb";
    entries[0].dtype = at::kFloat;
    entries[0].shape = {4, 3};
    entries[1].name = "other";
    entries[1].dtype = at::kFloat;
    entries[1].shape = {2};
    TensorFileWriter w(tmp.path(), "model.safetensors", entries, Metadata{{"format", "pt"}}, 1024,
                       IoHook{}, false);
    w.write("emb", at::arange(12, at::kFloat));
    w.write("other", at::ones({2}));
    w.finish();
  }
  const std::vector<PlannedParam> planned{{"tok.weight", {4, 3}}, {"head.weight", {4, 3}},
                                          {"bias", {2}}};
  auto map = [](const std::string& n) -> std::string {
    return n == "bias" ? "other" : "emb";
  };
  WarningCollector warnings;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&warnings);
    ParamLoader l = safetensors_loader(tmp.path(), map);
    l.check(planned);
    at::Tensor a = at::zeros({12}), b = at::zeros({12});
    l.read("tok.weight", 0, 12, a);
    l.read("head.weight", 0, 12, b);
    CHECK(at::equal(a, at::arange(12, at::kFloat)));  // each a copy of the tensor
    CHECK(at::equal(b, at::arange(12, at::kFloat)));
    l.check(planned);  // a second rank's check: said once per loader
  }
  REQUIRE(warnings.messages.size() == 1);
  CHECK_THAT(warnings.messages[0], Contains("'tok.weight', 'head.weight'") && Contains("'emb'") &&
                                       Contains("does not tie them"));
  // A one-to-one map says nothing; a shape that says it is no tie is refused.
  WarningCollector quiet;
  {
    c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    safetensors_loader(tmp.path(), map).check({{"tok.weight", {4, 3}}, {"bias", {2}}});
    const std::vector<PlannedParam> transposed{{"tok.weight", {4, 3}}, {"head.weight", {3, 4}}};
    CHECK_THROWS_WITH(safetensors_loader(tmp.path(), map).check(transposed),
                      Contains("'head.weight'") && Contains("has shape [4, 3]"));
  }
  CHECK(quiet.messages.empty());
}

#ifdef FLATSHARD_BENCH_EXE
namespace {

struct BenchOutcome {
  int exit_code = -1;
  std::string err;
};

std::string sh_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

BenchOutcome run_bench(const std::vector<std::string>& args, const std::vector<std::string>& env) {
  TempDir tmp;
  std::string cmd = "env";
  for (const auto& kv : env) cmd += " " + sh_quote(kv);
  cmd += " " + sh_quote(FLATSHARD_BENCH_EXE);
  for (const auto& a : args) cmd += " " + sh_quote(a);
  cmd += " >/dev/null 2>" + sh_quote(tmp / "err.txt") + " </dev/null";
  const int status = std::system(cmd.c_str());
  BenchOutcome o;
  o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  o.err = read_bytes(tmp / "err.txt");
  return o;
}

}  // namespace

TEST_CASE("flatshard-bench refuses a --seed past 2^64 - 1", "[bench][issue36]") {
  const BenchOutcome big = run_bench({"--preset", "tiny", "--seed", "18446744073709551616"}, {});
  CHECK(big.exit_code == 2);
  CHECK_THAT(big.err, Contains("--seed") && Contains("out of range"));
  const BenchOutcome huge =
      run_bench({"--preset", "tiny", "--seed", "99999999999999999999999"}, {});
  CHECK(huge.exit_code == 2);
  CHECK_THAT(huge.err, Contains("out of range"));
  // 2^64 - 1 itself is a seed: the error is the next one (--steps), not the seed's.
  const BenchOutcome max =
      run_bench({"--preset", "tiny", "--seed", "18446744073709551615", "--steps", "0"}, {});
  CHECK(max.exit_code == 2);
  CHECK_THAT(max.err, Contains("--steps must be >= 1, got 0"));
  CHECK_THAT(max.err, !Contains("--seed"));
}

TEST_CASE("flatshard-bench shows a command-line error whatever RANK says", "[bench][issue36]") {
  for (const int n : {0, 1}) {
    CAPTURE(n);
    const std::vector<std::string> env = {"RANK=" + std::to_string(n), "WORLD_SIZE=2",
                                          "LOCAL_RANK=" + std::to_string(n)};
    const BenchOutcome r = run_bench({"--preset", "tiny", "--steps", "0"}, env);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.err, Contains("flatshard-bench: error: --steps must be >= 1, got 0"));
    const BenchOutcome f = run_bench({"--preset", "tiny", "--no-such-flag"}, env);
    CHECK(f.exit_code == 2);
    CHECK_THAT(f.err, Contains("--no-such-flag"));
  }
}
#endif
