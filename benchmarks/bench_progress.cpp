// flatshard/benchmarks/bench_progress.cpp — see bench_progress.h for the contract.
#include "benchmarks/bench_progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <vector>

namespace flatshard {
namespace bench {

bool Progress::stderr_is_tty() { return ::isatty(STDERR_FILENO) == 1; }

std::string Progress::prefix() const {
  return "[" + std::to_string(index_ + 1) + "/" + std::to_string(count_) + "] " + label_;
}

ProgressFn Progress::start(const std::string& label, int index, int count, int warmup) {
  label_ = label;
  index_ = index;
  count_ = count;
  warmup_ = warmup;
  last_len_ = 0;
  if (!live_) return nullptr;
  const std::string first = prefix() + "  setting up (build, shard, optimizer)";
  last_len_ = first.size();
  out_ << first << std::flush;
  return [this](int step, int total, double ms) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), "  step %d/%d%s  last %.1f ms", step + 1, total,
                  step < warmup_ ? " (warmup)" : "", ms);
    std::string line = prefix() + buf;
    const size_t len = line.size();
    if (len < last_len_) line += std::string(last_len_ - len, ' ');
    last_len_ = len;
    out_ << '\r' << line << std::flush;
  };
}

void Progress::finish(const RunResult& result) {
  const double median_ms = median(result.step_ms);
  char buf[160];
  std::snprintf(buf, sizeof(buf), "  done: %zu steps, median %.1f ms, loss@0 %.5f",
                result.step_ms.size(), median_ms, result.loss_step0);
  std::string line = prefix() + buf;
  if (live_) {
    if (line.size() < last_len_) line += std::string(last_len_ - line.size(), ' ');
    out_ << '\r';
  }
  out_ << line << std::endl;
}

}  // namespace bench
}  // namespace flatshard
