// flatshard/checkpoint/progress.h — progress of a long save or load (internal).
//
// With a callback, every update goes to it (on every rank). Without one, rank 0 prints a line to
// stderr once the operation has run `log_after_seconds`, then at most every that many seconds,
// and a last line when it finishes — short operations stay silent.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "checkpoint/checkpoint.h"

namespace flatshard {

class ProgressReporter {
 public:
  ProgressReporter(const ProgressFn& fn, double log_after_seconds, int rank, std::string what,
                   int64_t units_total);
  void update(int64_t units_done, int64_t bytes_done);
  void finish();

 private:
  void log(const char* state);

  const ProgressFn& fn_;
  double log_after_;
  int rank_;
  std::string what_;
  CheckpointProgress p_;
  std::chrono::steady_clock::time_point start_, last_log_;
  bool logged_ = false;
};

}  // namespace flatshard
