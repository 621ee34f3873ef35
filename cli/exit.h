// flatshard/cli/exit.h — the command-line tools' one convention for CLI11's outcomes:
// --help prints and exits 0; a usage error prints one line "<program>: error: <message>" on
// stderr and exits 2, as flatshard-bench does (benchmarks/bench_main.cpp). CLI11's own exit codes
// (105, 106, ...) say nothing a script can rely on.
//
// Also shared by the three tools (flatshard-bench, flatshard-explain, flatshard-trace):
// - an unknown flag gets the closest real one: "unknown option --polcy (did you mean
//   --policy?)" (closest_name(): edit distance, at most a third of the name's length);
// - old flag names (docs/vocabulary.md) are renamed in argv before parsing, each with a one-line
//   note "<program>: note: --granularity is deprecated, use --policy".
#pragma once

#include <CLI/CLI.hpp>

#include <algorithm>
#include <deque>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/input_file.h"

namespace flatshard {
namespace tools {

constexpr int kExitUsage = 2;

// Levenshtein distance (insert, delete, substitute: 1 each) between a and b.
inline size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];  // row[i-1][j-1]
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];  // row[i-1][j]
      row[j] = std::min({up + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// The candidate closest to `word`, or "" when none is within max(1, |word| / 3) edits (a name
// that far off is another word, not a typo); the first of equally close ones.
inline std::string closest_name(const std::string& word, const std::vector<std::string>& names) {
  const size_t limit = std::max<size_t>(1, word.size() / 3);
  std::string best;
  size_t best_d = limit + 1;
  for (const auto& n : names) {
    const size_t d = edit_distance(word, n);
    if (d < best_d) {
      best_d = d;
      best = n;
    }
  }
  return best;
}

// Every long flag of `app`, as "--name".
inline std::vector<std::string> long_flags(const CLI::App& app) {
  std::vector<std::string> out;
  for (const CLI::Option* o : app.get_options())
    for (const auto& n : o->get_lnames()) out.push_back("--" + n);
  out.push_back("--help");
  return out;
}

// CLI11's "The following arguments were not expected: --polcy x", with the closest flag of each
// unknown "--name" (or "--name=value") named: "unknown option --polcy (did you mean --policy?)".
inline std::string extras_message(const CLI::App& app, const std::string& cli11_message) {
  std::string out;
  const auto flags = long_flags(app);
  for (const auto& arg : app.remaining()) {
    if (arg.rfind("--", 0) != 0 || arg.size() < 3) continue;
    const std::string name = arg.substr(0, arg.find('='));
    const std::string near = closest_name(name, flags);
    out += (out.empty() ? "" : "; ") + std::string("unknown option ") + name +
           (near.empty() ? " (--help lists the options)" : " (did you mean " + near + "?)");
  }
  return out.empty() ? cli11_message : out;
}

// The one-line message of a CLI11 parse error, with "did you mean" for unknown flags.
inline std::string usage_message(const CLI::App& app, const CLI::Error& e) {
  if (dynamic_cast<const CLI::ExtrasError*>(&e)) return extras_message(app, e.what());
  return e.what();
}

// The exit code for a CLI11 error caught after parse() or during it: help 0 (printed), else 2.
inline int cli_exit(const CLI::App& app, const CLI::Error& e, const std::string& program) {
  if (dynamic_cast<const CLI::CallForHelp*>(&e) || dynamic_cast<const CLI::CallForAllHelp*>(&e) ||
      dynamic_cast<const CLI::CallForVersion*>(&e))
    return app.exit(e);
  // CLI11 quotes the user's values: control bytes are shown, never sent to the terminal.
  std::cerr << program << ": error: " << printable_escape(usage_message(app, e)) << std::endl;
  return kExitUsage;
}

// An old flag name and the one that replaced it (docs/vocabulary.md). `repeatable`: the new
// flag may be given several times, so old and new together are no conflict.
struct FlagRename {
  const char* old_name;
  const char* new_name;
  bool repeatable = false;
};

// Renames old flags in argv in place ("--n-layers 4" and "--n-layers=4"; nothing after "--"),
// returning one note per old name used: "--n-layers is deprecated, use --layers". Throws
// std::invalid_argument when a non-repeatable flag is given under both names. argv keeps
// pointing at the new spellings for the rest of the program (flatshard-bench launches its ranks
// with the same argv, which then say nothing more), hence the static storage.
inline std::vector<std::string> rename_old_flags(int argc, char** argv,
                                                 const std::vector<FlagRename>& renames) {
  static std::deque<std::string> storage;  // the renamed arguments argv points into
  std::vector<std::string> notes;
  for (const FlagRename& r : renames) {
    const std::string old_name = r.old_name, new_name = r.new_name;
    bool old_seen = false, new_seen = false;
    for (int i = 1; i < argc; ++i) {
      const std::string arg = argv[i];
      if (arg == "--") break;
      const bool is_old = arg == old_name || arg.rfind(old_name + "=", 0) == 0;
      const bool is_new = arg == new_name || arg.rfind(new_name + "=", 0) == 0;
      if (is_new) new_seen = true;
      if (!is_old) continue;
      old_seen = true;
      storage.push_back(new_name + arg.substr(old_name.size()));
      argv[i] = &storage.back()[0];
    }
    if (old_seen && new_seen && !r.repeatable)
      throw std::invalid_argument(new_name + " is given twice: once as " + new_name +
                                  " and once as " + old_name + ", its old name");
    if (old_seen) notes.push_back(old_name + " is deprecated, use " + new_name);
  }
  return notes;
}

// Parses argv; false when the program should exit with *exit_code (help printed, or a usage
// error reported).
inline bool parse_command_line(CLI::App& app, int argc, char** argv, const std::string& program,
                               int* exit_code) {
  try {
    app.parse(argc, argv);
    return true;
  } catch (const CLI::ParseError& e) {
    *exit_code = cli_exit(app, e, program);
    return false;
  }
}

// parse_command_line() after renaming `renames` (notes printed on stderr, "<program>: note:
// ..."). A name given twice is a usage error.
inline bool parse_command_line(CLI::App& app, int argc, char** argv, const std::string& program,
                               const std::vector<FlagRename>& renames, int* exit_code) {
  try {
    for (const auto& note : rename_old_flags(argc, argv, renames))
      std::cerr << program << ": note: " << note << std::endl;
  } catch (const std::invalid_argument& e) {
    std::cerr << program << ": error: " << e.what() << std::endl;
    *exit_code = kExitUsage;
    return false;
  }
  return parse_command_line(app, argc, argv, program, exit_code);
}

}  // namespace tools
}  // namespace flatshard
