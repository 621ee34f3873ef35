// The tools' inputs (issue 36): support/input_file.h's one input path, what a valid trace is
// (planner/trace_summary.h), --merge onto an input, the machine profile's physical bounds
// (planner/machine_profile.h), predictions that are finite or refused (planner/cost_model.h),
// control bytes echoed to the terminal, --write-profile '' and FLATSHARD_TRACE=<directory>.
// Every misuse of a tool runs it as a child process under timeout(1) (and, where the old code
// ran out of memory, under a memory limit), so a hang or a crash fails a check instead of the
// test binary.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "collectives/thread_communicator.h"
#include "fsdp/call.h"
#include "fsdp/meta_init.h"
#include "fsdp/sharded_model.h"
#include "models/family.h"
#include "planner/cost_model.h"
#include "planner/explain.h"
#include "planner/machine_profile.h"
#include "support/input_file.h"
#include "temp_dir.h"
#include "tool_run.h"
#include "wrap_policies/plan.h"
#include "wrap_policies/spec.h"

#ifndef FLATSHARD_TRACE_EXE
#error "FLATSHARD_BENCH_EXE, FLATSHARD_EXPLAIN_EXE and FLATSHARD_TRACE_EXE must be defined by CMake"
#endif

using namespace flatshard;

namespace {

struct Outcome : flatshard_test::ToolRun {
  int lines() const { return static_cast<int>(std::count(err.begin(), err.end(), '\n')); }
  // Lines of stderr from the first that starts with `prefix` (the tool's own error) to the end.
  int lines_from(const std::string& prefix) const {
    const size_t at = err.rfind("\n" + prefix) != std::string::npos ? err.rfind("\n" + prefix) + 1
                      : err.rfind(prefix, 0) == 0                   ? 0
                                                                    : err.size();
    return static_cast<int>(std::count(err.begin() + static_cast<std::ptrdiff_t>(at), err.end(),
                                       '\n'));
  }
};

using flatshard_test::slurp;
std::string quote(const std::string& s) { return flatshard_test::shell_quote(s); }

void write(const std::string& p, const std::string& text) {
  std::ofstream f(p, std::ios::binary);
  f << text;
}

const std::string& dir() {
  static flatshard_test::TempDir d;
  return d.path();
}
std::string path(const std::string& name) { return dir() + "/" + name; }

// Runs `exe args` (stdin /dev/null) under timeout(1), its address space limited to `vm_kib`
// (0: no limit), with `env` (NAME=value) added.
Outcome run(const char* exe, const std::vector<std::string>& args, int seconds = 60,
            long vm_kib = 0, const std::vector<std::string>& env = {}) {
  Outcome o;
  static_cast<flatshard_test::ToolRun&>(o) =
      flatshard_test::run_tool(dir(), exe, args, {seconds, vm_kib, env, ""});
  return o;
}

bool has_control_bytes(const std::string& s) {
  for (const char c : s)
    if (c != '\n' && (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)) return true;
  return false;
}

// --- hand-made traces (fsdp/trace_format.h) ----------------------------------------------------

std::string event(const std::string& name, const std::string& cat, double ts, double dur,
                  const std::string& unit = "", const std::string& phase = "forward",
                  int step = 0, int tid = 0) {
  std::ostringstream os;
  os << R"({"ph": "X", "name": ")" << name << R"(", "cat": ")" << cat << R"(", "ts": )" << ts
     << R"(, "dur": )" << dur << R"(, "pid": 0, "tid": )" << tid << R"(, "args": {"step": )"
     << step;
  if (!unit.empty()) os << R"(, "unit": ")" << unit << R"(", "phase": ")" << phase << '"';
  os << "}}";
  return os.str();
}

// One rank (world 1), units u0 and u1, the given events after metadata.
std::string trace(const std::vector<std::string>& events) {
  std::string s = R"({"otherData": {"flatshard_trace": 1, "rank": 0, "world_size": 1, )"
                  R"("device": "cpu", "units": [{"name": "u0", "all_gather_bytes": 64}, )"
                  R"({"name": "u1", "all_gather_bytes": 64}]}, "traceEvents": [)"
                  R"({"ph": "M", "pid": 0, "name": "process_name", "args": {"name": "rank 0"}})";
  for (const auto& e : events) s += ",\n" + e;
  return s + "]}";
}

// A valid trace of two steps: each unit's forward and all-gather on the host track.
std::vector<std::string> valid_events() {
  std::vector<std::string> ev;
  for (int step = 0; step < 2; ++step) {
    const double t0 = 1000.0 * step;
    ev.push_back(event("step " + std::to_string(step), "step", t0, 900, "", "", step));
    ev.push_back(event("all_gather u0", "all_gather", t0 + 10, 50, "u0", "forward", step));
    ev.push_back(event("fwd u0", "forward", t0 + 100, 200, "u0", "forward", step));
    ev.push_back(event("all_gather u1", "all_gather", t0 + 310, 50, "u1", "forward", step));
    ev.push_back(event("fwd u1", "forward", t0 + 400, 200, "u1", "forward", step));
  }
  return ev;
}

std::shared_ptr<torch::nn::Module> build_meta(const models::ModelConfig& c) {
  MetaInit meta;
  return c.build(0);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace

TEST_CASE("input file: FIFOs, devices, directories and sizes are refused, naming the path",
          "[tools][inputs]") {
  const std::string fifo = path("in.fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string big = path("big.txt");
  { std::ofstream(big) << std::string(100, 'x'); }
  CHECK_THAT(error_of([&] { read_input_file(fifo, 1 << 20, "input"); }),
             Catch::Contains("input '" + fifo + "': is a FIFO, not a regular file"));
  CHECK_THAT(error_of([&] { read_input_file("/dev/zero", 1 << 20, "input"); }),
             Catch::Contains("input '/dev/zero': is a device"));
  CHECK_THAT(error_of([&] { read_input_file(dir(), 1 << 20, "input"); }),
             Catch::Contains("is a directory"));
  CHECK_THAT(error_of([&] { read_input_file(big, 99, "input"); }),
             Catch::Contains("input '" + big + "': 100 bytes, more than the limit of 99 bytes"));
  CHECK(read_input_file(big, 100, "input") == std::string(100, 'x'));
  CHECK_THAT(error_of([&] { read_input_file(path("none"), 10, "input"); }),
             Catch::Contains("cannot open: No such file or directory"));
  // JSON through the strict reader: nesting is bounded.
  write(path("deep.json"), std::string(1000, '['));
  CHECK_THAT(error_of([&] { read_json_file(path("deep.json"), 1 << 20, "input"); }),
             Catch::Contains("nesting deeper than 64"));
  // Control bytes are escaped for printing; UTF-8 is kept.
  CHECK(printable_escape("a\x1b[31mb\x07\n\x7f caf\xc3\xa9 \xc2\x9b") ==
        "a\\x1b[31mb\\x07\\x0a\\x7f caf\xc3\xa9 \\xc2\\x9b");
}

TEST_CASE("trace: a FIFO is refused, not waited on; a huge or deep file is an error",
          "[tools][inputs][trace]") {
  // Before: std::ifstream blocked on the FIFO forever (killed by the timeout), 200 MB of '['
  // ended in std::bad_alloc and SIGABRT, and a sparse 1 GiB + 1 file was read whole.
  const std::string fifo = path("trace.fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const Outcome f = run(FLATSHARD_TRACE_EXE, {fifo}, 20);
  CAPTURE(f.err);
  CHECK(f.exit_code == 1);
  CHECK(f.err.find("'" + fifo + "': is a FIFO, not a regular file") != std::string::npos);
  CHECK(f.lines() == 1);

  const std::string deep = path("deep.json");
  write(deep, std::string(200 << 20, '['));
  const Outcome d = run(FLATSHARD_TRACE_EXE, {deep}, 60, /*vm_kib=*/3L << 20);
  std::remove(deep.c_str());
  CAPTURE(d.err);
  CHECK(d.exit_code == 1);
  CHECK(d.err.find(deep + ": not valid JSON: nesting deeper than 64 levels") != std::string::npos);
  CHECK(d.lines() == 1);

  const std::string huge = path("huge.json");
  { std::ofstream(huge) << "{"; }
  REQUIRE(::truncate(huge.c_str(), (int64_t{1} << 30) + 1) == 0);  // sparse
  const Outcome h = run(FLATSHARD_TRACE_EXE, {huge}, 60);
  std::remove(huge.c_str());
  CAPTURE(h.err);
  CHECK(h.exit_code == 1);
  CHECK(h.err.find("1073741825 bytes, more than a trace's limit") != std::string::npos);
}

TEST_CASE("trace: inconsistent events are refused, naming the file and the first bad event",
          "[tools][inputs][trace]") {
  const std::string ok = path("ok.json");
  write(ok, trace(valid_events()));
  const Outcome good = run(FLATSHARD_TRACE_EXE, {ok});
  CAPTURE(good.err);
  REQUIRE(good.exit_code == 0);
  CHECK(good.out.find("fwd ms") != std::string::npos);

  struct Case {
    const char* what;
    std::vector<std::string> events;
    std::string says;
  };
  auto with = [](std::vector<std::string> ev, const std::string& extra) {
    ev.push_back(extra);
    return ev;
  };
  std::vector<std::string> repeated = valid_events();
  for (int i = 0; i < 7000; ++i) repeated.push_back(repeated[7]);  // step 1's fwd u0
  std::vector<std::string> no_steps;
  for (const auto& e : valid_events())
    if (e.find("\"step\", \"ts\"") == std::string::npos) no_steps.push_back(e);
  // traceEvents[0] is the metadata event: the first event after valid_events() is index 11.
  const std::vector<Case> cases = {
      {"negative duration", with(valid_events(), event("fwd u0", "backward", 1500, -7e9, "u0",
                                                        "backward", 1)),
       "trace event 11 'fwd u0': 'dur' -7000000000.0 is outside [0, 1e+12] us"},
      {"huge duration",
       with(valid_events(), event("bwd u1", "backward", 1500, 1e308, "u1", "backward", 1)),
       "trace event 11 'bwd u1': 'dur' 1e+308 is outside [0, 1e+12] us"},
      {"huge timestamp",
       with(valid_events(), event("bwd u1", "backward", 1e300, 5, "u1", "backward", 1)),
       "trace event 11 'bwd u1': 'ts' 1e+300 is outside"},
      {"a repeated event", repeated,
       "trace event 11 'fwd u0': the same event as trace event 8"},
      {"a unit not in the unit table",
       with(valid_events(), event("fwd ghost", "forward", 1700, 5, "ghost", "forward", 1)),
       "trace event 11 'fwd ghost': unit 'ghost' is not in rank 0's otherData.units"},
      {"an unknown phase",
       with(valid_events(), event("bwd u1", "backward", 1500, 5, "u1", "sideways", 1)),
       "trace event 11 'bwd u1': phase 'sideways' is neither 'forward' nor 'backward'"},
      {"a step without its step event",
       with(valid_events(), event("bwd u1", "backward", 1500, 5, "u1", "backward", 9)),
       "trace event 11 'bwd u1': step 9 of rank 0 has no step event"},
      {"a second step event", with(valid_events(), event("step 1", "step", 1800, 5, "", "", 1)),
       "trace event 11 'step 1': a second step event for step 1 of rank 0"},
      {"no step events", no_steps, "rank 0 has no step events"},
      {"two faults: the first in the file is named",
       with(with(valid_events(), event("fwd ghost", "forward", 1700, 5, "ghost", "forward", 1)),
            event("bwd u1", "backward", 1500, -1, "u1", "backward", 1)),
       "trace event 11 'fwd ghost': unit 'ghost'"},
  };
  for (const auto& c : cases) {
    const std::string p = path("bad.json");
    write(p, trace(c.events));
    const Outcome o = run(FLATSHARD_TRACE_EXE, {p});
    CAPTURE(c.what, o.out, o.err);
    CHECK(o.exit_code == 1);
    CHECK(o.err.rfind("flatshard-trace: " + p + ": ", 0) == 0);  // the file first
    CHECK(o.err.find(c.says) != std::string::npos);
    CHECK(o.lines() == 1);
  }
}

TEST_CASE("trace: a real trace is accepted (a unit entered twice per pass included)",
          "[tools][inputs][trace]") {
  // The recorder's own output: every valid trace must stay valid. Units of two layers
  // (blocks.0-1) are entered twice per forward: two pre_forward and fwd spans per step.
  const std::string p = path("real_{rank}.json");
  run_ranks(2, [&](Communicator& comm) {
    const auto cfg = models::ModelConfig::preset("gpt", "tiny");
    auto model = cfg.build(0);
    ShardingOptions o;
    o.trace.path = p;
    auto fsdp = fully_shard(model, make_plan(*model, parse_policy("every=2,type=Block")), comm, o);
    for (int step = 0; step < 3; ++step) {
      const auto b = cfg.synthetic_batch(2, 3, comm.rank(), step);
      enter(model, [&] { return cfg.loss(*model, b.first, b.second); }).backward();
    }
  });
  const Outcome o = run(FLATSHARD_TRACE_EXE, {path("real_0.json"), path("real_1.json")});
  CAPTURE(o.err);
  CHECK(o.exit_code == 0);
  CHECK(o.out.find("blocks.0-1") != std::string::npos);
}

TEST_CASE("trace --merge onto one of its inputs is a command-line error",
          "[tools][inputs][trace]") {
  // Before: `--merge r1.json r0.json r1.json` replaced r1.json with the merge and exited 0.
  const std::string r0 = path("m.rank0.json"), r1 = path("m.rank1.json");
  auto rank_trace = [](int rank) {
    return R"({"otherData": {"flatshard_trace": 1, "rank": )" + std::to_string(rank) +
           R"(, "world_size": 2}, "traceEvents": [{"ph": "X", "name": "step 0", "cat": "step", )"
           R"("pid": )" + std::to_string(rank) + R"(, "tid": 0, "ts": 0, "dur": 100, "args": )"
           R"({"step": 0}}]})";
  };
  write(r0, rank_trace(0));
  write(r1, rank_trace(1));
  const std::string link = path("m.link.json");
  REQUIRE(::symlink(r1.c_str(), link.c_str()) == 0);
  for (const std::string& out : {r1, dir() + "/./m.rank1.json", link}) {
    const Outcome o = run(FLATSHARD_TRACE_EXE, {"--merge", out, r0, r1});
    CAPTURE(out, o.err);
    CHECK(o.exit_code == 2);
    CHECK(o.err.rfind("flatshard-trace: error: --merge '" + out + "' is the input '" + r1 + "'",
                      0) == 0);
    CHECK(o.lines() == 1);
    CHECK(slurp(r1) == rank_trace(1));
  }
  const Outcome empty = run(FLATSHARD_TRACE_EXE, {"--merge", "", r0, r1});
  CHECK(empty.exit_code == 2);
  CHECK(empty.err == "flatshard-trace: error: --merge needs a file path, got ''\n");
  const Outcome fine = run(FLATSHARD_TRACE_EXE, {"--merge", path("m.all.json"), r0, r1});
  CAPTURE(fine.err);
  CHECK(fine.exit_code == 0);
}

TEST_CASE("machine profile: values outside physical bounds are refused naming key, value, "
          "bounds and file", "[tools][inputs][profile]") {
  const std::string head = R"({"format": "flatshard-machine-profile", "version": 1, )";
  struct Case {
    std::string key, value, says;
  };
  const std::vector<Case> cases = {
      {"compute_tflops", "1e-308", "within its physical bounds [1e-06, 100000] TFLOP/s"},
      {"host_overlap_norm", "0.001", "within its physical bounds [1, 64]"},
      {"allocator_slack", "1e9", "within its physical bounds [0, 10]"},
      {"all_gather_latency_us", "1e308", "within its physical bounds [0, 1e+06] us"},
      {"memory_gbps", "1e-9", "within its physical bounds [0.0001, 100000] GB/s"},
  };
  for (const auto& c : cases) {
    const std::string p = path("absurd_" + c.key + ".json");
    write(p, head + "\"" + c.key + "\": " + c.value + "}");
    // Before: explain printed 60-digit or inf predictions and exited 0.
    const Outcome o = run(FLATSHARD_EXPLAIN_EXE,
                          {"--world", "2", "--preset", "tiny", "--batch", "2", "--profile", p});
    CAPTURE(c.key, o.out, o.err);
    CHECK(o.exit_code == 1);
    CHECK(o.err.find("machine profile '" + p + "': /" + c.key + ": '" + c.key + "' must be") !=
          std::string::npos);
    CHECK(o.err.find(c.says) != std::string::npos);
    CHECK(o.lines_from("flatshard-explain: ") == 1);  // the error is one line
  }
  // Every default is inside its bounds, and a profile written in code is checked on save.
  CHECK_NOTHROW(check_profile(MachineProfile::defaults(), "defaults"));
  MachineProfile m;
  m.allocator_slack = 1e9;
  CHECK_THAT(error_of([&] { save_profile(m, path("never.json")); }),
             Catch::Contains("'allocator_slack' must be >= 0 and at most 10"));
  struct stat st {};
  CHECK(::stat(path("never.json").c_str(), &st) != 0);
}

TEST_CASE("cost model: a prediction is finite or refused", "[tools][inputs][profile]") {
  const auto cfg = models::ModelConfig::preset("gpt", "tiny");
  auto model = build_meta(cfg);
  const Explanation e = explain(*model, make_plan(*model, parse_policy("type=Block")),
                                MeshShape(2, 1), ShardingOptions{});
  CHECK(std::isfinite(predict_cost(e, cfg.transformer_shape(), {2, 16}, {}).step_ms));
  MachineProfile slow;  // built in code: no file, no bounds check on the way
  slow.compute_tflops = 1e-300;
  CHECK_THAT(error_of([&] { predict_cost(e, cfg.transformer_shape(), {2, 16}, slow); }),
             Catch::Contains("is not a finite time of at most 1e+18 ms"));
  MachineProfile slack;
  slack.allocator_slack = 1e300;
  CHECK_THAT(error_of([&] { predict_cost(e, cfg.transformer_shape(), {2, 16}, slack); }),
             Catch::Contains("is not a finite byte count"));
}

TEST_CASE("control bytes of a profile's source and of --granularity reach no terminal",
          "[tools][inputs][escape]") {
  const std::string p = path("esc_profile.json");
  write(p, R"({"format": "flatshard-machine-profile", "version": 1, )"
           R"("source": "evil\u001b[31m\u0007"})");
  const Outcome e = run(FLATSHARD_EXPLAIN_EXE,
                        {"--world", "2", "--preset", "tiny", "--batch", "2", "--profile", p});
  CAPTURE(e.err);
  CHECK(e.exit_code == 0);
  CHECK_FALSE(has_control_bytes(e.out));
  CHECK(e.out.find("profile: evil\\x1b[31m\\x07") != std::string::npos);
  const Outcome b = run(FLATSHARD_BENCH_EXE,
                        {"--preset", "tiny", "--granularity", "layer\x1b[31m\x07", "--steps", "1"});
  CAPTURE(b.err);
  CHECK(b.exit_code == 2);
  CHECK_FALSE(has_control_bytes(b.err));
  CHECK(b.err.find("--policy 'layer\\x1b[31m\\x07'") != std::string::npos);
  CHECK(b.lines() == 1);
}

TEST_CASE("bench --write-profile '' is a usage error", "[tools][inputs]") {
  // Before: the bench ran, wrote nothing and exited 0.
  const Outcome o = run(FLATSHARD_BENCH_EXE, {"--preset", "tiny", "--granularity", "layer",
                                              "--steps", "1", "--warmup", "0",
                                              "--write-profile", ""},
                        120);
  CAPTURE(o.err);
  CHECK(o.exit_code == 2);
  CHECK(o.err.find("--write-profile needs a file path") != std::string::npos);
  CHECK(o.lines() == 1);
}

TEST_CASE("bench --json '' / --csv '' / --plot '' are usage errors", "[tools][inputs]") {
  // Before: the bench ran, wrote nothing and exited 0.
  for (const char* flag : {"--json", "--csv", "--plot"}) {
    const Outcome o = run(FLATSHARD_BENCH_EXE, {"--preset", "tiny", "--policy", "layer",
                                                "--steps", "1", "--warmup", "0", flag, ""},
                          120);
    CAPTURE(flag, o.err);
    CHECK(o.exit_code == 2);
    CHECK(o.err.find(std::string(flag) + " needs a file path, got ''") != std::string::npos);
  }
}

TEST_CASE("bench: a recompute rule matching only the root is a usage error", "[tools][inputs]") {
  // Before: fully_shard(policy) refused it, but the bench's own plan only warned and trained
  // without recompute. The tiny GPT's root is "GPT".
  const Outcome o = run(FLATSHARD_BENCH_EXE, {"--preset", "tiny", "--policy",
                                              "type=Block;recompute:type=GPT", "--steps", "1",
                                              "--warmup", "0"},
                        120);
  CAPTURE(o.err);
  CHECK(o.exit_code == 2);
  CHECK(o.err.find("recompute") != std::string::npos);
  CHECK(o.err.find("root") != std::string::npos);
}

TEST_CASE("FLATSHARD_TRACE=<a directory> is refused at setup", "[tools][inputs][trace]") {
  // Before: the trace went to "<directory>.rank0" beside it (world 2), or failed with a
  // warning at exit (world 1), without a word at setup.
  const std::string d = path("trace_dir");
  REQUIRE(::mkdir(d.c_str(), 0700) == 0);
  for (const std::string& value : {d, d + "/"}) {
    ::setenv("FLATSHARD_TRACE", value.c_str(), 1);
    std::string err;
    try {
      run_ranks(2, [&](Communicator& comm) {
        const auto cfg = models::ModelConfig::preset("gpt", "tiny");
        auto model = cfg.build(0);
        fully_shard(model, make_plan(*model, parse_policy("type=Block")), comm);
      });
    } catch (const c10::Error& e) {
      err = e.what_without_backtrace();
    }
    ::unsetenv("FLATSHARD_TRACE");
    CAPTURE(value, err);
    CHECK(err.find("flatshard trace: '" + value + "'") != std::string::npos);
    CHECK(err.find("is a directory, not a file path") != std::string::npos);
    struct stat st {};
    CHECK(::stat((d + ".rank0").c_str(), &st) != 0);
  }
}
