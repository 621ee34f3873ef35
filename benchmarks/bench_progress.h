// flatshard/benchmarks/bench_progress.h — progress of the runs on stderr.
//
// Live mode (stderr is a terminal): one line per run rewritten in place with '\r' after every
// step ("[2/6] layer  step 4/7 (warmup)  last 12.3 ms"), finished with the run's summary and a
// newline. Otherwise (a log file, CI) only the summary line per finished run, so logs stay
// readable. Called from rank 0 only; not thread safe.
#pragma once

#include <ostream>
#include <string>

#include "benchmarks/bench_run.h"

namespace flatshard {
namespace bench {

class Progress {
 public:
  Progress(std::ostream& out, bool live) : out_(out), live_(live) {}
  // True when file descriptor 2 is a terminal.
  static bool stderr_is_tty();

  // The per-step callback for run `index` (0-based) of `count`.
  ProgressFn start(const std::string& label, int index, int count, int warmup);
  void finish(const RunResult& result);

 private:
  std::string prefix() const;

  std::ostream& out_;
  bool live_;
  std::string label_;
  int index_ = 0, count_ = 0, warmup_ = 0;
  size_t last_len_ = 0;  // length of the live line, to blank it out when rewriting
};

}  // namespace bench
}  // namespace flatshard
