#include "checkpoint/progress.h"

#include <cstdio>

#include "support/format.h"

namespace flatshard {

ProgressReporter::ProgressReporter(const ProgressFn& fn, double log_after_seconds, int rank,
                                   std::string what, int64_t units_total)
    : fn_(fn), log_after_(log_after_seconds), rank_(rank), what_(std::move(what)) {
  p_.units_total = units_total;
  start_ = last_log_ = std::chrono::steady_clock::now();
}

void ProgressReporter::update(int64_t units_done, int64_t bytes_done) {
  const auto now = std::chrono::steady_clock::now();
  p_.units_done = units_done;
  p_.bytes_done = bytes_done;
  p_.seconds = std::chrono::duration<double>(now - start_).count();
  if (fn_) {
    fn_(p_);
    return;
  }
  if (rank_ != 0 || log_after_ <= 0) return;
  if (p_.seconds >= log_after_ &&
      std::chrono::duration<double>(now - last_log_).count() >= log_after_) {
    log("in progress");
    last_log_ = now;
  }
}

void ProgressReporter::finish() {
  if (!fn_ && logged_) log("done");
}

void ProgressReporter::log(const char* state) {
  logged_ = true;
  std::fprintf(stderr, "flatshard: %s: %s, %lld/%lld units, %s on rank 0, %.0f s\n",
               what_.c_str(), state, static_cast<long long>(p_.units_done),
               static_cast<long long>(p_.units_total), format_bytes(p_.bytes_done).c_str(),
               p_.seconds);
}

}  // namespace flatshard
