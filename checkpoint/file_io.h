// flatshard/checkpoint/file_io.h — crash-safe files and directories for checkpoints.
//
// Note [Checkpoint publication]
// A checkpoint directory comes from other machines, people and tools, and sits among the
// user's own files, so a save deletes nothing flatshard cannot prove it made, and a load reads
// nothing outside the checkpoint (Note [Checkpoint confinement]).
// - Ownership marker. Every directory flatshard creates for a save carries `.flatshard-checkpoint`
//   (kMarkerName: a fixed first line plus the save's random token). flatshard's own side
//   directories are `<dir>.flatshard-saving-<token>` (staging) and `<dir>.flatshard-old-<token>`
//   (backup, two-rename fallback only); it removes such a directory only if it holds the marker
//   (an unmarked one is rmdir'ed if empty — a crash between mkdir and the marker's write — and
//   otherwise left alone). Nothing else beside `<dir>` is ever touched: a user's `<dir>.old` or
//   `<dir>.saving` is not flatshard's.
// - An existing `<dir>` is replaced only if it is empty or a checkpoint holding nothing but its
//   manifest, the files the manifest lists and the marker. Foreign files inside it are an error
//   naming them (the save refuses; nothing is moved or deleted). A checkpoint written before
//   markers existed, or an empty directory, is adopted: the marker is written into it once it
//   has passed that check, so a crash after the swap below still leaves it recognisable.
// - A `<dir>` that is a symbolic link is followed: the save publishes at the link's target (its
//   parent holds the side directories); the link itself is kept and names the new checkpoint.
//   A dangling link is an error.
// Steps of a save:
//   1. begin_save(): restore an interrupted two-rename publication (step 3b), check `<dir>`,
//      remove flatshard's marked debris of earlier saves, create a fresh staging directory
//      `<dir>.flatshard-saving-<token>` with its marker;
//   2. every file is written there under `<name>.tmp`, fsynced, renamed to `<name>` (a file under
//      its final name is complete); the manifest is written last (a staging directory with a
//      manifest is complete);
//   3. publication: if `<dir>` does not exist, rename(staging, dir). Otherwise (a) the two are
//      swapped atomically with renameat2(RENAME_EXCHANGE) and the previous checkpoint, now at the
//      staging name (marked), is removed; or (b) where RENAME_EXCHANGE is missing (e.g. NFS), two
//      renames: dir -> `<dir>.flatshard-old-<token>`, staging -> dir, then the backup is removed.
// No hidden copy: a save never leaves the checkpoint it replaced (or its own staging directory)
// behind silently — for a 7B model that is ~80 GB nobody knows about. So begin_save() checks,
// before anything is written, with the process's effective ids and capabilities, that it
// can do what the save ends with: write and search permission on `<dir>`'s parent (staging
// directory, renames) and on an existing `<dir>` (its files are removed after publication); a
// save that lacks either fails naming the path, its mode and owner, the uid and what to do,
// and writes nothing. publish() refuses a `<dir>` that lost flatshard's marker during the save
// (someone put another directory there): it is neither replaced nor moved aside. What can still
// go wrong late (permissions changed during the save, a file that cannot be unlinked) is
// reported: the save stays published and a warning on stderr names the side directory left
// behind, its size, the reason and the command that removes it; a failed save's staging
// directory that cannot be removed is reported the same way. A save that cannot complete
// (disk full, a directory removed under it) fails naming the path, and its staging directory
// is removed (also the empty one of a failure while writing its marker).
// So at every instant `<dir>` or flatshard's marked backup holds a complete checkpoint; kill -9
// at any point leaves the previous checkpoint loadable. A crash between the renames of 3b
// leaves `<dir>` missing: a load then fails and names the backup (it never substitutes it
// silently); recover_interrupted_save() (flatshard::recover_checkpoint) restores it explicitly
// and logs it, and so does the next save's begin_save(). Debris (`.tmp` files, marked staging
// or backup directories beside a present `<dir>`) is ignored by loads and removed by the next
// save. Two concurrent saves to one directory are not supported.
//
// Note [Checkpoint confinement]
// Every file a manifest names must be a plain name (check_plain_name: no '/', not "." or "..",
// no NUL), so it lies in the checkpoint directory itself; InputFile opens it with O_NOFOLLOW
// (a symlink is refused, wherever it points) and O_NONBLOCK (a FIFO cannot block the open) and
// refuses anything fstat does not call a regular file; a reader compares its size with the
// manifest before reading a byte of it. The checkpoint directory itself may be a symlink (the
// user chose that path).
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

// Read-only regular file with positional reads (Note [Checkpoint confinement]: opened with
// O_NOFOLLOW | O_NONBLOCK, refused unless fstat says it is a regular file). Errors name the file.
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
// Same; "" when everything is gone, else the first failure ("cannot remove 'p': Permission
// denied"). It removes what it can either way.
std::string remove_tree_reason(const std::string& path) noexcept;
// Bytes of the regular files under `path` (0 if it cannot be read).
int64_t tree_bytes(const std::string& path) noexcept;
// The whole file; throws, naming it, if it is larger than `max_bytes`.
std::string read_text_file(const std::string& path, int64_t max_bytes = int64_t{1} << 30);
// Writes `text` to `path` via AtomicFile.
void write_text_file_atomic(const std::string& path, const std::string& text, const IoHook& hook,
                            bool durable);

// `dir` without a trailing separator (the side directories' names derive from it).
std::string normalize_dir(const std::string& dir);
// normalize_dir(), and a symbolic link replaced by its target (Note [Checkpoint publication]);
// throws naming a dangling link.
std::string resolve_save_dir(const std::string& dir);

// Note [Checkpoint confinement]: throws unless `name` is a plain file name inside the
// checkpoint directory; `what` says which manifest entry holds it.
void check_plain_name(const std::string& name, const std::string& what);

// Note [Hub snapshots]
// The Hugging Face hub cache keeps a model as `models--ORG--NAME/` holding `blobs/<hash>` (the
// files' bytes) and `snapshots/<revision>/<file>`, each a relative symlink into `../../blobs/`
// (huggingface_hub's cache layout). Weights are read from such a snapshot as they are, without
// copying: a symbolic link among the weights' files (config.json and the index included) is
// followed only when the directory holding it is `<root>/snapshots/<revision>` with a root
// named `models--*`, and the link resolves to a regular file inside `<root>/blobs/`. Any other
// link — in any other directory, into another repository's blobs, outside the root, dangling —
// is refused, naming the link, its target and the reason (Note [Checkpoint confinement] holds
// everywhere else). flatshard's own checkpoints never contain links.
// resolve_weights_file(path): the path to open for the file `path` of a weights directory:
// `path` itself when it is not a symbolic link, the blob it names under that rule; throws
// otherwise. Opened with InputFile afterwards (O_NOFOLLOW: the blob path has no links left).
std::string resolve_weights_file(const std::string& path);

// Note [Weights file of a directory]
// A Hugging Face directory holds `model.safetensors` (one file) or
// `model.safetensors.index.json` (sharded). With both, transformers 5 (modeling_utils.py,
// _get_resolved_checkpoint_files) reads model.safetensors and never opens the index, so
// flatshard does the same (its loader, safetensors_loader, and flatshard-explain --weights:
// both call pick_weights_in_dir) and says so, naming both files: they may disagree (a stale
// index from an earlier sharded save). An entry counts as present when lstat finds it (a
// dangling link of a partial hub download is chosen and then refused, never skipped).
struct WeightsDirPick {
  std::string path;      // <dir>/model.safetensors or <dir>/model.safetensors.index.json; ""
  bool index = false;    // path is the index
  std::string shadowed;  // the index that is present but not read ("" when none)
};
WeightsDirPick pick_weights_in_dir(const std::string& dir);

inline constexpr const char* kMarkerName = ".flatshard-checkpoint";
inline constexpr const char* kStagingInfix = ".flatshard-saving-";
inline constexpr const char* kBackupInfix = ".flatshard-old-";

// A flatshard side directory of `dir` (Note [Checkpoint publication]).
struct SideDir {
  std::string path;
  bool backup = false;    // `<dir>.flatshard-old-*` (else staging)
  bool marked = false;    // holds flatshard's marker
  bool complete = false;  // marked and holds `manifest_name`
};
// Entries beside `dir` named like flatshard's staging or backup directories.
std::vector<SideDir> side_dirs(const std::string& dir, const std::string& manifest_name);
// True if `path` is a directory holding flatshard's marker.
bool has_marker(const std::string& path);

// Steps of Note [Checkpoint publication], run by one rank. begin_save(): restores an
// interrupted two-rename publication (logged), refuses a `<dir>` that is not a directory or is
// neither empty nor a checkpoint (has no `manifest_name`), calls `check_existing(dir)` on an
// existing one (the caller refuses foreign files there), adopts it (marker), removes marked
// debris and returns a fresh staging directory.
std::string begin_save(const std::string& dir, const std::string& manifest_name, bool durable,
                       const std::function<void(const std::string&)>& check_existing);
void publish(const std::string& dir, const std::string& staging, const IoHook& hook, bool durable,
             bool use_exchange);
// Best effort, after a failed save: removes the staging directory. Never throws.
void abandon_save(const std::string& staging) noexcept;
// If `dir` is missing and a complete, marked backup of it exists (a save stopped between the
// two renames of step 3b), renames the backup to `dir`, says so on stderr and returns true.
// False if `dir` holds `manifest_name` (nothing to recover). Throws otherwise, naming what it
// found.
bool recover_interrupted_save(const std::string& dir, const std::string& manifest_name);
// For a load's "no checkpoint" error: what side directories of `dir` hold ("" if none).
std::string describe_side_dirs(const std::string& dir, const std::string& manifest_name);

}  // namespace flatshard
