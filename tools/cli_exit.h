// flatshard/tools/cli_exit.h — the command-line tools' one convention for CLI11's outcomes:
// --help prints and exits 0; a usage error prints one line "<program>: error: <message>" on
// stderr and exits 2, as flatshard-bench does (benchmarks/bench_main.cpp). CLI11's own exit codes
// (105, 106, ...) say nothing a script can rely on.
#pragma once

#include <CLI/CLI.hpp>

#include <iostream>
#include <string>

namespace flatshard {
namespace tools {

constexpr int kExitUsage = 2;

// The exit code for a CLI11 error caught after parse() or during it: help 0 (printed), else 2.
inline int cli_exit(const CLI::App& app, const CLI::Error& e, const std::string& program) {
  if (dynamic_cast<const CLI::CallForHelp*>(&e) || dynamic_cast<const CLI::CallForAllHelp*>(&e) ||
      dynamic_cast<const CLI::CallForVersion*>(&e))
    return app.exit(e);
  std::cerr << program << ": error: " << e.what() << std::endl;
  return kExitUsage;
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

}  // namespace tools
}  // namespace flatshard
