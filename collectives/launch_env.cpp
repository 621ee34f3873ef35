#include "collectives/launch_env.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <sstream>

namespace flatshard {

const char* to_string(LaunchEnv::Launcher launcher) {
  switch (launcher) {
    case LaunchEnv::Launcher::kTorchrun:
      return "torchrun";
    case LaunchEnv::Launcher::kSlurm:
      return "SLURM";
    case LaunchEnv::Launcher::kOpenMpi:
      return "Open MPI";
  }
  return "?";
}

namespace {

// Reads variables through a lookup and reports errors in the launcher's terms.
class Reader {
 public:
  Reader(const LaunchEnv::Lookup& lookup, const char* launcher)
      : lookup_(lookup), launcher_(launcher) {}

  std::optional<std::string> raw(const char* name) const {
    auto v = lookup_(name);
    if (v && v->empty()) return std::nullopt;
    return v;
  }

  std::string require(const char* name) const {
    auto v = raw(name);
    TORCH_CHECK(v.has_value(), "flatshard rendezvous (", launcher_, "): environment variable ",
                name, " is not set", hint(name));
    return *v;
  }

  // Integer in [lo, hi]. `prefix_only` accepts a leading number ("2(x3)" -> 2, SLURM style).
  int to_int(const char* name, const std::string& v, long lo, long hi,
             bool prefix_only = false) const {
    errno = 0;
    char* end = nullptr;
    const long x = std::strtol(v.c_str(), &end, 10);
    TORCH_CHECK(end != v.c_str() && (prefix_only || *end == '\0'), "flatshard rendezvous (",
                launcher_, "): ", name, "='", v, "' is not an integer: expected one in [", lo,
                ", ", hi, "]");
    // errno: beyond long's range (strtol saturates), so out of [lo, hi] too: say the text.
    TORCH_CHECK(errno == 0, "flatshard rendezvous (", launcher_, "): ", name, "=", v,
                " is out of range [", lo, ", ", hi, "]");
    TORCH_CHECK(x >= lo && x <= hi, "flatshard rendezvous (", launcher_, "): ", name, "=", x,
                " is out of range [", lo, ", ", hi, "]");
    return static_cast<int>(x);
  }

  int require_int(const char* name, long lo, long hi) const {
    return to_int(name, require(name), lo, hi);
  }

  int optional_int(const char* name, int fallback, long lo, long hi,
                   bool prefix_only = false) const {
    auto v = raw(name);
    return v ? to_int(name, *v, lo, hi, prefix_only) : fallback;
  }

 private:
  static std::string hint(const char* name) {
    const std::string n = name;
    if (n == "MASTER_ADDR" || n == "MASTER_PORT")
      return " (the address of rank 0's store; torchrun sets it, under SLURM or Open MPI export "
             "MASTER_ADDR=<first host> MASTER_PORT=<free port>)";
    return "";
  }

  const LaunchEnv::Lookup& lookup_;
  const char* launcher_;
};

constexpr long kMaxRanks = 1L << 24;

// SLURM_TASKS_PER_NODE lists tasks per node as "N" or "N(xK)" entries joined by commas, e.g.
// "4(x2)" or "4,4" or "4,3". The per-node count if every node has the same, else -1 (unknown:
// HSDP then needs an explicit shard-group size). Malformed text also gives -1: the variable is
// only a hint here, never required.
int uniform_tasks_per_node(const std::string& v, int world_size) {
  long common = -1;
  size_t pos = 0;
  while (pos < v.size()) {
    char* end = nullptr;
    errno = 0;
    const long n = std::strtol(v.c_str() + pos, &end, 10);
    if (errno != 0 || end == v.c_str() + pos || n < 1) return -1;
    pos = static_cast<size_t>(end - v.c_str());
    if (pos < v.size() && v[pos] == '(') {
      const size_t close = v.find(')', pos);
      if (close == std::string::npos || v.compare(pos, 2, "(x") != 0) return -1;
      pos = close + 1;
    }
    if (pos < v.size() && v[pos] != ',') return -1;
    if (pos < v.size()) ++pos;
    if (common >= 0 && n != common) return -1;
    common = n;
  }
  return common >= 1 && common <= world_size ? static_cast<int>(common) : -1;
}

// Every integer launcher variable and what a set value must be on its own; the launcher that is
// used then checks how they relate (RANK < WORLD_SIZE, ...). SLURM_TASKS_PER_NODE is absent:
// it is only a hint (uniform_tasks_per_node above).
struct IntVar {
  const char* name;
  const char* launcher;
  long lo, hi;
  bool prefix_only;
};
constexpr IntVar kIntVars[] = {
    {"RANK", "torchrun", 0, kMaxRanks - 1, false},
    {"WORLD_SIZE", "torchrun", 1, kMaxRanks, false},
    {"LOCAL_RANK", "torchrun", 0, kMaxRanks - 1, false},
    {"LOCAL_WORLD_SIZE", "torchrun", 1, kMaxRanks, false},
    {"TORCHELASTIC_RESTART_COUNT", "torchrun", 0, 1L << 30, false},
    {"SLURM_PROCID", "SLURM", 0, kMaxRanks - 1, false},
    {"SLURM_NTASKS", "SLURM", 1, kMaxRanks, false},
    {"SLURM_LOCALID", "SLURM", 0, kMaxRanks - 1, false},
    {"SLURM_NTASKS_PER_NODE", "SLURM", 1, kMaxRanks, true},
    {"OMPI_COMM_WORLD_RANK", "Open MPI", 0, kMaxRanks - 1, false},
    {"OMPI_COMM_WORLD_SIZE", "Open MPI", 1, kMaxRanks, false},
    {"OMPI_COMM_WORLD_LOCAL_RANK", "Open MPI", 0, kMaxRanks - 1, false},
    {"OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI", 1, kMaxRanks, false},
    {"MASTER_PORT", "store", 1, 65535, false},
};

std::optional<std::string> getenv_lookup(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  return std::string(v);
}

}  // namespace

std::string LaunchEnv::store_prefix() const {
  return use_agent_store ? "/worker/attempt_" + std::to_string(restart_count) : std::string();
}

std::string LaunchEnv::describe() const {
  std::ostringstream os;
  os << "rank " << rank << "/" << world_size << " (local " << local_rank << "/";
  if (local_world_size >= 0)
    os << local_world_size;
  else
    os << "?";
  os << ") via " << to_string(launcher) << ", store " << master_addr << ":" << master_port;
  if (use_agent_store) os << " (torchrun agent store, prefix " << store_prefix() << ")";
  return os.str();
}

LaunchEnv LaunchEnv::from_env() { return from_lookup(getenv_lookup); }

std::optional<LaunchEnv> LaunchEnv::ranks_from_env() { return ranks_from_lookup(getenv_lookup); }

void LaunchEnv::check_variables(const Lookup& lookup) {
  for (const IntVar& v : kIntVars) {
    Reader r(lookup, v.launcher);
    r.optional_int(v.name, 0, v.lo, v.hi, v.prefix_only);
  }
  if (auto agent = Reader(lookup, "torchrun").raw("TORCHELASTIC_USE_AGENT_STORE"))
    TORCH_CHECK(*agent == "True" || *agent == "False",
                "flatshard rendezvous (torchrun): TORCHELASTIC_USE_AGENT_STORE='", *agent,
                "' must be True or False");
}

void LaunchEnv::check_env() { check_variables(getenv_lookup); }

std::optional<LaunchEnv> LaunchEnv::ranks_from_lookup(const Lookup& lookup) {
  check_variables(lookup);
  LaunchEnv e;
  const bool has_rank = lookup("RANK").value_or("") != "";
  const bool has_slurm = lookup("SLURM_PROCID").value_or("") != "";
  const bool has_ompi = lookup("OMPI_COMM_WORLD_RANK").value_or("") != "";
  if (!has_rank && !has_slurm && !has_ompi) return std::nullopt;
  if (has_rank) {
    e.launcher = Launcher::kTorchrun;
    Reader r(lookup, "torchrun");
    e.world_size = r.require_int("WORLD_SIZE", 1, kMaxRanks);
    e.rank = r.require_int("RANK", 0, e.world_size - 1);
    e.local_world_size = r.optional_int("LOCAL_WORLD_SIZE", -1, 1, e.world_size);
    e.local_rank = r.require_int(
        "LOCAL_RANK", 0, e.local_world_size > 0 ? e.local_world_size - 1 : e.world_size - 1);
  } else if (has_slurm) {
    e.launcher = Launcher::kSlurm;
    Reader r(lookup, "SLURM");
    e.world_size = r.require_int("SLURM_NTASKS", 1, kMaxRanks);
    e.rank = r.require_int("SLURM_PROCID", 0, e.world_size - 1);
    e.local_world_size =
        r.optional_int("SLURM_NTASKS_PER_NODE", -1, 1, e.world_size, /*prefix_only=*/true);
    // SLURM_NTASKS_PER_NODE is only set with --ntasks-per-node; SLURM_TASKS_PER_NODE always is.
    if (e.local_world_size < 0)
      if (auto v = r.raw("SLURM_TASKS_PER_NODE"))
        e.local_world_size = uniform_tasks_per_node(*v, e.world_size);
    e.local_rank = r.require_int("SLURM_LOCALID", 0, e.world_size - 1);
  } else {
    e.launcher = Launcher::kOpenMpi;
    Reader r(lookup, "Open MPI");
    e.world_size = r.require_int("OMPI_COMM_WORLD_SIZE", 1, kMaxRanks);
    e.rank = r.require_int("OMPI_COMM_WORLD_RANK", 0, e.world_size - 1);
    e.local_world_size = r.optional_int("OMPI_COMM_WORLD_LOCAL_SIZE", -1, 1, e.world_size);
    e.local_rank = r.require_int(
        "OMPI_COMM_WORLD_LOCAL_RANK", 0,
        e.local_world_size > 0 ? e.local_world_size - 1 : e.world_size - 1);
  }
  return e;
}

LaunchEnv LaunchEnv::from_lookup(const Lookup& lookup) {
  std::optional<LaunchEnv> ranks = ranks_from_lookup(lookup);
  TORCH_CHECK(ranks.has_value(),
              "flatshard rendezvous: no launcher environment found: set RANK, WORLD_SIZE, "
              "LOCAL_RANK, MASTER_ADDR and MASTER_PORT (torchrun does), or run under SLURM "
              "(SLURM_PROCID) or Open MPI (OMPI_COMM_WORLD_RANK) with MASTER_ADDR and MASTER_PORT "
              "exported");
  LaunchEnv e = *ranks;
  Reader r(lookup, to_string(e.launcher));
  e.master_addr = r.require("MASTER_ADDR");
  e.master_port = r.require_int("MASTER_PORT", 1, 65535);
  // torchrun writes str(True) / str(False); anything else is a typo worth reporting.
  if (auto agent = r.raw("TORCHELASTIC_USE_AGENT_STORE")) {
    TORCH_CHECK(*agent == "True" || *agent == "False",
                "flatshard rendezvous: TORCHELASTIC_USE_AGENT_STORE='", *agent,
                "' must be True or False");
    e.use_agent_store = *agent == "True";
  }
  if (e.use_agent_store)
    e.restart_count = r.optional_int("TORCHELASTIC_RESTART_COUNT", 0, 0, 1L << 30);
  return e;
}

}  // namespace flatshard
