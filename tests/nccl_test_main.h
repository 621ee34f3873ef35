// flatshard/tests/nccl_test_main.h — the main() of a GPU test that runs as one process per GPU
// under torchrun and owns one NCCL communicator over the launched world for the whole run.
//
//   NcclCommunicator* g_comm = nullptr;
//   int main(int argc, char** argv) { return flatshard_test::nccl_test_main("name", argc, argv, g_comm); }
//
// - Timeouts default to 2 minutes (FLATSHARD_TIMEOUT_MS, FLATSHARD_STORE_TIMEOUT_MS; the
//   environment wins): a failing check on one rank can desynchronise the ranks, and the others
//   should fail in minutes, not hang.
// - Exit codes: Catch's result; 2 when the communicator cannot be created; 3 when the tests
//   passed but the closing barrier/shutdown failed.
// - A communicator that failed (watchdog timeout, abort) is not shut down collectively: its
//   peers may be gone.
#pragma once

#include <catch2/catch.hpp>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "collectives/launch_env.h"
#include "collectives/nccl_communicator.h"

namespace flatshard_test {

// Sets `key` in `store` when it goes out of scope, however the scope is left: ranks waiting for
// the key are released even when a check on this rank fails.
struct SetKeyOnExit {
  c10d::Store& store;
  std::string key;
  ~SetKeyOnExit() {
    try {
      store.set(key, std::vector<uint8_t>{1});
    } catch (...) {
    }
  }
};

inline int nccl_test_main(const char* name, int argc, char** argv,
                          flatshard::NcclCommunicator*& comm) {
  setenv("FLATSHARD_TIMEOUT_MS", "120000", /*overwrite=*/0);
  setenv("FLATSHARD_STORE_TIMEOUT_MS", "120000", /*overwrite=*/0);
  std::unique_ptr<flatshard::NcclCommunicator> owner;
  try {
    owner = flatshard::NcclCommunicator::from_env(name);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: cannot create the NCCL communicator: %s\n", name,
                 e.what_without_backtrace());
    return 2;
  }
  comm = owner.get();
  std::fprintf(stderr, "%s: %s on %s\n", name,
               flatshard::LaunchEnv::from_env().describe().c_str(),
               comm->device().str().c_str());
  const int rc = Catch::Session().run(argc, argv);
  try {
    if (!comm->failed()) {
      comm->barrier();
      comm->shutdown();
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s: shutdown failed: %s\n", name, e.what_without_backtrace());
    return rc ? rc : 3;
  }
  comm = nullptr;
  return rc;
}

}  // namespace flatshard_test
