// flatshard/cli/launch.h — one process per GPU for the tools (flatshard-bench, flatshard-train):
// who launched us, or launching ourselves; and the tools' usage-error type.
//
// Contract
// - UsageError: a user error (bad flag, bad value, impossible configuration, a malformed
//   launcher variable). One line, no "error:" prefix; the tool prints
//   "<program>: error: <message>" and exits 2 (cli/exit.h).
// - launcher_env() reads the rank variables of torchrun, SLURM or Open MPI with the library's
//   parser (LaunchEnv::ranks_from_env, collectives/launch_env.h: same precedence and checks as
//   the rendezvous); nullopt when none is set. A malformed or missing one throws UsageError with
//   the parser's message, which names the variable. (The NCCL rendezvous reads the full
//   environment, MASTER_ADDR/MASTER_PORT included, itself; this is only for deciding what to do.)
// - launch_local_ranks() runs this executable (/proc/self/exe) `nproc` times with the same
//   arguments and RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and
//   MASTER_PORT=<a free port> set, so each child sees itself launched torchrun-style. It waits
//   for all of them; when one fails (exits with a code >= `failed_from`, or is killed by a
//   signal), the others get SIGTERM (they would otherwise wait for the dead rank until the
//   collective timeout). Returns the highest exit code (128 + signal for a child killed by a
//   signal). `failed_from`: flatshard-bench passes 2 (its exit 1 is a failed result check on
//   rank 0 after every rank finished), flatshard-train 1 (any failure).
#pragma once

#include <optional>
#include <stdexcept>

#include "collectives/launch_env.h"

namespace flatshard {
namespace cli {

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::optional<LaunchEnv> launcher_env();

int launch_local_ranks(int nproc, char** argv, int failed_from);

}  // namespace cli
}  // namespace flatshard
