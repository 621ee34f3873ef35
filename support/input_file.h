// flatshard/support/input_file.h — the one way flatshard's tools read a file a user handed them
// (a trace, a machine profile): a regular file of bounded size, read whole, never blocking; JSON
// through support/json.h's strict, depth-limited reader. And printable_escape(), for echoing
// what such a file (or a command line) said.
//
// Contract
// - read_input_file(path, max_bytes, what): opens with O_RDONLY | O_NONBLOCK | O_CLOEXEC (a FIFO
//   cannot block the open), fstat must say regular file (a FIFO, socket, device or directory is
//   an error naming it: a FIFO would block the read forever, /dev/zero would never end), the
//   size must be at most `max_bytes`, and the file is read to its end, still counting (a file
//   that grows past the limit while it is read, or a /proc file that reports size 0, is held to
//   the same limit). Symbolic links are followed: the user named the path.
// - read_json_file(): read_input_file + json::parse (duplicate keys, nesting beyond
//   json::kMaxDepth, integers beyond 64 bits and anything not RFC 8259 are errors): a hostile
//   file is an error, never std::bad_alloc from unbounded nesting or a blocked process.
// - Errors throw c10::Error, one line, starting "<what> '<path>': " (the path through
//   printable_escape): "cannot open: <strerror>", "is a FIFO, not a regular file",
//   "<n> bytes, more than <limit_name> of <max> bytes", "invalid JSON at byte ...".
// - MappedInputFile(path, what): the same open and checks (regular file, never blocking), then
//   the whole file mapped read-only (MAP_PRIVATE) for inputs too large to read whole (token
//   files, data/token_dataset.h). No size limit: nothing is allocated. An empty file maps to
//   data() == nullptr, size() == 0. A file truncated by someone else while mapped makes a read
//   past its new end fault (SIGBUS), as with any mmap; the mapping stays valid otherwise.
// - printable_escape(s): `s` with every control byte (< 0x20 and 0x7f) and the two-byte UTF-8
//   C1 controls (U+0080..U+009F, which some terminals act on like ESC) written as \xNN; every
//   other byte, UTF-8 included, as is. Use it wherever a user-supplied string (a file's field, a
//   command-line value, a path) is printed to a terminal: ESC and BEL bytes would otherwise be
//   sent to it raw, and a newline would break a one-line error.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "support/json.h"

namespace flatshard {

// `limit_name` says in the size error what the limit is ("a trace's limit").
std::string read_input_file(const std::string& path, int64_t max_bytes, const std::string& what,
                            const std::string& limit_name = "the limit");

json::Json read_json_file(const std::string& path, int64_t max_bytes, const std::string& what,
                          const std::string& limit_name = "the limit");

std::string printable_escape(std::string_view s);

class MappedInputFile {
 public:
  MappedInputFile(const std::string& path, const std::string& what);
  ~MappedInputFile();
  MappedInputFile(const MappedInputFile&) = delete;
  MappedInputFile& operator=(const MappedInputFile&) = delete;
  const unsigned char* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  const unsigned char* data_ = nullptr;
  int64_t size_ = 0;
};

}  // namespace flatshard
