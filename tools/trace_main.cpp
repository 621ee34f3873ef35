// flatshard-trace — summarise flatshard traces (fsdp/trace.h): where each step's time goes, per
// unit exposed communication, GPU idle gaps and their cause, top offenders with advice.
//
//   FLATSHARD_TRACE=/tmp/run.json ./train            # one file per rank: /tmp/run.rank<R>.json
//   flatshard-trace /tmp/run.rank*.json
//   flatshard-trace --merge /tmp/all.json /tmp/run.rank*.json   # one file for ui.perfetto.dev
//
// Exit code 1 on any error: an input that is not a flatshard trace or not a valid one
// (planner/trace_summary.h says what is), not a regular file or larger than 1 GiB, a rank given
// twice, a --merge file or standard output that cannot be written (the --merge file is then
// unchanged); 2 for a command-line error (no file, a file that does not exist, a --merge file
// that is one of the inputs, under any name of it, or empty: tools/cli_exit.h).
#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <sys/stat.h>

#include <iostream>

#include <nlohmann/json.hpp>

#include "planner/trace_summary.h"
#include "support/input_file.h"
#include "support/output_file.h"
#include "tools/cli_exit.h"

namespace {

// True when both paths exist and name one file (links followed, ./a and a alike).
bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flatshard-trace: summarise flatshard trace files (one per rank, or merged)"};
  std::vector<std::string> files;
  std::string merge;
  flatshard::SummaryOptions opts;
  bool keep_first = false;
  app.add_option("files", files, "trace files written by FLATSHARD_TRACE / TraceOptions::path")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--top", opts.top, "offenders and gaps to list")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--keep-first-step", keep_first, "also count the first (warm-up) step");
  app.add_option("--starved-us", opts.starved_us,
                 "GPU ran an event within this many us of its host recording: it was starved")
      ->capture_default_str();
  auto* o_merge =
      app.add_option("--merge", merge, "also write all files as one trace (for ui.perfetto.dev)");
  int parse_exit = 0;
  if (!flatshard::tools::parse_command_line(app, argc, argv, "flatshard-trace", &parse_exit))
    return parse_exit;
  opts.skip_first_step = !keep_first;
  if (o_merge->count() && merge.empty()) {
    std::cerr << "flatshard-trace: error: --merge needs a file path, got ''" << std::endl;
    return flatshard::tools::kExitUsage;
  }
  // The merge replaces its file: an input there would be overwritten by its own merge.
  for (const auto& f : files)
    if (!merge.empty() && same_file(merge, f)) {
      std::cerr << "flatshard-trace: error: --merge '" << flatshard::printable_escape(merge)
                << "' is the input '" << flatshard::printable_escape(f)
                << "': write the merge to a new file" << std::endl;
      return flatshard::tools::kExitUsage;
    }
  try {
    // Every input is checked (marker, rank, duplicates) before anything is written.
    const auto ranks = flatshard::read_trace_files(files);
    if (!merge.empty()) {
      std::vector<nlohmann::json> docs;
      for (const auto& f : files) docs.push_back(flatshard::read_trace_json(f));
      // Whole or not at all: an existing file survives a failed write (support/output_file.h).
      flatshard::write_file(merge, flatshard::merge_traces(docs).dump() + "\n", "--merge");
    }
    std::cout << flatshard::summarize(ranks, opts).to_string();
    flatshard::flush_stdout();
  } catch (const c10::Error& e) {
    std::cerr << "flatshard-trace: " << e.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
