// LaunchEnv parsing: torchrun, SLURM and Open MPI variables, the agent-store prefix, and errors
// that name the variable and its value. Pure parsing: runs anywhere (no GPU, no sockets).
#include <catch2/catch.hpp>

#include <map>
#include <cstdlib>
#include <string>
#include <vector>

#include "collectives/env.h"
#include "collectives/launch_env.h"

using flatshard::LaunchEnv;

namespace {

LaunchEnv parse(const std::map<std::string, std::string>& vars) {
  return LaunchEnv::from_lookup([&](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::map<std::string, std::string> torchrun() {
  return {{"RANK", "3"},        {"WORLD_SIZE", "8"},        {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "29500"}};
}

}  // namespace

TEST_CASE("torchrun variables", "[launch_env]") {
  auto e = parse(torchrun());
  CHECK(e.launcher == LaunchEnv::Launcher::kTorchrun);
  CHECK(e.rank == 3);
  CHECK(e.world_size == 8);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 2);
  CHECK(e.master_addr == "node0");
  CHECK(e.master_port == 29500);
  CHECK_FALSE(e.use_agent_store);
  CHECK(e.store_prefix().empty());
  CHECK(e.describe() == "rank 3/8 (local 1/2) via torchrun, store node0:29500");
}

TEST_CASE("torchrun agent store: client under /worker/attempt_<restart>", "[launch_env]") {
  auto vars = torchrun();
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  vars["TORCHELASTIC_RESTART_COUNT"] = "2";
  auto e = parse(vars);
  CHECK(e.use_agent_store);
  CHECK(e.restart_count == 2);
  CHECK(e.store_prefix() == "/worker/attempt_2");
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  CHECK_FALSE(parse(vars).use_agent_store);
  vars["TORCHELASTIC_USE_AGENT_STORE"] = "yes";
  CHECK_THROWS_WITH(parse(vars), Catch::Contains("TORCHELASTIC_USE_AGENT_STORE='yes'"));
}

TEST_CASE("SLURM and Open MPI when RANK is absent", "[launch_env]") {
  auto s = parse({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"},
                  {"SLURM_NTASKS_PER_NODE", "4(x4)"}, {"MASTER_ADDR", "n1"}, {"MASTER_PORT", "1234"}});
  CHECK(s.launcher == LaunchEnv::Launcher::kSlurm);
  CHECK((s.rank == 5 && s.world_size == 16 && s.local_rank == 1 && s.local_world_size == 4));
  auto m = parse({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                  {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"MASTER_ADDR", "n1"}, {"MASTER_PORT", "1234"}});
  CHECK(m.launcher == LaunchEnv::Launcher::kOpenMpi);
  CHECK((m.rank == 2 && m.world_size == 4 && m.local_rank == 0 && m.local_world_size == -1));
  // RANK wins over the others (torchrun inside a SLURM allocation).
  auto vars = torchrun();
  vars["SLURM_PROCID"] = "0";
  CHECK(parse(vars).launcher == LaunchEnv::Launcher::kTorchrun);
}

TEST_CASE("missing or malformed variables name the variable and value", "[launch_env][errors]") {
  CHECK_THROWS_WITH(parse({}), Catch::Contains("no launcher environment"));
  auto v = torchrun();
  v.erase("MASTER_ADDR");
  CHECK_THROWS_WITH(parse(v), Catch::Contains("MASTER_ADDR is not set"));
  v = torchrun();
  v["RANK"] = "abc";
  CHECK_THROWS_WITH(parse(v), Catch::Contains("RANK='abc' is not an integer"));
  v = torchrun();
  v["RANK"] = "8";
  CHECK_THROWS_WITH(parse(v), Catch::Contains("RANK=8 is out of range [0, 7]"));
  v = torchrun();
  v["MASTER_PORT"] = "70000";
  CHECK_THROWS_WITH(parse(v), Catch::Contains("MASTER_PORT=70000 is out of range"));
  v = torchrun();
  v["LOCAL_RANK"] = "2";
  CHECK_THROWS_WITH(parse(v), Catch::Contains("LOCAL_RANK=2 is out of range [0, 1]"));
  CHECK_THROWS_WITH(parse({{"SLURM_PROCID", "0"}, {"MASTER_ADDR", "a"}, {"MASTER_PORT", "1"}}),
                    Catch::Contains("(SLURM): environment variable SLURM_NTASKS is not set"));
}

TEST_CASE("ranks only: no launcher is nullopt, the store is not read, same checks", "[launch_env]") {
  auto ranks = [](const std::map<std::string, std::string>& vars) {
    return LaunchEnv::ranks_from_lookup([&](const char* name) -> std::optional<std::string> {
      auto it = vars.find(name);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    });
  };
  CHECK_FALSE(ranks({}).has_value());
  CHECK_FALSE(ranks({{"RANK", ""}, {"MASTER_ADDR", "node0"}}).has_value());  // empty = unset
  auto v = torchrun();
  v.erase("MASTER_ADDR");
  v.erase("MASTER_PORT");
  const auto e = ranks(v);
  REQUIRE(e.has_value());
  CHECK(e->launcher == LaunchEnv::Launcher::kTorchrun);
  CHECK((e->rank == 3 && e->world_size == 8 && e->local_rank == 1 && e->local_world_size == 2));
  CHECK(e->master_addr.empty());
  CHECK(e->master_port == 0);
  // The full parse agrees on every rank field, for each launcher.
  const std::map<std::string, std::string> slurm = {
      {"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "1"},
      {"SLURM_TASKS_PER_NODE", "4(x4)"}, {"MASTER_ADDR", "n1"}, {"MASTER_PORT", "1234"}};
  for (const auto& vars : {torchrun(), slurm}) {
    const auto a = ranks(vars);
    const auto b = parse(vars);
    REQUIRE(a.has_value());
    CHECK((a->launcher == b.launcher && a->rank == b.rank && a->world_size == b.world_size &&
           a->local_rank == b.local_rank && a->local_world_size == b.local_world_size));
  }
  CHECK(ranks(slurm)->local_world_size == 4);
  v = torchrun();
  v["RANK"] = "abc";
  CHECK_THROWS_WITH(ranks(v), Catch::Contains("RANK='abc' is not an integer"));
  v = torchrun();
  v.erase("WORLD_SIZE");
  CHECK_THROWS_WITH(ranks(v), Catch::Contains("(torchrun): environment variable WORLD_SIZE is not set"));
}

TEST_CASE("FLATSHARD_* knobs: defaults and validation", "[launch_env][env]") {
  namespace env = flatshard::env;
  unsetenv(env::kTimeoutMs);
  CHECK(env::timeout().count() == 600000);
  setenv(env::kTimeoutMs, "1500", 1);
  CHECK(env::timeout().count() == 1500);
  setenv(env::kTimeoutMs, "soon", 1);
  CHECK_THROWS_WITH(env::timeout(), Catch::Contains("FLATSHARD_TIMEOUT_MS='soon' is not an integer"));
  unsetenv(env::kTimeoutMs);
  setenv(env::kNcclTerminateOnError, "maybe", 1);
  CHECK_THROWS_WITH(env::nccl_terminate_on_error(), Catch::Contains("is not a boolean"));
  setenv(env::kNcclTerminateOnError, "ON", 1);
  CHECK(env::nccl_terminate_on_error());
  unsetenv(env::kNcclTerminateOnError);
  CHECK(env::knobs().size() >= 5);
}

TEST_CASE("every set launcher variable must be valid, even when no launcher is used",
          "[launch_env][errors]") {
  using Catch::Contains;
  auto ranks = [](const std::map<std::string, std::string>& vars) {
    return LaunchEnv::ranks_from_lookup([&](const char* name) -> std::optional<std::string> {
      auto it = vars.find(name);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    });
  };
  // No rank variable: nothing launched, but a stray bad value is still an error (flatshard-bench
  // on cpu would otherwise ignore what the NCCL path rejects).
  CHECK_THROWS_WITH(ranks({{"WORLD_SIZE", "0"}}),
                    Contains("(torchrun): WORLD_SIZE=0 is out of range [1, 16777216]"));
  CHECK_THROWS_WITH(ranks({{"MASTER_PORT", "junk"}}),
                    Contains("(store): MASTER_PORT='junk' is not an integer: expected one in [1, "
                             "65535]"));
  CHECK_THROWS_WITH(ranks({{"MASTER_PORT", "0"}}), Contains("MASTER_PORT=0 is out of range"));
  CHECK_THROWS_WITH(ranks({{"RANK", "-1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}),
                    Contains("RANK=-1 is out of range [0, "));
  CHECK_THROWS_WITH(ranks({{"SLURM_NTASKS", "x"}}), Contains("SLURM_NTASKS='x' is not an integer"));
  CHECK_THROWS_WITH(ranks({{"OMPI_COMM_WORLD_SIZE", "99999999999999999999"}}),
                    Contains("OMPI_COMM_WORLD_SIZE=99999999999999999999 is out of range"));
  CHECK_THROWS_WITH(ranks({{"TORCHELASTIC_USE_AGENT_STORE", "1"}}),
                    Contains("TORCHELASTIC_USE_AGENT_STORE='1' must be True or False"));
  // The same through the full parse, where the launcher used is another one.
  auto v = torchrun();
  v["SLURM_NTASKS"] = "0";
  CHECK_THROWS_WITH(parse(v), Contains("(SLURM): SLURM_NTASKS=0 is out of range"));
  // Valid values, a hint that does not parse, and empty (= unset) values are fine.
  CHECK_FALSE(ranks({{"WORLD_SIZE", "4"}, {"MASTER_PORT", "29500"}, {"MASTER_ADDR", "h"},
                     {"SLURM_TASKS_PER_NODE", "garbage"}, {"RANK", ""}})
                  .has_value());
}

TEST_CASE("FLATSHARD_* knobs: check_all names the variable, its value and the range",
          "[launch_env][env]") {
  namespace env = flatshard::env;
  using Catch::Contains;
  for (const auto& k : env::knobs()) unsetenv(k.name);
  CHECK_NOTHROW(env::check_all());  // unset: every default
  struct Case {
    const char* name;
    const char* value;
    const char* says;
  };
  const std::vector<Case> cases = {
      {env::kTimeoutMs, "0", "FLATSHARD_TIMEOUT_MS='0' is out of range: expected an integer in [1, "
                             "1099511627776]"},
      {env::kTimeoutMs, "-1", "FLATSHARD_TIMEOUT_MS='-1' is out of range"},
      {env::kTimeoutMs, "abc", "FLATSHARD_TIMEOUT_MS='abc' is not an integer: expected an integer "
                               "in [1, 1099511627776]"},
      {env::kTimeoutMs, "99999999999999999999", "FLATSHARD_TIMEOUT_MS='99999999999999999999' is "
                                                "out of range"},
      {env::kStoreTimeoutMs, "0", "FLATSHARD_STORE_TIMEOUT_MS='0' is out of range"},
      {env::kWatchdogPollMs, "60001", "FLATSHARD_WATCHDOG_POLL_MS='60001' is out of range"},
      {env::kDebug, "2", "FLATSHARD_DEBUG='2' is not a boolean"},
      {env::kUpcastKernel, "maybe", "FLATSHARD_UPCAST_KERNEL='maybe' is not a boolean"},
      {env::kTraceSteps, "-1", "FLATSHARD_TRACE_STEPS='-1' is out of range: expected an integer in "
                               "[0, 1000000]"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.name, c.value);
    setenv(c.name, c.value, 1);
    CHECK_THROWS_WITH(env::check_all(), Contains(c.says));
    unsetenv(c.name);
  }
  // Every knob of the table is one the check reads: a bad value of each fails.
  for (const auto& k : env::knobs()) {
    if (std::string(k.name) == env::kTrace) continue;  // a path: any text
    CAPTURE(k.name);
    setenv(k.name, "not-a-value", 1);
    CHECK_THROWS_WITH(env::check_all(), Contains(k.name));
    unsetenv(k.name);
  }
}
