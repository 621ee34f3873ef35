// The store rendezvous on localhost (no GPU): rank 0 hosts, the others connect; torchrun's agent
// store case puts keys under /worker/attempt_<restart>; store_barrier; clear connect errors.
// Ranks are threads here; each has its own TCPStore client, as separate processes would.
#include <catch2/catch.hpp>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collectives/rendezvous.h"

using flatshard::LaunchEnv;

namespace {

// A port nobody listens on right now (a throwaway server on port 0 picks it).
int free_port() {
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  c10d::TCPStore probe("127.0.0.1", o);
  return probe.getPort();
}

LaunchEnv env_for(int rank, int world, int port) {
  LaunchEnv e;
  e.rank = rank;
  e.world_size = world;
  e.local_rank = rank;
  e.master_addr = "127.0.0.1";
  e.master_port = port;
  return e;
}

std::string str(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

// Rank 0's store on a free port. free_port()'s port is free only until its probe closes: a test
// running beside this one (ctest -j) may bind it first, so a bind that finds the port taken is
// retried on another; any other failure is the test's.
std::pair<c10::intrusive_ptr<c10d::Store>, int> host_on_free_port(int world) {
  for (int attempt = 0;; ++attempt) {
    const int port = free_port();
    try {
      return {flatshard::create_store(env_for(0, world, port), std::chrono::seconds(20)), port};
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      const bool taken = what.find("EADDRINUSE") != std::string::npos ||
                         what.find("ddress already in use") != std::string::npos;
      if (!taken || attempt == 4) throw;
    }
  }
}

}  // namespace

TEST_CASE("rank 0 hosts the store; everyone meets there", "[rendezvous]") {
  const int world = 3;
  const auto hosted = host_on_free_port(world);
  const auto& host = hosted.first;
  const int port = hosted.second;
  std::vector<std::string> seen(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r)
    ranks.emplace_back([&, r] {
      auto store = r == 0 ? host
                          : flatshard::create_store(env_for(r, world, port), std::chrono::seconds(20));
      store->set("hello/" + std::to_string(r), std::vector<uint8_t>{uint8_t('a' + r)});
      flatshard::store_barrier(*store, "test_barrier", world, 0);
      for (int q = 0; q < world; ++q) seen[r] += str(store->get("hello/" + std::to_string(q)));
      flatshard::store_barrier(*store, "test_barrier", world, 1);  // rank 0's server outlives reads
    });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < world; ++r) CHECK(seen[r] == "abc");
}

TEST_CASE("agent store: every rank is a client under /worker/attempt_<restart>", "[rendezvous]") {
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  auto agent = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", o);  // torchrun's agent
  auto e = env_for(1, 2, agent->getPort());
  e.use_agent_store = true;
  e.restart_count = 4;
  auto store = flatshard::create_store(e, std::chrono::seconds(20));
  store->set("key", std::vector<uint8_t>{'v'});
  CHECK(str(agent->get("/worker/attempt_4/key")) == "v");
}

TEST_CASE("an unreachable store fails naming MASTER_ADDR and MASTER_PORT", "[rendezvous][errors]") {
  auto e = env_for(1, 2, free_port());  // rank 1: client; nobody hosts
  CHECK_THROWS_WITH(flatshard::create_store(e, std::chrono::milliseconds(1500)),
                    Catch::Contains("rank 1") && Catch::Contains("MASTER_ADDR=127.0.0.1") &&
                        Catch::Contains("MASTER_PORT=" + std::to_string(e.master_port)));
}
