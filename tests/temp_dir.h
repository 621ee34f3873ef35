// Scratch directories and whole-file byte helpers for tests that write files.
// (POSIX calls, not std::filesystem: see checkpoint/file_io.h.)
#pragma once

#include <c10/util/Exception.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "checkpoint/file_io.h"

namespace flatshard_test {

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it on destruction.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/flatshard-ckpt-XXXXXX";
    TORCH_CHECK(::mkdtemp(tmpl.data()) != nullptr, "mkdtemp failed for ", tmpl);
    path_ = tmpl;
  }
  ~TempDir() { flatshard::remove_tree(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Copies the files of a (flat) checkpoint directory.
inline void copy_dir(const std::string& from, const std::string& to) {
  flatshard::make_dirs(to);
  for (const auto& name : flatshard::list_dir(from))
    write_bytes(to + "/" + name, read_bytes(from + "/" + name));
}

}  // namespace flatshard_test
