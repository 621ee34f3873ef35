// Crash safety (Note [Checkpoint publication]): a save interrupted at any point leaves the
// previous checkpoint loadable, bit for bit.
// - In process: the fault hook throws at every write, rename and publication step of every
//   rank (sharded and full saves, atomic exchange and the two-rename fallback), and after N
//   bytes of a shard; each time the checkpoint directory must load as the previous checkpoint,
//   or as the new one once publication has happened (the kCleanup point).
// - Out of process: a child process (this binary, re-executed) saves over an existing
//   checkpoint and is SIGKILLed while parked in the hook at chosen points (mid-file, before the
//   manifest's rename, before publication, after it); then the directory loads as the previous
//   (or, after publication, the new) checkpoint, and the next save cleans up the debris.
// - The new rules under the same faults: a user's `<dir>.old` and `<dir>.saving` survive every
//   interrupted save and every cleanup; a save stopped between the fallback's two renames
//   leaves `<dir>` missing, a load then refuses and names recover_checkpoint, which restores
//   the previous checkpoint.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "checkpoint_util.h"

extern char** environ;

using namespace flatshard;
using namespace flatshard_test;

namespace {

constexpr const char* kPlan = "type=Block";

// Trains `steps` steps of the shared schedule on this rank.
void train(g::GPT model, torch::optim::AdamW& opt, Communicator& comm, int from, int to) {
  for (int step = from; step < to; ++step) {
    opt.zero_grad();
    ckpt_loss(model, comm.rank(), comm.world_size(), step).backward();
    opt.step();
  }
}

const char* kind_name(IoPoint::Kind k) {
  switch (k) {
    case IoPoint::Kind::kWrite:
      return "write";
    case IoPoint::Kind::kRename:
      return "rename";
    case IoPoint::Kind::kPublish:
      return "publish";
    case IoPoint::Kind::kCleanup:
      return "cleanup";
  }
  return "?";
}

}  // namespace

TEST_CASE(
    "a save that fails at any write, rename or publication step keeps the previous "
    "checkpoint",
    "[checkpoint][fault]") {
  for (const CheckpointKind kind : {CheckpointKind::kSharded, CheckpointKind::kFull})
    for (const bool exchange : {true, false}) {
      CAPTURE(kind == CheckpointKind::kFull, exchange);
      TempDir tmp;
      const std::string dir = tmp / "ckpt";
      std::mutex mu;
      std::vector<std::string> failures;
      std::vector<std::vector<IoPoint>> points(2);
      int attempts = 0;
      make_dirs(dir + ".old");  // the user's, not flatshard's (today's names were these)
      make_dirs(dir + ".saving");
      write_bytes(dir + ".old/keep.txt", "mine");
      write_bytes(dir + ".saving/keep.txt", "mine");
      run_ranks(2, [&](Communicator& comm) {
        const int rank = comm.rank();
        auto model = g::GPT(ckpt_cfg(), 11);
        auto fsdp = fully_shard(model.ptr(), ckpt_plan(*model, kPlan), comm);
        torch::optim::AdamW opt(fsdp->parameters(), ckpt_adamw());
        CheckpointOptions base;
        base.kind = kind;
        base.durable = false;  // fsync changes no step; it only slows hundreds of saves down
        base.use_rename_exchange = exchange;
        train(model, opt, comm, 0, 1);
        save_checkpoint(*fsdp, &opt, dir, base);
        const Params a = to_map(fsdp->gather_full_params());
        train(model, opt, comm, 1, 2);
        const Params b = to_map(fsdp->gather_full_params());

        // The steps of a save that replaces a checkpoint, per rank.
        CheckpointOptions count = base;
        count.fault_hook = [&](const IoPoint& p) { points[rank].push_back(p); };
        save_checkpoint(*fsdp, &opt, tmp / "count", base);
        save_checkpoint(*fsdp, &opt, tmp / "count", count);
        comm.barrier();

        const Params* current = &a;  // what `dir` holds
        auto check = [&](const std::string& what) {
          comm.barrier();
          if (rank == 0) {
            if (!path_exists(dir)) {
              // Stopped between the fallback's two renames: a load refuses (no silent backup)
              // and names the way back; recovery is explicit.
              std::string refused;
              try {
                load_fresh(dir);
              } catch (const c10::Error& e) {
                refused = e.what();
              }
              std::lock_guard<std::mutex> lock(mu);
              if (refused.find("recover_checkpoint") == std::string::npos)
                failures.push_back(what +
                                   ": a load of the missing directory did not point at "
                                   "recover_checkpoint: " +
                                   refused);
              if (!recover_checkpoint(dir)) failures.push_back(what + ": nothing recovered");
            }
            const std::string d = diff_params(*current, load_fresh(dir));
            std::lock_guard<std::mutex> lock(mu);
            if (!d.empty()) failures.push_back(what + ": " + d);
          }
          comm.barrier();
        };
        for (int target = 0; target < 2; ++target) {
          for (size_t k = 0; k < points[target].size(); ++k) {
            const IoPoint& at = points[target][k];
            const std::string what = "rank " + std::to_string(target) + " step " +
                                     std::to_string(k) + " (" + kind_name(at.kind) + " " + at.path +
                                     ")";
            CheckpointOptions o = base;
            size_t calls = 0;
            o.fault_hook = [&](const IoPoint&) {
              if (rank == target && calls++ == k) throw std::runtime_error("injected fault");
            };
            bool threw = false;
            try {
              save_checkpoint(*fsdp, &opt, dir, o);
            } catch (const c10::Error& e) {
              threw = std::string(e.what()).find("injected fault") != std::string::npos;
            }
            if (at.kind == IoPoint::Kind::kCleanup) current = &b;  // published before the fault
            {
              std::lock_guard<std::mutex> lock(mu);
              if (!threw) failures.push_back(what + ": the save did not report the fault");
              if (rank == 0) ++attempts;
            }
            check(what);
          }
        }
        // "Throws after N bytes" of rank 1's shard (or rank 0's full file).
        for (const int64_t n : {1, 4096, 60000}) {
          CheckpointOptions o = base;
          o.fault_hook = [&](const IoPoint& p) {
            if (rank == (kind == CheckpointKind::kFull ? 0 : 1) &&
                p.kind == IoPoint::Kind::kWrite && p.bytes >= n)
              throw std::runtime_error("injected fault after bytes");
          };
          bool threw = false;
          try {
            save_checkpoint(*fsdp, &opt, dir, o);
          } catch (const c10::Error&) {
            threw = true;
          }
          {
            std::lock_guard<std::mutex> lock(mu);
            if (!threw) failures.push_back("no fault after " + std::to_string(n) + " bytes");
          }
          check("after " + std::to_string(n) + " bytes");
        }
        // A clean save over the debris publishes the new state and leaves no staging behind.
        save_checkpoint(*fsdp, &opt, dir, base);
        current = &b;
        check("final save");
        std::lock_guard<std::mutex> lock(mu);
        if (!side_dirs(dir, kManifestName).empty())
          failures.push_back("staging or backup directory left behind");
        // The user's own look-alikes beside the checkpoint survived every fault and cleanup.
        if (read_bytes(dir + ".old/keep.txt") != "mine" ||
            read_bytes(dir + ".saving/keep.txt") != "mine")
          failures.push_back("a save removed the user's " + dir + ".old or .saving");
      });
      CAPTURE(attempts);
      for (const auto& f : failures) FAIL_CHECK(f);
      REQUIRE(failures.empty());
      REQUIRE(attempts >= 10);
    }
}

// Child side of the SIGKILL test, run by re-executing this binary: trains two steps and saves
// over FLATSHARD_CKPT_CHILD_DIR, parking rank 0 forever in the hook at call number
// FLATSHARD_CKPT_CHILD_PAUSE after telling the parent (one byte on FLATSHARD_CKPT_CHILD_FD).
TEST_CASE("checkpoint child process", "[.ckpt_child]") {
  const char* dir = std::getenv("FLATSHARD_CKPT_CHILD_DIR");
  if (dir == nullptr) return;
  const int pause_at = std::atoi(std::getenv("FLATSHARD_CKPT_CHILD_PAUSE"));
  const int fd = std::atoi(std::getenv("FLATSHARD_CKPT_CHILD_FD"));
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto model = g::GPT(ckpt_cfg(), 11);
        auto fsdp = fully_shard(model.ptr(), ckpt_plan(*model, kPlan), comm);
        torch::optim::AdamW opt(fsdp->parameters(), ckpt_adamw());
        train(model, opt, comm, 0, 2);
        CheckpointOptions o;
        int calls = 0;
        o.fault_hook = [&](const IoPoint&) {
          if (comm.rank() != 0 || calls++ != pause_at) return;
          const char c = 'p';
          if (::write(fd, &c, 1) != 1) std::abort();
          for (;;) ::pause();  // until SIGKILL
        };
        save_checkpoint(*fsdp, &opt, dir, o);
      },
      std::chrono::milliseconds(600000));
}

TEST_CASE("a save killed by SIGKILL keeps the previous checkpoint", "[checkpoint][fault]") {
  if (!path_exists("/proc/self/exe")) {
    WARN("no /proc/self/exe; skipped");
    return;
  }
  TempDir tmp;
  const std::string dir = tmp / "ckpt";
  Params a, b;
  std::vector<IoPoint> points;  // rank 0's steps of a save that replaces a checkpoint
  run_ranks(2, [&](Communicator& comm) {
    auto model = g::GPT(ckpt_cfg(), 11);
    auto fsdp = fully_shard(model.ptr(), ckpt_plan(*model, kPlan), comm);
    torch::optim::AdamW opt(fsdp->parameters(), ckpt_adamw());
    train(model, opt, comm, 0, 1);
    save_checkpoint(*fsdp, &opt, dir);
    auto pa = to_map(fsdp->gather_full_params());
    train(model, opt, comm, 1, 2);
    auto pb = to_map(fsdp->gather_full_params());
    CheckpointOptions count;
    if (comm.rank() == 0) count.fault_hook = [&](const IoPoint& p) { points.push_back(p); };
    save_checkpoint(*fsdp, &opt, tmp / "count");
    save_checkpoint(*fsdp, &opt, tmp / "count", count);
    if (comm.rank() == 0) {
      a = pa;
      b = pb;
    }
  });
  // Kill points: the first and a middle write, the manifest's rename, publication, cleanup.
  std::vector<size_t> writes;
  size_t last_rename = 0, publish = 0, cleanup = 0;
  for (size_t k = 0; k < points.size(); ++k) {
    if (points[k].kind == IoPoint::Kind::kWrite) writes.push_back(k);
    if (points[k].kind == IoPoint::Kind::kRename) last_rename = k;
    if (points[k].kind == IoPoint::Kind::kPublish) publish = k;
    if (points[k].kind == IoPoint::Kind::kCleanup) cleanup = k;
  }
  REQUIRE(writes.size() > 10);
  REQUIRE(points[last_rename].path.find("manifest.json") != std::string::npos);
  for (const size_t k :
       {writes.front(), writes[writes.size() / 2], last_rename, publish, cleanup}) {
    CAPTURE(k, kind_name(points[k].kind), points[k].path);
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
    env_strings.push_back("FLATSHARD_CKPT_CHILD_DIR=" + dir);
    env_strings.push_back("FLATSHARD_CKPT_CHILD_PAUSE=" + std::to_string(k));
    env_strings.push_back("FLATSHARD_CKPT_CHILD_FD=" + std::to_string(fds[1]));
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string exe = "/proc/self/exe", name = "checkpoint child process";
    char* argv[] = {exe.data(), name.data(), nullptr};
    const std::string log = tmp / "child.log";
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addclose(&fa, fds[0]);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid = 0;
    const int rc = posix_spawn(&pid, exe.c_str(), &fa, nullptr, argv, envp.data());
    posix_spawn_file_actions_destroy(&fa);
    ::close(fds[1]);
    REQUIRE(rc == 0);
    pollfd p{fds[0], POLLIN, 0};
    char c = 0;
    const bool parked = ::poll(&p, 1, 120000) == 1 && ::read(fds[0], &c, 1) == 1 && c == 'p';
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::close(fds[0]);
    INFO(read_bytes(log));
    REQUIRE(parked);
    REQUIRE(WIFSIGNALED(status));
    // Published only once the hook's kCleanup point is reached.
    REQUIRE(diff_params(k == cleanup ? b : a, load_fresh(dir)) == "");
    if (k < publish) {  // the debris the kill left: flatshard's marked staging directory
      const auto side = side_dirs(dir, kManifestName);
      REQUIRE(side.size() == 1);
      REQUIRE(side[0].marked);
      REQUIRE(!side[0].backup);
    }
  }
  // The next save replaces the debris and publishes.
  run_ranks(2, [&](Communicator& comm) {
    auto model = g::GPT(ckpt_cfg(), 11);
    auto fsdp = fully_shard(model.ptr(), ckpt_plan(*model, kPlan), comm);
    torch::optim::AdamW opt(fsdp->parameters(), ckpt_adamw());
    train(model, opt, comm, 0, 1);
    save_checkpoint(*fsdp, &opt, dir);
  });
  REQUIRE(diff_params(a, load_fresh(dir)) == "");
  REQUIRE(side_dirs(dir, kManifestName).empty());
}
