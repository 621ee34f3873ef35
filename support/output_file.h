// flatshard/support/output_file.h — a tool's output file is written whole, or not at all.
//
// Contract
// - write_file(path, contents, what): `path` a regular file or not there yet: the contents go to
//   "<path>.tmp.<pid>" in the same folder, every write, the fsync and the close are checked, and
//   the temporary is renamed over `path` (keeping an existing file's permission bits). On any
//   failure the temporary is removed and `path` is exactly as it was: a run that fails, or a full
//   disk (ENOSPC), never leaves a truncated report behind.
// - A path that exists and is not a regular file (/dev/stdout, /dev/null, /dev/full, a FIFO)
//   cannot be renamed over: it is written in place, still checking every write and the close
//   (/dev/full fails with ENOSPC). A symbolic link is followed: its target is replaced.
// - check_output_path(path, what): for tools that run for minutes before they write: fails now
//   if the file could not be written later (the folder is missing or not writable, `path` is a
//   folder). It creates and removes a temporary next to `path`; `path` itself is not touched.
// - flush_stdout(): flushes std::cout and C's stdout and fails if any write to standard
//   output failed (`tool > /dev/full` must not exit 0).
// - Errors throw c10::Error: "<what> '<path>': <step> failed: <strerror(errno)>".
#pragma once

#include <string>

namespace flatshard {

void write_file(const std::string& path, const std::string& contents, const std::string& what);

void check_output_path(const std::string& path, const std::string& what);

void flush_stdout();

}  // namespace flatshard
