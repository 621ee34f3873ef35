// The command-line options flatshard-bench and flatshard-explain share (cli/, issue 49): numbers
// are decimal only and whole ("--world 010" is 10, not 8; "--layers 0x10" is an error, not 16;
// "--seed -1" is an error, not 2^64 - 1), an empty value that would mean something (no memory
// limit, the default model) is refused, and every value echoed to the terminal is escaped. The
// tools run as child processes (tests/tool_run.h), so a crash or a hang fails a check.
#include <algorithm>
#include <catch2/catch.hpp>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/numbers.h"
#include "temp_dir.h"
#include "tool_run.h"

#ifndef FLATSHARD_EXPLAIN_EXE
#error "FLATSHARD_BENCH_EXE and FLATSHARD_EXPLAIN_EXE must be defined by CMake"
#endif

using namespace flatshard;

namespace {

const std::string& dir() {
  static flatshard_test::TempDir d;
  return d.path();
}

flatshard_test::ToolRun run(const char* exe, const std::vector<std::string>& args,
                            int seconds = 120) {
  return flatshard_test::run_tool(dir(), exe, args, {seconds, 0, {}, ""});
}

int lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

bool has_control_bytes(const std::string& s) {
  for (unsigned char c : s)
    if ((c < 0x20 && c != '\n') || c == 0x7f) return true;
  return false;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("cli numbers: decimal only, whole text, the value in range", "[cli]") {
  CHECK(cli::parse_integer("010") == 10);
  CHECK(cli::parse_integer("-0") == 0);
  CHECK(cli::parse_integer("-9223372036854775808") == std::numeric_limits<int64_t>::min());
  CHECK(cli::parse_integer("9223372036854775807") == std::numeric_limits<int64_t>::max());
  for (const char* bad : {"0x10", "0X10", "0b1", "", "-", "+5", " 5", "5 ", "1e3", "1.0", "ten"})
    CHECK_THAT(error_of([&] { cli::parse_integer(bad); }),
               Catch::StartsWith("expected a decimal integer, got '"));
  CHECK(error_of([] { cli::parse_integer("0", 1, 10); }) == "must be >= 1, got 0");
  CHECK(error_of([] { cli::parse_integer("11", 1, 10); }) == "must be <= 10, got 11");
  CHECK(error_of([] { cli::parse_integer("99999999999999999999", 1, 10); }) ==
        "must be <= 10, got 99999999999999999999");
  CHECK(error_of([] { cli::parse_integer("-99999999999999999999", 1, 10); }) ==
        "must be >= 1, got -99999999999999999999");
  CHECK(error_of([] { cli::parse_integer("\x1b[31m"); }) ==
        "expected a decimal integer, got '\\x1b[31m'");

  CHECK(cli::parse_unsigned("18446744073709551615") == std::numeric_limits<uint64_t>::max());
  CHECK(cli::parse_unsigned("007") == 7);
  CHECK_THAT(error_of([] { cli::parse_unsigned("-1"); }),
             Catch::StartsWith("expected a decimal integer in [0, 18446744073709551615], got '-1'"));
  CHECK_THAT(error_of([] { cli::parse_unsigned("18446744073709551616"); }),
             Catch::Contains("out of range"));

  CHECK(cli::parse_number("0.5") == 0.5);
  CHECK(cli::parse_number(".5") == 0.5);
  CHECK(cli::parse_number("5.") == 5.0);
  CHECK(cli::parse_number("-1e3") == -1000.0);
  CHECK(cli::parse_number("010") == 10.0);
  for (const char* bad : {"0x10", "0x1p4", "inf", "nan", "", ".", "e5", "1e", "1e+", "1,5", "+1"})
    CHECK_THAT(error_of([&] { cli::parse_number(bad); }),
               Catch::StartsWith("expected a decimal number, got '"));
  CHECK_THAT(error_of([] { cli::parse_number("1e999"); }), Catch::Contains("out of a double"));

  CHECK(cli::escape_lines("a\x1b\nb\x07") == "a\\x1b\nb\\x07");
}

TEST_CASE("explain: integers and numbers are decimal; an error names the flag and the text",
          "[cli][explain]") {
  // Before: CLI11 read "010" as 8 (octal) and "0x10" as 16.
  const auto ten = run(FLATSHARD_EXPLAIN_EXE, {"--preset", "tiny", "--world", "010"});
  CAPTURE(ten.out, ten.err);
  CHECK(ten.exit_code == 0);
  CHECK(ten.out.find("world 10") != std::string::npos);
  CHECK(ten.out.find("world 8") == std::string::npos);
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"--layers", "0x10"}, "--layers: expected a decimal integer, got '0x10'"},
      {{"--world", "0x2"}, "--world: expected a decimal integer, got '0x2'"},
      {{"--vocab", "1e3"}, "--vocab: expected a decimal integer, got '1e3'"},
      {{"--batch", "0b1"}, "--batch: expected a decimal integer, got '0b1'"},
      {{"--offload", "0x1"}, "--offload: expected a decimal integer, got '0x1'"},
      {{"--reference-step-ms", "0x10"}, "--reference-step-ms: expected a decimal number, got '0x10'"},
      {{"--collective-latency-us", "inf"},
       "--collective-latency-us: expected a decimal number, got 'inf'"},
      {{"--suggest", "--memory-limit", "1GiB", "--prefetch-depths", "0x1"}, "'0x1' is not an integer"},
      // An empty value used to mean something: no limit, the default GPT, the default policy.
      {{"--memory-limit", ""}, "--memory-limit: needs a size such as 40GiB, got ''"},
      {{"--policy", ""}, "--policy: needs a named plan or a policy spec, got ''"},
      {{"--profile", "", "--batch", "2"}, "--profile: needs a file path, got ''"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {"--preset", "tiny", "--world", "2"};
    if (c.args[0] == "--world") args = {"--preset", "tiny"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const auto o = run(FLATSHARD_EXPLAIN_EXE, args);
    CAPTURE(c.args, o.out, o.err);
    CHECK(o.exit_code == 2);
    CHECK(o.err.rfind("flatshard-explain: error: ", 0) == 0);
    CHECK(lines(o.err) == 1);
    CHECK(o.err.find(c.says) != std::string::npos);
  }
  // --weights "" explained the default GPT preset.
  const auto w = run(FLATSHARD_EXPLAIN_EXE, {"--weights", "", "--world", "2"});
  CAPTURE(w.out, w.err);
  CHECK(w.exit_code == 2);
  CHECK(w.out.empty());
  CHECK(w.err.find("--weights: needs a path, got ''") != std::string::npos);
}

TEST_CASE("explain: command-line values reach the terminal escaped", "[cli][explain][escape]") {
  const std::vector<std::vector<std::string>> cases = {
      {"--strategy", "full\x1b[31m"},        // CLI11's own error quotes the value
      {"--policy", "type=Bl\x1b[31mock"},    // a policy spec's parse error ('?' in its echo)
      {"--policy", "le\x07" "af"},             // "did you mean"
      {"--layers", "1\x1b[31m"},              // a number
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {"--preset", "tiny", "--world", "2"};
    args.insert(args.end(), c.begin(), c.end());
    const auto o = run(FLATSHARD_EXPLAIN_EXE, args);
    CAPTURE(c, o.out, o.err);
    CHECK(o.exit_code != 0);
    CHECK_FALSE(has_control_bytes(o.out));
    CHECK_FALSE(has_control_bytes(o.err));
    CHECK(o.err.find(c[0] == "--policy" && c[1][0] == 't' ? "?[31mock" : "\\x") !=
          std::string::npos);
  }
}

TEST_CASE("bench: integers are decimal; an error names the flag and the text", "[cli][bench]") {
  // Before: "--heads 010" was 8 heads (which divide the tiny GPT's 64 wide model: it ran),
  // "--seed -1" was 2^64 - 1 and the hexadecimal ones were read as such.
  const std::vector<std::string> run_fast = {"--preset", "tiny", "--policy", "layer", "--steps",
                                             "1", "--warmup", "0"};
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{"--heads", "010"}, "--heads 10 does not divide --d-model 64"},
      {{"--vocab", "0x10"}, "--vocab: expected a decimal integer, got '0x10'"},
      {{"--d-model", "0x40"}, "--d-model: expected a decimal integer, got '0x40'"},
      {{"--batch", "0x2"}, "--batch: expected a decimal integer, got '0x2'"},
      {{"--layers", "0x1"}, "--layers: expected a decimal integer, got '0x1'"},
      {{"--world", "0x1"}, "--world: expected a decimal integer, got '0x1'"},
      {{"--seed", "0x1"}, "--seed: expected a decimal integer in [0, 18446744073709551615], got '0x1'"},
      {{"--seed", "-1"}, "--seed: expected a decimal integer in [0, 18446744073709551615], got '-1'"},
      {{"--offload", "0,0x1"}, "--offload: expected a decimal integer, got '0x1'"},
      {{"--peak-tflops", "0x10"}, "--peak-tflops: expected a decimal number, got '0x10'"},
      {{"--seq", "\x1b[31m"}, "--seq: expected a decimal integer, got '\\x1b[31m'"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = run_fast;
    args.insert(args.end(), c.args.begin(), c.args.end());
    const auto o = run(FLATSHARD_BENCH_EXE, args, 300);
    CAPTURE(c.args, o.out, o.err);
    CHECK(o.exit_code == 2);
    CHECK(o.err.rfind("flatshard-bench: error: ", 0) == 0);
    CHECK(lines(o.err) == 1);
    CHECK_FALSE(has_control_bytes(o.err));
    CHECK(o.err.find(c.says) != std::string::npos);
  }
}

TEST_CASE("--gather-dtype: explain shows the wire; unknown names are refused", "[cli][explain]") {
  // flat_param/quantized_gather.h; the bytes themselves are held equal to the runtime's
  // counters by tests/explain_test.cpp.
  const auto fp8 = run(FLATSHARD_EXPLAIN_EXE,
                       {"--preset", "tiny", "--world", "2", "--param-dtype", "bf16",
                        "--gather-dtype", "fp8"});
  CAPTURE(fp8.out, fp8.err);
  CHECK(fp8.exit_code == 0);
  CHECK(fp8.out.find(", gather fp8,") != std::string::npos);
  CHECK(fp8.out.find("fp8 amax all-reduces") != std::string::npos);
  const auto bad = run(FLATSHARD_EXPLAIN_EXE, {"--preset", "tiny", "--gather-dtype", "FP8"});
  CAPTURE(bad.out, bad.err);
  CHECK(bad.exit_code == 2);
  CHECK(bad.err.find("--gather-dtype") != std::string::npos);
  const auto bench = run(FLATSHARD_BENCH_EXE, {"--gather-dtype", "e5m2", "--steps", "1"});
  CAPTURE(bench.out, bench.err);
  CHECK(bench.exit_code == 2);
  CHECK(bench.err.find("--gather-dtype") != std::string::npos);
}
