// flatshard-trace — summarise flatshard traces (fsdp/trace.h): where each step's time goes, per
// unit exposed communication, GPU idle gaps and their cause, top offenders with advice.
//
//   FLATSHARD_TRACE=/tmp/run.json ./train            # one file per rank: /tmp/run.rank<R>.json
//   flatshard-trace /tmp/run.rank*.json
//   flatshard-trace /tmp/run.json                   # the same: the FLATSHARD_TRACE value finds its
//                                                   # rank files (or one flatshard-bench run's)
//   flatshard-trace --merge /tmp/all.json /tmp/run.rank*.json   # one file for ui.perfetto.dev
//
// Exit code 1 on any error: an input that is not a flatshard trace or not a valid one
// (planner/trace_summary.h says what is), not a regular file or larger than 1 GiB, a rank given
// twice, a --merge file or standard output that cannot be written (the --merge file is then
// unchanged); 2 for a command-line error (no file, a file that does not exist and is no
// FLATSHARD_TRACE value with rank files, or one whose files belong to several flatshard-bench
// runs: the error lists them; a --merge file
// that is one of the inputs, under any name of it, or empty: cli/exit.h).
#include <CLI/CLI.hpp>
#include <c10/util/Exception.h>

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <iostream>
#include <map>
#include <optional>

#include <nlohmann/json.hpp>

#include "fsdp/trace.h"
#include "planner/trace_summary.h"
#include "support/input_file.h"
#include "support/output_file.h"
#include "cli/exit.h"

namespace {

// True when both paths exist and name one file (links followed, ./a and a alike).
bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {}, sb {};
  return ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 && sa.st_dev == sb.st_dev &&
         sa.st_ino == sb.st_ino;
}

// "rank<digits>" at the end of `s` (after a '.' or at its start): the rank, else nullopt.
std::optional<long> trailing_rank(const std::string& s, std::string* before) {
  const size_t at = s.rfind("rank");
  if (at == std::string::npos || at + 4 == s.size() || at + 4 + 9 < s.size()) return std::nullopt;
  if (at > 0 && s[at - 1] != '.') return std::nullopt;
  for (size_t i = at + 4; i < s.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(s[i]))) return std::nullopt;
  *before = at == 0 ? "" : s.substr(0, at - 1);
  return std::stol(s.substr(at + 4));
}

// The files FLATSHARD_TRACE=`path` leads to when `path` itself does not exist (fsdp/trace.h
// names rank files "<stem>.rank<R>.json"; flatshard-bench one set per run,
// "<stem>.<run>.rank<R>.json", or "<stem>.<run>.json" at one rank), grouped by run ("" for the
// plain rank files), each group ordered by rank.
std::map<std::string, std::vector<std::pair<long, std::string>>> trace_files_of(
    const std::string& path) {
  std::map<std::string, std::vector<std::pair<long, std::string>>> runs;
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
  const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
  const std::string ext = ".json";
  const bool has_ext =
      base.size() > ext.size() && base.compare(base.size() - ext.size(), ext.size(), ext) == 0;
  const std::string stem = has_ext ? base.substr(0, base.size() - ext.size()) : base;
  if (stem.empty()) return runs;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return runs;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() <= stem.size() + 1 || name.compare(0, stem.size() + 1, stem + ".") != 0)
      continue;
    std::string middle = name.substr(stem.size() + 1);
    if (has_ext) {
      if (middle.size() <= ext.size() ||
          middle.compare(middle.size() - ext.size(), ext.size(), ext) != 0)
        continue;
      middle.resize(middle.size() - ext.size());
    }
    std::string run;
    const auto rank = trailing_rank(middle, &run);
    const std::string file = (slash == std::string::npos ? "" : dir) + name;
    if (rank) {
      runs[run].emplace_back(*rank, file);
    } else if (middle.find('.') == std::string::npos) {
      runs[middle].emplace_back(0, file);  // one bench run at world 1
    }
  }
  ::closedir(d);
  for (auto& [run, files] : runs) std::sort(files.begin(), files.end());
  return runs;
}

// The inputs to read: each argument as given, or, for one that does not exist, the rank files
// of the FLATSHARD_TRACE value it is (a note on stderr says which). Throws std::invalid_argument
// naming what exists when that is nothing or several flatshard-bench runs.
std::vector<std::string> resolve_inputs(const std::vector<std::string>& args) {
  namespace fs = flatshard;
  std::vector<std::string> files;
  for (const auto& a : args) {
    struct stat st {};
    if (::stat(a.c_str(), &st) == 0) {
      files.push_back(a);
      continue;
    }
    const auto runs = trace_files_of(a);
    if (runs.empty())
      throw std::invalid_argument("'" + fs::printable_escape(a) +
                                  "' does not exist, nor do rank files of it (" +
                                  fs::printable_escape(fs::trace_file_for_rank(a, 0, 2)) +
                                  ", ...)");
    if (runs.size() > 1) {
      std::string list;
      for (const auto& [run, group] : runs) {
        list += std::string(list.empty() ? "" : ";") + " run '" + fs::printable_escape(run) + "':";
        for (const auto& f : group) list += " " + fs::printable_escape(f.second);
      }
      // "run.layer.rank*.json": the first run's files as a shell pattern.
      std::string example = runs.begin()->second.front().second;
      const size_t r0 = example.rfind(".rank0");
      if (runs.begin()->second.size() > 1 && r0 != std::string::npos)
        example.replace(r0, 6, ".rank*");
      throw std::invalid_argument(
          "'" + fs::printable_escape(a) + "' does not exist; as a FLATSHARD_TRACE value it led "
          "to the traces of " + std::to_string(runs.size()) + " runs (flatshard-bench writes "
          "one per run): give one run's files, e.g. flatshard-trace " +
          fs::printable_escape(example) + " They are:" + list);
    }
    std::string note;
    for (const auto& f : runs.begin()->second) {
      files.push_back(f.second);
      note += " " + fs::printable_escape(f.second);
    }
    std::cerr << "flatshard-trace: note: '" << fs::printable_escape(a)
              << "' does not exist; reading its rank files:" << note << std::endl;
  }
  return files;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flatshard-trace: summarise flatshard trace files (one per rank, or merged)"};
  std::vector<std::string> files;
  std::string merge;
  flatshard::SummaryOptions opts;
  bool keep_first = false;
  app.add_option("files", files,
                 "trace files written by FLATSHARD_TRACE / TraceOptions::path, or the "
                 "FLATSHARD_TRACE value itself (its rank files are found)")
      ->required();
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
  try {
    files = resolve_inputs(files);
  } catch (const std::invalid_argument& e) {
    std::cerr << "flatshard-trace: error: " << e.what() << std::endl;
    return flatshard::tools::kExitUsage;
  }
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
