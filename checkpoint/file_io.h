// flatshard/checkpoint/file_io.h — crash-safe files and directories for checkpoints.
//
// Note [Checkpoint publication]
// A save never writes into the directory it replaces:
//   1. every file is written into the staging directory `<dir>.saving/` under `<name>.tmp`,
//      fsynced, then renamed to `<name>` (a file under its final name is complete);
//   2. the manifest is written last, the same way (a staging directory with a manifest is
//      complete);
//   3. publication: if `<dir>` does not exist, rename(staging, dir). Otherwise the two are
//      swapped atomically with renameat2(RENAME_EXCHANGE) and the previous checkpoint, now at
//      `<dir>.saving`, is removed. On filesystems without RENAME_EXCHANGE (e.g. NFS) it takes two
//      renames, dir -> `<dir>.old` then staging -> dir; a crash between them leaves the previous
//      checkpoint at `<dir>.old`, which resolve_checkpoint_dir() finds and the next save restores.
// So at every instant either `<dir>` or `<dir>.old` holds a complete checkpoint, and what a
// crash leaves behind (`.tmp` files, `<dir>.saving`) is ignored by loads and removed by the next
// save. Two concurrent saves to one directory are not supported.
//
// Fault injection: every write, rename and publication step first calls an IoHook (if set);
// tests throw from it (or stop the process there) to interrupt a save at that exact point.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace flatshard {

struct IoPoint {
  enum class Kind {
    kWrite,    // after a write of `path`; `bytes` written to it so far
    kRename,   // before `path`.tmp is renamed to `path` (the file is complete and synced)
    kPublish,  // before the staging directory replaces the checkpoint directory `path`
               // (and, in the two-rename fallback, again between the two renames)
    kCleanup,  // after publication, before the previous checkpoint is removed
  };
  Kind kind;
  std::string path;
  int64_t bytes = 0;
};
using IoHook = std::function<void(const IoPoint&)>;

// A file written under `<path>.tmp` and renamed onto `path` by commit(). Destroying it
// uncommitted removes the temporary (never throws). Errors name the file and errno's text.
class AtomicFile {
 public:
  AtomicFile(std::string path, IoHook hook, bool durable);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Writes `n` bytes at `offset` (files may be filled out of order).
  void write_at(int64_t offset, const void* data, size_t n);
  // durable: fsync the file; then rename it into place and (durable) fsync its directory.
  void commit();
  const std::string& path() const { return path_; }
  int64_t bytes_written() const { return written_; }

 private:
  std::string path_;
  std::string tmp_;
  IoHook hook_;
  bool durable_;
  int fd_ = -1;
  int64_t written_ = 0;
};

// Read-only file with positional reads. Errors name the file.
class InputFile {
 public:
  explicit InputFile(std::string path);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }
  // Exactly n bytes at offset; throws (naming the file and range) if the file is shorter.
  void read(int64_t offset, void* dst, size_t n) const;

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

// Plain POSIX helpers. Not std::filesystem: the torch wheel's libtorch.so exports its own
// std::filesystem symbols, which the dynamic linker prefers to libstdc++'s, and they crash
// (seen with torch 2.11: remove_all jumps to address 0).
std::string join_path(const std::string& dir, const std::string& name);
bool path_exists(const std::string& path);
bool is_directory(const std::string& path);
// Entry names of a directory (no "." or ".."); throws naming the path if it cannot be read.
std::vector<std::string> list_dir(const std::string& path);
// mkdir -p.
void make_dirs(const std::string& path);
// rm -rf that never throws; false if something could not be removed.
bool remove_tree(const std::string& path) noexcept;
std::string read_text_file(const std::string& path);
// Writes `text` to `path` via AtomicFile.
void write_text_file_atomic(const std::string& path, const std::string& text, const IoHook& hook,
                            bool durable);

// `dir` without a trailing separator (the staging and retired names derive from it).
std::string normalize_dir(const std::string& dir);
inline std::string staging_dir(const std::string& dir) { return dir + ".saving"; }
inline std::string retired_dir(const std::string& dir) { return dir + ".old"; }

// Steps of Note [Checkpoint publication], run by one rank. begin_save(): restores
// `<dir>.old` if an interrupted publication left `<dir>` missing, refuses to replace a `<dir>`
// that is neither empty nor a checkpoint (has no `manifest_name`), and creates a fresh, empty
// staging directory.
void begin_save(const std::string& dir, const std::string& manifest_name, bool durable);
void publish(const std::string& dir, const IoHook& hook, bool durable, bool use_exchange);
// Best effort, after a failed save: removes the staging directory. Never throws.
void abandon_save(const std::string& dir) noexcept;
// The directory a load should read: `dir` if it holds `manifest_name`, else `<dir>.old` if that
// does (an interrupted publication), else `dir` (the caller reports what is missing).
std::string resolve_checkpoint_dir(const std::string& dir, const std::string& manifest_name);

}  // namespace flatshard
