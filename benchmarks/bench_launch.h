// flatshard/benchmarks/bench_launch.h — one process per GPU: who launched us, or launching
// ourselves.
//
// Contract
// - launcher_env() reads the rank variables of torchrun, SLURM or Open MPI with the library's
//   parser (LaunchEnv::ranks_from_env, collectives/launch_env.h: same precedence and checks as
//   the rendezvous); nullopt when none is set. A malformed or missing one throws UsageError with
//   the parser's message, which names the variable. (The NCCL rendezvous reads the full
//   environment, MASTER_ADDR/MASTER_PORT included, itself; this is only for deciding what to do.)
// - launch_local_ranks() runs this executable (/proc/self/exe) `nproc` times with the same
//   arguments and RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and
//   MASTER_PORT=<a free port> set, so each child sees itself launched torchrun-style. It waits
//   for all of them; when one fails, the others get SIGTERM (they would otherwise wait for the
//   dead rank until the collective timeout). Returns the highest exit code (128 + signal for a
//   child killed by a signal).
#pragma once

#include <optional>

#include "collectives/launch_env.h"

namespace flatshard {
namespace bench {

std::optional<LaunchEnv> launcher_env();

int launch_local_ranks(int nproc, char** argv);

}  // namespace bench
}  // namespace flatshard
