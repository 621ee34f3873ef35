// flatshard/tests/tool_run.h — a tool binary run as a child process under timeout(1), its exit
// code and output kept: how the CLI tests exercise flatshard-bench, -explain and -trace, so a
// crash or a hang fails the test instead of the runner.
#pragma once

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace flatshard_test {

// `s` single-quoted for /bin/sh.
inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

inline std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct ToolRun {
  int exit_code = -1;  // 124: killed by the timeout; 128: killed by a signal
  std::string out, err;
};

struct ToolRunOptions {
  int seconds = 60;
  long vm_kib = 0;               // address-space limit (ulimit -v); 0: none
  std::vector<std::string> env;  // NAME=value, added to the environment
  std::string cwd;               // "": the test's own
};

// `exe args` with stdin /dev/null; stdout and stderr go through files in `scratch`.
inline ToolRun run_tool(const std::string& scratch, const std::string& exe,
                        const std::vector<std::string>& args, const ToolRunOptions& o = {}) {
  std::string cmd = o.cwd.empty() ? "" : "cd " + shell_quote(o.cwd) + " && ";
  if (o.vm_kib > 0) cmd += "ulimit -v " + std::to_string(o.vm_kib) + "; ";
  cmd += "timeout -k 5 " + std::to_string(o.seconds) + " env";
  for (const auto& kv : o.env) cmd += " " + shell_quote(kv);
  cmd += " " + shell_quote(exe);
  for (const auto& a : args) cmd += " " + shell_quote(a);
  const std::string out = scratch + "/stdout.txt", err = scratch + "/stderr.txt";
  cmd += " >" + shell_quote(out) + " 2>" + shell_quote(err) + " </dev/null";
  const int status = std::system(("sh -c " + shell_quote(cmd)).c_str());
  ToolRun r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

}  // namespace flatshard_test
