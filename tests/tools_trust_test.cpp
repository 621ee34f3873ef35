// The command-line tools on bad input, full disks and bad environments (issue 18): every case runs
// flatshard-bench / flatshard-explain / flatshard-trace as a child process under timeout(1), so a
// crash or a hang is a failed check, never a dead test binary. What each case expects:
// - output files are whole or untouched: a run that fails after parsing leaves an existing
//   --json/--csv/--merge file byte for byte as it was; /dev/full is a non-zero exit naming it;
//   so is standard output on /dev/full;
// - sizes are checked before anything is allocated: --layers / --n-layers of 10^12 are one
//   clear error within seconds, not std::bad_alloc or the OOM killer; --memory-limit 1e30TiB is
//   refused, never printed as a negative number;
// - trace inputs: the same file twice, two files of one rank, a rank outside the world;
// - the environment: a set but bad FLATSHARD_* or launcher variable is a usage error naming the
//   variable on the CPU path too; --help reads none of it.
#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#ifndef FLATSHARD_BENCH_EXE
#error "FLATSHARD_BENCH_EXE, FLATSHARD_EXPLAIN_EXE and FLATSHARD_TRACE_EXE must be defined by CMake"
#endif

namespace {

struct Outcome {
  int exit_code = -1;  // 124: killed by the timeout
  std::string out, err;
};

std::string read_file(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write(const std::string& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary);
  f << text;
}

// Names in dir() that look like an output temporary ("<name>.tmp.<pid>").
std::vector<std::string> temporaries(const std::string& folder) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(folder.c_str())) {
    while (const dirent* e = ::readdir(d))
      if (std::string(e->d_name).find(".tmp.") != std::string::npos) out.push_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// A private folder for this run (removed at exit with what the tests put in it). Its name is
// kept in a plain buffer: the atexit handler runs after static strings are destroyed.
char g_dir[4096];
const std::string& dir() {
  static const std::string d = [] {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/flatshard_tools_trust_XXXXXX";
    if (pattern.size() >= sizeof g_dir || ::mkdtemp(pattern.data()) == nullptr)
      throw std::runtime_error("mkdtemp failed");
    std::memcpy(g_dir, pattern.c_str(), pattern.size() + 1);
    std::atexit([] { (void)std::system(("rm -rf " + quote(g_dir)).c_str()); });
    return pattern;
  }();
  return d;
}
std::string path(const std::string& name) { return dir() + "/" + name; }

// Runs `exe args` with `env` (NAME=value) added, stdout to `stdout_to` (a file in dir() by
// default), killed after `seconds`.
Outcome run(const char* exe, const std::vector<std::string>& args,
            const std::vector<std::string>& env = {}, int seconds = 120,
            const std::string& stdout_to = "") {
  std::string cmd = "timeout -k 5 " + std::to_string(seconds) + " env";
  for (const auto& kv : env) cmd += " " + quote(kv);
  cmd += " " + quote(exe);
  for (const auto& a : args) cmd += " " + quote(a);
  const std::string out = stdout_to.empty() ? path("stdout.txt") : stdout_to;
  const std::string err = path("stderr.txt");
  cmd += " >" + quote(out) + " 2>" + quote(err) + " </dev/null";
  const int status = std::system(cmd.c_str());
  Outcome o;
  o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  if (stdout_to.empty()) o.out = read_file(out);
  o.err = read_file(err);
  return o;
}

// A short CPU bench: the tiny GPT, one granularity, one step.
std::vector<std::string> short_bench(std::vector<std::string> more = {}) {
  std::vector<std::string> a = {"--preset", "tiny", "--policy", "layer", "--steps", "1",
                                "--warmup", "0"};
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

// The smallest flatshard trace of one rank (fsdp/trace_format.h).
std::string trace_json(int rank, int world_size) {
  return "{\"otherData\": {\"flatshard_trace\": 1, \"rank\": " + std::to_string(rank) +
         ", \"world_size\": " + std::to_string(world_size) +
         ", \"device\": \"cpu\"}, \"traceEvents\": [{\"ph\": \"X\", \"name\": \"step 0\", "
         "\"cat\": \"step\", \"pid\": " + std::to_string(rank) +
         ", \"tid\": 0, \"ts\": 0, \"dur\": 100, \"args\": {\"step\": 0}}]}";
}

}  // namespace

TEST_CASE("bench: a run that fails after parsing leaves existing output files untouched",
          "[tools][output]") {
  const std::string json = path("keep.json");
  write(json, "previous report\n");
  // --json is fine, --csv's folder does not exist: the run stops before training; the JSON
  // file must not have been truncated on the way.
  const Outcome o = run(FLATSHARD_BENCH_EXE,
                        short_bench({"--json", json, "--csv", path("missing/x.csv")}));
  CAPTURE(o.err);
  CHECK(o.exit_code == 2);
  CHECK(o.err.find("missing/x.csv") != std::string::npos);
  CHECK(read_file(json) == "previous report\n");
  CHECK(temporaries(dir()).empty());  // nothing left beside it
}

TEST_CASE("bench: a full disk is an error naming the file; stdout too", "[tools][output]") {
  const Outcome full = run(FLATSHARD_BENCH_EXE, short_bench({"--csv", "/dev/full"}));
  CAPTURE(full.err);
  CHECK(full.exit_code == 3);
  CHECK(full.err.find("/dev/full") != std::string::npos);
  CHECK(full.err.find("No space left on device") != std::string::npos);
  const Outcome out = run(FLATSHARD_BENCH_EXE, short_bench(), {}, 120, "/dev/full");
  CAPTURE(out.err);
  CHECK(out.exit_code == 3);
  CHECK(out.err.find("standard output") != std::string::npos);
  // A successful run replaces an existing file whole (and leaves no temporary behind).
  const std::string csv = path("replaced.csv");
  write(csv, "old\n");
  const Outcome ok = run(FLATSHARD_BENCH_EXE, short_bench({"--csv", csv}));
  CAPTURE(ok.err);
  CHECK(ok.exit_code == 0);
  CHECK(read_file(csv).rfind("granularity,world_size,", 0) == 0);
  CHECK(temporaries(dir()).empty());
}

TEST_CASE("bench: model sizes are checked against memory before allocating", "[tools][size]") {
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--layers", "1000000000000"},
        std::vector<std::string>{"--d-model", "100000000", "--heads", "1"}}) {
    const Outcome o = run(FLATSHARD_BENCH_EXE, short_bench(flags), {}, 60);
    CAPTURE(flags, o.err);
    CHECK(o.exit_code == 2);
    CHECK(o.err.find("the model does not fit") != std::string::npos);
    CHECK(o.err.find("host memory") != std::string::npos);
    CHECK(std::count(o.err.begin(), o.err.end(), '\n') == 1);
  }
}

TEST_CASE("explain: sizes and limits are checked, stdout is checked", "[tools][size]") {
  const Outcome layers =
      run(FLATSHARD_EXPLAIN_EXE, {"--world", "2", "--n-layers", "1000000000000"}, {}, 60);
  CAPTURE(layers.err);
  CHECK(layers.exit_code == 1);
  // --n-layers is the old name of --layers (docs/vocabulary.md): noted, then read as --layers.
  CHECK(layers.err.find("note: --n-layers is deprecated, use --layers") != std::string::npos);
  CHECK(layers.err.find("--layers 1000000000000 is more than explain builds (at most 65536") !=
        std::string::npos);
  const Outcome params =
      run(FLATSHARD_EXPLAIN_EXE, {"--world", "2", "--d-model", "100000000", "--n-heads", "1"},
          {}, 60);
  CAPTURE(params.err);
  CHECK(params.exit_code == 1);
  CHECK(params.err.find("more than the sanity bound of 1e+15") != std::string::npos);
  const Outcome limit =
      run(FLATSHARD_EXPLAIN_EXE, {"--world", "2", "--memory-limit", "1e30TiB"}, {}, 60);
  CAPTURE(limit.out, limit.err);
  CHECK(limit.exit_code == 2);  // a command-line error (cli/exit.h)
  CHECK(limit.err.find("'1e30TiB' is too large: at most 9223372036854775807 bytes") !=
        std::string::npos);
  CHECK(limit.out.find("limit -") == std::string::npos);
  const Outcome full =
      run(FLATSHARD_EXPLAIN_EXE, {"--world", "2", "--preset", "tiny"}, {}, 60, "/dev/full");
  CAPTURE(full.err);
  CHECK(full.exit_code == 1);
  CHECK(full.err.find("writing to standard output failed") != std::string::npos);
}

TEST_CASE("explain --suggest / --profile and bench --write-profile: inputs are checked",
          "[tools][advisor]") {
  struct Case {
    std::vector<std::string> args;
    const char* says;
  };
  write(path("bad_profile.json"),
        R"({"format": "flatshard-machine-profile", "version": 1, "memory_gbps": -3})");
  write(path("not_json.json"), "{oops");
  const std::vector<Case> cases = {
      {{"--world", "2", "--suggest"}, "--suggest needs --memory-limit"},
      {{"--world", "2", "--batch", "1", "--profile", path("missing.json")}, "missing.json"},
      {{"--world", "2", "--batch", "1", "--profile", path("bad_profile.json")},
       "'memory_gbps' must be > 0"},
      {{"--world", "2", "--batch", "1", "--profile", path("not_json.json")}, "invalid JSON"},
  };
  for (const auto& c : cases) {
    const Outcome o = run(FLATSHARD_EXPLAIN_EXE, c.args, {}, 60);
    CAPTURE(c.args, o.out, o.err);
    CHECK(o.exit_code == 1);
    CHECK(o.err.find(c.says) != std::string::npos);
  }
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--world", "2", "--batch", "0"},
        std::vector<std::string>{"--world", "2", "--suggest", "--memory-limit", "1GiB",
                                 "--offload-levels", "3"}}) {
    const Outcome o = run(FLATSHARD_EXPLAIN_EXE, args, {}, 60);
    CAPTURE(args, o.err);
    CHECK(o.exit_code == 2);  // a usage error, one line (cli/exit.h)
    CHECK(o.err.rfind("flatshard-explain: error: ", 0) == 0);
    CHECK(std::count(o.err.begin(), o.err.end(), '\n') == 1);
  }
  // The advisor end to end, and bench's profile read back by explain.
  const Outcome s = run(FLATSHARD_EXPLAIN_EXE,
                        {"--world", "2", "--preset", "tiny", "--batch", "2", "--suggest",
                         "--memory-limit", "64MiB"},
                        {}, 60);
  CAPTURE(s.err);
  CHECK(s.exit_code == 0);
  CHECK(s.out.find("suggested: ") != std::string::npos);
  CHECK(s.out.find("  spec: ") != std::string::npos);
  const Outcome b = run(FLATSHARD_BENCH_EXE,
                        short_bench({"--granularity", "leaf", "--write-profile", path("p.json")}),
                        {}, 120);
  CAPTURE(b.err);
  CHECK(b.exit_code == 0);
  const Outcome e = run(FLATSHARD_EXPLAIN_EXE,
                        {"--world", "2", "--preset", "tiny", "--batch", "2", "--profile",
                         path("p.json")},
                        {}, 60);
  CAPTURE(e.err);
  CHECK(e.exit_code == 0);
  CHECK(e.out.find("profile: flatshard-bench") != std::string::npos);
  CHECK(e.out.find("calibrated on 'layer'") != std::string::npos);
  const Outcome nowrite =
      run(FLATSHARD_BENCH_EXE, short_bench({"--write-profile", path("no/such/dir/p.json")}), {}, 60);
  CHECK(nowrite.exit_code == 2);
  CHECK(nowrite.err.find("--write-profile") != std::string::npos);
}

TEST_CASE("trace: --merge is whole or untouched; inputs are checked first", "[tools][trace]") {
  const std::string r0 = path("t.rank0.json"), r1 = path("t.rank1.json");
  write(r0, trace_json(0, 2));
  write(r1, trace_json(1, 2));
  const Outcome ok = run(FLATSHARD_TRACE_EXE, {r0, r1});
  CAPTURE(ok.err);
  REQUIRE(ok.exit_code == 0);  // the two files are a valid input

  const Outcome full = run(FLATSHARD_TRACE_EXE, {"--merge", "/dev/full", r0, r1});
  CAPTURE(full.err);
  CHECK(full.exit_code == 1);
  CHECK(full.err.find("/dev/full") != std::string::npos);

  // A bad input (JSON, but not a trace) with an existing --merge file: it stays as it was.
  const std::string merged = path("merged.json"), not_trace = path("not_trace.json");
  write(merged, "previous merge\n");
  write(not_trace, "{\"traceEvents\": []}");
  const Outcome bad = run(FLATSHARD_TRACE_EXE, {"--merge", merged, r0, not_trace});
  CAPTURE(bad.err);
  CHECK(bad.exit_code == 1);
  CHECK(read_file(merged) == "previous merge\n");

  const Outcome out = run(FLATSHARD_TRACE_EXE, {r0, r1}, {}, 60, "/dev/full");
  CAPTURE(out.err);
  CHECK(out.exit_code == 1);
  CHECK(out.err.find("standard output") != std::string::npos);
}

TEST_CASE("trace: a file twice, a rank twice, a rank outside the world are refused",
          "[tools][trace]") {
  const std::string r0 = path("d.rank0.json"), copy = path("d.copy.json"),
                    link = path("d.link.json"), far = path("d.rank5.json");
  write(r0, trace_json(0, 2));
  write(copy, trace_json(0, 2));
  REQUIRE(::symlink(r0.c_str(), link.c_str()) == 0);
  write(far, trace_json(5, 2));
  struct Case {
    std::vector<std::string> files;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{r0, r0}, "is the same file as '" + r0 + "'"},
      {{r0, link}, "is the same file as '" + r0 + "'"},
      {{r0, copy}, "rank 0 is in '" + r0 + "' and again in '" + copy + "'"},
      {{far}, "rank must be an integer in [0, world_size - 1] = [0, 1], got 5"},
  };
  for (const auto& c : cases) {
    const Outcome o = run(FLATSHARD_TRACE_EXE, c.files, {}, 60);
    CAPTURE(c.files, o.out, o.err);
    CHECK(o.exit_code == 1);
    CHECK(o.err.find(c.says) != std::string::npos);
  }
  // A command-line error (no file, a missing one) is a usage error: 2, one line.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{}, std::vector<std::string>{path("no_such_trace.json")}}) {
    const Outcome o = run(FLATSHARD_TRACE_EXE, args, {}, 60);
    CAPTURE(args, o.err);
    CHECK(o.exit_code == 2);
    CHECK(o.err.rfind("flatshard-trace: error: ", 0) == 0);
    CHECK(std::count(o.err.begin(), o.err.end(), '\n') == 1);
  }
}

TEST_CASE("bench: bad environment variables are usage errors on the CPU path",
          "[tools][env]") {
  struct Case {
    std::string var;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"FLATSHARD_TIMEOUT_MS=0",
       "FLATSHARD_TIMEOUT_MS='0' is out of range: expected an integer in [1, 1099511627776]"},
      {"FLATSHARD_TIMEOUT_MS=-1", "FLATSHARD_TIMEOUT_MS='-1' is out of range"},
      {"FLATSHARD_TIMEOUT_MS=abc",
       "FLATSHARD_TIMEOUT_MS='abc' is not an integer: expected an integer in [1, "},
      {"FLATSHARD_WATCHDOG_POLL_MS=0", "FLATSHARD_WATCHDOG_POLL_MS='0' is out of range"},
      {"FLATSHARD_NCCL_WATCHDOG=maybe", "FLATSHARD_NCCL_WATCHDOG='maybe' is not a boolean"},
      {"FLATSHARD_TRACE_STEPS=many", "FLATSHARD_TRACE_STEPS='many' is not an integer"},
      {"MASTER_PORT=junk", "MASTER_PORT='junk' is not an integer: expected one in [1, 65535]"},
      {"MASTER_PORT=70000", "MASTER_PORT=70000 is out of range [1, 65535]"},
      {"WORLD_SIZE=0", "WORLD_SIZE=0 is out of range [1, "},
      {"LOCAL_RANK=-1", "LOCAL_RANK=-1 is out of range [0, "},
      {"TORCHELASTIC_USE_AGENT_STORE=yes", "TORCHELASTIC_USE_AGENT_STORE='yes' must be True"},
  };
  for (const auto& c : cases) {
    const Outcome o = run(FLATSHARD_BENCH_EXE, short_bench(), {c.var}, 120);
    CAPTURE(c.var, o.err);
    CHECK(o.exit_code == 2);
    CHECK(o.out.empty());
    CHECK(o.err.find(c.says) != std::string::npos);
  }
  // RANK >= WORLD_SIZE: refused on cpu too (the launcher says who we are, even if cpu ignores it).
  const Outcome r = run(FLATSHARD_BENCH_EXE, short_bench(),
                        {"RANK=2", "WORLD_SIZE=2", "LOCAL_RANK=0"}, 120);
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("RANK=2 is out of range [0, 1]") != std::string::npos);
}

TEST_CASE("--help reads no environment", "[tools][env]") {
  for (const char* exe : {FLATSHARD_BENCH_EXE, FLATSHARD_EXPLAIN_EXE, FLATSHARD_TRACE_EXE}) {
    const Outcome o =
        run(exe, {"--help"}, {"RANK=-1", "WORLD_SIZE=0", "FLATSHARD_TIMEOUT_MS=abc"}, 60);
    CAPTURE(exe, o.err);
    CHECK(o.exit_code == 0);
    CHECK(o.out.find("--help") != std::string::npos);
    CHECK(o.err.empty());
  }
}
