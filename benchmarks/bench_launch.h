// flatshard/benchmarks/bench_launch.h — one process per GPU: who launched us, or launching
// ourselves.
//
// Contract
// - launcher_env() reads the rank variables of torchrun (RANK, WORLD_SIZE, LOCAL_RANK), SLURM
//   (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) or Open MPI (OMPI_COMM_WORLD_RANK, _SIZE,
//   _LOCAL_RANK), in that order of precedence; nullopt when none is set. A malformed number
//   throws UsageError naming the variable. (The NCCL rendezvous reads the full environment,
//   MASTER_ADDR/MASTER_PORT included, itself; this is only for deciding what to do.)
// - launch_local_ranks() runs this executable (/proc/self/exe) `nproc` times with the same
//   arguments and RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and
//   MASTER_PORT=<a free port> set, so each child sees itself launched torchrun-style. It waits
//   for all of them; when one fails, the others get SIGTERM (they would otherwise wait for the
//   dead rank until the collective timeout). Returns the highest exit code (128 + signal for a
//   child killed by a signal).
#pragma once

#include <optional>

namespace flatshard {
namespace bench {

struct LauncherEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
};

std::optional<LauncherEnv> launcher_env();

int launch_local_ranks(int nproc, char** argv);

}  // namespace bench
}  // namespace flatshard
