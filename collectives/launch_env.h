// flatshard/collectives/launch_env.h — who am I in the job: rank, world, local rank, store address.
//
// Contract
// - LaunchEnv::from_env() reads the launcher's environment, in this order of precedence:
//     1. torchrun / env:// style: RANK, WORLD_SIZE, LOCAL_RANK (+ LOCAL_WORLD_SIZE if set);
//     2. SLURM (when RANK is unset): SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
//        (+ the leading number of SLURM_NTASKS_PER_NODE if set, else SLURM_TASKS_PER_NODE's
//        count when it is the same on every node, e.g. "4(x2)");
//     3. Open MPI (when RANK and SLURM_PROCID are unset): OMPI_COMM_WORLD_RANK,
//        OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK (+ OMPI_COMM_WORLD_LOCAL_SIZE).
//   MASTER_ADDR and MASTER_PORT are required in every case (the store's address).
// - torchrun's agent store: TORCHELASTIC_USE_AGENT_STORE=True means the store at
//   MASTER_ADDR:MASTER_PORT already exists (hosted by the elastic agent): every rank connects as a
//   client, and keys live under "/worker/attempt_<TORCHELASTIC_RESTART_COUNT>" so that a
//   restarted worker group never reads a previous attempt's keys.
// - Missing or malformed variables throw c10::Error naming the variable and its value.
// - Every variable above that is set (non-empty) must be valid on its own, whichever launcher
//   is used and whether or not the program goes on to need it: RANK=-1, WORLD_SIZE=0,
//   MASTER_PORT=junk or 70000, TORCHELASTIC_USE_AGENT_STORE=yes are errors naming the variable,
//   its value and the accepted range (check_variables; from_lookup and ranks_from_lookup start
//   with it). A stray bad value would otherwise be ignored on one path (flatshard-bench on CPU
//   never opens a store) and fatal on another. SLURM_TASKS_PER_NODE is only a hint and is
//   never an error.
// - Pure parsing: no sockets, no CUDA (the store is made by collectives/rendezvous.h).
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace flatshard {

struct LaunchEnv {
  enum class Launcher { kTorchrun, kSlurm, kOpenMpi };

  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = -1;  // ranks per node; -1: the launcher did not say (HSDP's default
                              // shard-group size, collectives/sharding_mesh.h)
  std::string master_addr;
  int master_port = 0;
  Launcher launcher = Launcher::kTorchrun;
  bool use_agent_store = false;  // TORCHELASTIC_USE_AGENT_STORE=True
  int restart_count = 0;         // TORCHELASTIC_RESTART_COUNT

  // Key prefix inside the store: "/worker/attempt_<restart_count>" with the agent store, "" else.
  std::string store_prefix() const;
  // One line for logs: "rank 1/2 (local 1/2) via torchrun, store 127.0.0.1:29500 (agent, ...)".
  std::string describe() const;

  static LaunchEnv from_env();
  // Same, reading variables through `lookup` (nullopt = unset); lets tests avoid setenv().
  using Lookup = std::function<std::optional<std::string>(const char* name)>;
  static LaunchEnv from_lookup(const Lookup& lookup);

  // The rank part alone (launcher, rank, world_size, local_rank, local_world_size; same
  // precedence, checks and errors as from_env), or nullopt when no launcher's rank variable
  // (RANK, SLURM_PROCID, OMPI_COMM_WORLD_RANK) is set. The store variables are not read
  // (master_addr stays empty): for programs that also run unlaunched and need to know who they
  // are before deciding what to do (flatshard-bench launches one process per GPU itself then).
  static std::optional<LaunchEnv> ranks_from_env();
  static std::optional<LaunchEnv> ranks_from_lookup(const Lookup& lookup);

  // The per-variable checks alone (see the contract): throws on the first set variable that is
  // malformed or out of its range; unset ones are fine.
  static void check_variables(const Lookup& lookup);
  static void check_env();
};

const char* to_string(LaunchEnv::Launcher launcher);

}  // namespace flatshard
