#include "checkpoint/file_io.h"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "support/format.h"

namespace flatshard {

namespace {

std::string os_error() { return std::strerror(errno); }

// Large writes are split so the fault hook sees progress inside big tensors too, and so no
// single syscall exceeds what Linux writes at once (~2 GiB).
constexpr size_t kWriteChunk = 16u << 20;

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "checkpoint: cannot open '", path, "' to sync it: ", os_error());
  const int rc = ::fsync(fd);
  const int err = rc == 0 ? 0 : errno;
  ::close(fd);
  // Some filesystems cannot fsync a directory (EINVAL); the data files are synced anyway.
  TORCH_CHECK(rc == 0 || err == EINVAL, "checkpoint: fsync('", path,
              "') failed: ", std::strerror(err));
}

std::string parent_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

void rename_or_throw(const std::string& from, const std::string& to) {
  TORCH_CHECK(::rename(from.c_str(), to.c_str()) == 0, "checkpoint: cannot rename '", from,
              "' to '", to, "': ", os_error());
}

const char* file_type(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m) || S_ISBLK(m)) return "a device";
  if (S_ISLNK(m)) return "a symbolic link";
  return "not a regular file";
}

bool lstat_is(const std::string& path, bool (*pred)(mode_t)) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 && pred(st.st_mode);
}
bool is_dir_mode(mode_t m) { return S_ISDIR(m); }
bool is_reg_mode(mode_t m) { return S_ISREG(m); }
bool any_mode(mode_t) { return true; }

std::string base_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// `s` for an error message: at most 200 bytes, control bytes as '?'.
std::string printable(const std::string& s) {
  std::string out = s.substr(0, 200);
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return out;
}

// 16 hex digits from the OS's random source: names and markers of one save.
std::string random_token() {
  std::random_device rd;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%08x%08x", rd(), rd());
  return buf;
}

constexpr const char* kMarkerLine = "flatshard checkpoint directory";

void write_marker(const std::string& dir, const std::string& token, bool durable) {
  write_text_file_atomic(join_path(dir, kMarkerName),
                         std::string(kMarkerLine) + "\ntoken " + token + "\n" +
                             "flatshard may replace or remove this directory\n",
                         IoHook{}, durable);
}

void call(const IoHook& hook, IoPoint::Kind kind, const std::string& path, int64_t bytes = 0) {
  if (hook) hook(IoPoint{kind, path, bytes});
}

}  // namespace

AtomicFile::AtomicFile(std::string path, IoHook hook, bool durable)
    : path_(std::move(path)), tmp_(path_ + ".tmp"), hook_(std::move(hook)), durable_(durable) {
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "checkpoint: cannot create '", tmp_, "': ", os_error());
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFile::write_at(int64_t offset, const void* data, size_t n) {
  TORCH_CHECK(fd_ >= 0, "checkpoint: '", path_, "' is already committed");
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const size_t want = std::min(n, kWriteChunk);
    const ssize_t got = ::pwrite(fd_, p, want, offset);
    if (got < 0 && errno == EINTR) continue;
    TORCH_CHECK(got > 0, "checkpoint: writing ", want, " bytes at offset ", offset, " of '", tmp_,
                "' failed: ", got < 0 ? os_error() : "no progress (disk full?)");
    p += got;
    n -= static_cast<size_t>(got);
    offset += got;
    written_ += got;
    call(hook_, IoPoint::Kind::kWrite, path_, written_);
  }
}

void AtomicFile::commit() {
  TORCH_CHECK(fd_ >= 0, "checkpoint: '", path_, "' is already committed");
  if (durable_)
    TORCH_CHECK(::fsync(fd_) == 0, "checkpoint: fsync('", tmp_, "') failed: ", os_error());
  const int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) {
    const std::string err = os_error();
    ::unlink(tmp_.c_str());
    TORCH_CHECK(false, "checkpoint: closing '", tmp_, "' failed: ", err);
  }
  call(hook_, IoPoint::Kind::kRename, path_);
  rename_or_throw(tmp_, path_);
  if (durable_) fsync_path(parent_of(path_));
}

InputFile::InputFile(std::string path) : path_(std::move(path)) {
  // Note [Checkpoint confinement]: no symlink is followed, no FIFO can block the open.
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  TORCH_CHECK(fd_ >= 0 || errno != ELOOP, "checkpoint: '", path_,
              "' is a symbolic link; checkpoint files must be regular files inside the "
              "checkpoint directory (refusing to follow it)");
  TORCH_CHECK(fd_ >= 0, "checkpoint: cannot open '", path_, "': ", os_error());
  struct stat st;
  TORCH_CHECK(::fstat(fd_, &st) == 0, "checkpoint: cannot stat '", path_, "': ", os_error());
  TORCH_CHECK(S_ISREG(st.st_mode), "checkpoint: '", path_, "' is ", file_type(st.st_mode),
              ", not a regular file; refusing to read it");
  size_ = st.st_size;
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

void InputFile::read(int64_t offset, void* dst, size_t n) const {
  auto* p = static_cast<char*>(dst);
  const int64_t begin = offset;
  while (n > 0) {
    const ssize_t got = ::pread(fd_, p, n, offset);
    if (got < 0 && errno == EINTR) continue;
    TORCH_CHECK(got >= 0, "checkpoint: reading '", path_, "' at offset ", offset,
                " failed: ", os_error());
    TORCH_CHECK(got > 0, "checkpoint: '", path_, "' ends at byte ", offset, " but bytes [", begin,
                ", ", begin + static_cast<int64_t>(n) + (offset - begin),
                ") were needed (file truncated?)");
    p += got;
    n -= static_cast<size_t>(got);
    offset += got;
  }
}

std::string join_path(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

bool path_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

WeightsDirPick pick_weights_in_dir(const std::string& dir) {
  // Note [Weights file of a directory]: transformers' order, model.safetensors first.
  auto present = [&](const char* name) {
    struct stat st;
    return ::lstat(join_path(dir, name).c_str(), &st) == 0;
  };
  WeightsDirPick p;
  const bool single = present("model.safetensors");
  const bool index = present("model.safetensors.index.json");
  if (single) p.path = join_path(dir, "model.safetensors");
  if (index && !single) {
    p.path = join_path(dir, "model.safetensors.index.json");
    p.index = true;
  }
  if (index && single) p.shadowed = join_path(dir, "model.safetensors.index.json");
  return p;
}

std::vector<std::string> list_dir(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  TORCH_CHECK(d != nullptr, "checkpoint: cannot list '", path, "': ", os_error());
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  return names;
}

void make_dirs(const std::string& path) {
  if (is_directory(path)) return;
  const std::string parent = parent_of(path);
  if (parent != path && parent != "." && parent != "/") make_dirs(parent);
  TORCH_CHECK(::mkdir(path.c_str(), 0755) == 0 || (errno == EEXIST && is_directory(path)),
              "checkpoint: cannot create directory '", path, "': ", os_error());
}

namespace {
// nftw callbacks cannot capture: the walk's state, per thread (rank threads save concurrently).
thread_local std::string* tl_remove_error = nullptr;
thread_local int64_t tl_tree_bytes = 0;
}  // namespace

std::string remove_tree_reason(const std::string& path) noexcept {
  try {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) return "";
    std::string why;
    tl_remove_error = &why;
    // The top directory and its marker go last, once everything else is gone: a directory
    // that could be removed only in part stays recognisable as flatshard's (a later save
    // removes the rest; Note [Checkpoint publication]).
    auto remove_one = [](const char* p, const struct stat* st, int, struct FTW* f) {
      if (f->level == 0 && S_ISDIR(st->st_mode)) return 0;
      if (f->level == 1 && std::strcmp(p + f->base, kMarkerName) == 0) return 0;
      if (::remove(p) == 0 || errno == ENOENT) return 0;
      if (tl_remove_error->empty())
        *tl_remove_error = std::string("cannot remove '") + p + "': " + std::strerror(errno);
      return 0;  // keep going: remove what can be removed, report the first failure
    };
    if (::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0 && why.empty())
      why = "cannot walk '" + path + "': " + os_error();
    tl_remove_error = nullptr;
    if (why.empty() && S_ISDIR(st.st_mode)) {
      const std::string marker = join_path(path, kMarkerName);
      if (::unlink(marker.c_str()) != 0 && errno != ENOENT)
        why = "cannot remove '" + marker + "': " + os_error();
      else if (::rmdir(path.c_str()) != 0 && errno != ENOENT)
        why = "cannot remove '" + path + "': " + os_error();
    }
    return why;
  } catch (...) {
    tl_remove_error = nullptr;
    return "cannot remove '" + path + "'";
  }
}

bool remove_tree(const std::string& path) noexcept { return remove_tree_reason(path).empty(); }

int64_t tree_bytes(const std::string& path) noexcept {
  tl_tree_bytes = 0;
  auto add = [](const char*, const struct stat* st, int flag, struct FTW*) {
    if (flag == FTW_F) tl_tree_bytes += st->st_size;
    return 0;
  };
  ::nftw(path.c_str(), add, 16, FTW_PHYS);
  return tl_tree_bytes;
}

std::string read_text_file(const std::string& path, int64_t max_bytes) {
  InputFile f(path);
  TORCH_CHECK(f.size() <= max_bytes, "checkpoint: '", path, "' is ", f.size(),
              " bytes, more than the ", max_bytes, " it may have; refusing to read it");
  std::string text(static_cast<size_t>(f.size()), '\0');
  if (!text.empty()) f.read(0, text.data(), text.size());
  return text;
}

void write_text_file_atomic(const std::string& path, const std::string& text, const IoHook& hook,
                            bool durable) {
  AtomicFile f(path, hook, durable);
  f.write_at(0, text.data(), text.size());
  f.commit();
}

std::string normalize_dir(const std::string& dir) {
  TORCH_CHECK(!dir.empty(), "checkpoint: the directory name is empty");
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  return d;
}

std::string resolve_save_dir(const std::string& dir_arg) {
  const std::string dir = normalize_dir(dir_arg);
  if (!lstat_is(dir, [](mode_t m) { return S_ISLNK(m); })) return dir;
  char* target = ::realpath(dir.c_str(), nullptr);
  TORCH_CHECK(target != nullptr, "checkpoint: '", dir,
              "' is a symbolic link whose target cannot be resolved (", os_error(),
              "); create the target directory or remove the link");
  std::string out = target;
  std::free(target);
  return out;
}

namespace {
// realpath(3) as a string; "" when it cannot be resolved (errno says why).
std::string real_path(const std::string& path) {
  char* r = ::realpath(path.c_str(), nullptr);
  if (r == nullptr) return "";
  std::string out = r;
  std::free(r);
  return out;
}
bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}
}  // namespace

std::string resolve_weights_file(const std::string& path) {
  if (!lstat_is(path, [](mode_t m) { return S_ISLNK(m); })) return path;
  std::string target(4096, '\0');
  const ssize_t n = ::readlink(path.c_str(), target.data(), target.size());
  target.resize(n > 0 ? static_cast<size_t>(n) : 0);
  const std::string what = "'" + printable(path) + "' is a symbolic link (to '" +
                           printable(target) + "')";
  const std::string rule =
      "; flatshard follows links only inside a Hugging Face hub snapshot "
      "(models--ORG--NAME/snapshots/REVISION/ into models--ORG--NAME/blobs/; Note [Hub "
      "snapshots], checkpoint/file_io.h): copy the files, or download with --local-dir";
  // The snapshot directory and its repository root, resolved (the user's path may itself go
  // through links: that part is the user's choice, as for a checkpoint directory).
  const std::string snapshot = real_path(parent_of(path));
  TORCH_CHECK(!snapshot.empty(), what, ": its directory cannot be resolved (", os_error(), ")",
              rule);
  const std::string snapshots = parent_of(snapshot);
  const std::string root = parent_of(snapshots);
  TORCH_CHECK(base_of(snapshots) == "snapshots" && starts_with(base_of(root), "models--"), what,
              " in '", printable(snapshot), "', which is not a hub snapshot directory", rule);
  const std::string resolved = real_path(path);
  TORCH_CHECK(!resolved.empty(), what, " that cannot be resolved (", os_error(),
              "; an incomplete download?)", rule);
  const std::string blobs = join_path(root, "blobs") + "/";
  TORCH_CHECK(starts_with(resolved, blobs), what, " that resolves to '", printable(resolved),
              "', outside the repository's blobs directory '", printable(blobs), "'", rule);
  TORCH_CHECK(lstat_is(resolved, is_reg_mode), what, " that resolves to '", printable(resolved),
              "', which is not a regular file", rule);
  return resolved;
}

void check_plain_name(const std::string& name, const std::string& what) {
  TORCH_CHECK(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
                  name.find('\0') == std::string::npos,
              what, ": file name '", printable(name),
              "' is not a plain name inside the checkpoint directory (no '/', not '.' or "
              "'..'); refusing it");
}

bool has_marker(const std::string& path) {
  const std::string marker = join_path(path, kMarkerName);
  if (!lstat_is(path, is_dir_mode) || !lstat_is(marker, is_reg_mode)) return false;
  try {
    InputFile f(marker);
    const size_t n = std::strlen(kMarkerLine);
    if (f.size() < static_cast<int64_t>(n) || f.size() > 4096) return false;
    std::string head(n, '\0');
    f.read(0, head.data(), n);
    return head == kMarkerLine;
  } catch (const c10::Error&) {
    return false;
  }
}

std::vector<SideDir> side_dirs(const std::string& dir, const std::string& manifest_name) {
  const std::string parent = parent_of(dir), base = base_of(dir);
  std::vector<SideDir> out;
  if (!is_directory(parent)) return out;
  for (const std::string& name : list_dir(parent)) {
    SideDir s;
    if (name.rfind(base + kBackupInfix, 0) == 0) {
      s.backup = true;
    } else if (name.rfind(base + kStagingInfix, 0) != 0) {
      continue;
    }
    s.path = join_path(parent, name);
    s.marked = has_marker(s.path);
    s.complete = s.marked && lstat_is(join_path(s.path, manifest_name), is_reg_mode);
    out.push_back(std::move(s));
  }
  std::sort(out.begin(), out.end(),
            [](const SideDir& a, const SideDir& b) { return a.path < b.path; });
  return out;
}

namespace {

// The one complete, marked backup of `dir` ("" if none); throws if there are several.
std::string find_backup(const std::string& dir, const std::string& manifest_name) {
  std::vector<std::string> found;
  for (const SideDir& s : side_dirs(dir, manifest_name))
    if (s.backup && s.complete) found.push_back(s.path);
  if (found.size() > 1) {
    std::string list;
    for (const auto& f : found) list += (list.empty() ? "'" : ", '") + f + "'";
    TORCH_CHECK(false, "checkpoint: '", dir, "' is missing and ", found.size(),
                " flatshard backups of it exist (", list, "); move the one to keep to '", dir,
                "' by hand");
  }
  return found.empty() ? "" : found.front();
}

void restore_backup(const std::string& dir, const std::string& backup, bool durable) {
  rename_or_throw(backup, dir);
  if (durable) fsync_path(parent_of(dir));
  std::fprintf(stderr,
               "flatshard: checkpoint '%s' was missing (a save stopped between its two renames); "
               "restored the previous checkpoint from '%s'\n",
               dir.c_str(), backup.c_str());
}

// Note [Checkpoint publication], "no hidden copy": a save that replaces `dir` must be able to
// remove the previous checkpoint's files afterwards (write and search permission on `dir`) and
// to create its staging directory and rename beside `dir` (the same on the parent). Checked
// with the effective ids and capabilities (faccessat AT_EACCESS), so root is not refused.
void check_writable(const std::string& dir, const std::string& path, const std::string& why) {
  if (::faccessat(AT_FDCWD, path.c_str(), W_OK | X_OK, AT_EACCESS) == 0) return;
  const std::string err = os_error();
  struct stat st {};
  ::stat(path.c_str(), &st);
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
  TORCH_CHECK(false, "checkpoint: cannot save to '", dir, "': ", why,
              ", which needs write and search permission on '", path, "' (mode ", mode,
              ", owner uid ", st.st_uid, "; this process runs as uid ", ::geteuid(), "): ", err,
              "; make it writable (chmod u+wx '", path, "') or save elsewhere. Nothing was "
              "written");
}

// Warns (stderr, like restore_backup) about a directory a save could not remove, naming it,
// its size, the reason and how to remove it: a save never leaves a copy behind silently.
void warn_left_behind(const std::string& what, const std::string& path,
                      const std::string& reason) noexcept {
  try {
    std::fprintf(stderr,
                 "flatshard: warning: %s; it is left at '%s' (%s): %s. Remove it yourself "
                 "(chmod -R u+w '%s' && rm -rf '%s'), or let a later save to the same "
                 "directory, once it has the permission, remove it\n",
                 what.c_str(), path.c_str(), format_bytes(tree_bytes(path)).c_str(),
                 reason.c_str(), path.c_str(), path.c_str());
  } catch (...) {
  }
}

}  // namespace

std::string begin_save(const std::string& dir, const std::string& manifest_name, bool durable,
                       const std::function<void(const std::string&)>& check_existing) {
  // Before anything is written (Note [Checkpoint publication]): the parent takes the staging
  // directory and the renames. A parent that does not exist yet is made below (make_dirs).
  const std::string parent = parent_of(dir);
  if (is_directory(parent))
    check_writable(dir, parent, "the save creates its staging directory and renames in '" +
                                    parent + "'");
  if (!lstat_is(dir, any_mode)) {
    const std::string backup = find_backup(dir, manifest_name);
    if (!backup.empty()) restore_backup(dir, backup, durable);
  }
  if (lstat_is(dir, any_mode)) {
    TORCH_CHECK(lstat_is(dir, is_dir_mode), "checkpoint: '", dir,
                "' exists and is not a directory");
    const bool checkpoint = path_exists(join_path(dir, manifest_name));
    TORCH_CHECK(checkpoint || list_dir(dir).empty(), "checkpoint: refusing to replace '", dir,
                "': it is neither empty nor a checkpoint (it has no ", manifest_name,
                "); choose another directory");
    if (checkpoint && check_existing) check_existing(dir);
    // The replaced checkpoint is removed after publication: refuse now rather than leave it
    // behind at a hidden side name.
    check_writable(dir, dir, "replacing the checkpoint there removes its files");
    // Adopt it (Note [Checkpoint publication]): after the exchange it sits at a side name and
    // must be recognisable as flatshard's if a crash stops its removal.
    if (!has_marker(dir)) write_marker(dir, random_token(), durable);
  }
  for (const SideDir& s : side_dirs(dir, manifest_name)) {
    if (s.marked) {
      const std::string why = remove_tree_reason(s.path);
      TORCH_CHECK(why.empty(), "checkpoint: cannot remove the stale side directory '", s.path,
                  "' (", format_bytes(tree_bytes(s.path)), ") of an earlier save: ", why,
                  "; remove it yourself (chmod -R u+w '", s.path, "' && rm -rf '", s.path,
                  "'). Nothing was written");
    } else {
      ::rmdir(s.path.c_str());  // only if empty: never a user's files
    }
  }
  make_dirs(parent_of(dir));  // "ckpt/step-1000": the parent may not exist yet
  std::string token, staging;
  for (int attempt = 0;; ++attempt) {
    token = random_token();
    staging = dir + kStagingInfix + token;
    if (::mkdir(staging.c_str(), 0755) == 0) break;
    TORCH_CHECK(errno == EEXIST && attempt < 3, "checkpoint: cannot create the staging directory '",
                staging, "': ", os_error());
  }
  try {
    write_marker(staging, token, durable);
    if (durable) fsync_path(parent_of(staging));
  } catch (...) {
    // Unmarked, abandon_save would not touch it: remove it here (it holds nothing of ours but
    // the marker, if that got written).
    ::unlink(join_path(staging, kMarkerName).c_str());
    ::rmdir(staging.c_str());
    throw;
  }
  return staging;
}

void publish(const std::string& dir, const std::string& staging, const IoHook& hook, bool durable,
             bool use_exchange) {
  const size_t at = staging.rfind(kStagingInfix);
  TORCH_INTERNAL_ASSERT(at != std::string::npos, "not a staging directory: ", staging);
  const std::string backup = dir + kBackupInfix + staging.substr(at + std::strlen(kStagingInfix));
  call(hook, IoPoint::Kind::kPublish, dir);
  std::string previous;  // where the replaced checkpoint ends up (marked: begin_save adopted it)
  // begin_save adopted (marked) an existing `dir`; one without the marker now was put there
  // during the save (Note [Checkpoint publication]): it is not replaced, nor hidden.
  TORCH_CHECK(!lstat_is(dir, any_mode) || has_marker(dir), "checkpoint: '", dir,
              "' changed during the save (it is no longer the checkpoint the save checked: no ",
              kMarkerName, " in it); not replacing it. Nothing was published");
  if (!lstat_is(dir, any_mode)) {
    rename_or_throw(staging, dir);
  } else if (use_exchange &&
             ::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    previous = staging;
  } else {
    TORCH_CHECK(!use_exchange || errno == EINVAL || errno == ENOSYS || errno == ENOTSUP,
                "checkpoint: cannot exchange '", staging, "' and '", dir, "': ", os_error());
    // Two renames; see Note [Checkpoint publication].
    rename_or_throw(dir, backup);
    call(hook, IoPoint::Kind::kPublish, dir);  // `dir` is missing until the next rename
    rename_or_throw(staging, dir);
    previous = backup;
  }
  if (durable) fsync_path(parent_of(dir));
  call(hook, IoPoint::Kind::kCleanup, dir);
  if (previous.empty()) return;
  if (!has_marker(previous)) {
    // Put at `dir` between the check above and the exchange: not flatshard's to delete.
    warn_left_behind("checkpoint '" + dir + "' was saved; what was at that path a moment " +
                         "before (not a flatshard checkpoint: no " + kMarkerName +
                         ") was moved aside",
                     previous, "flatshard deletes nothing it did not make");
    return;
  }
  const std::string why = remove_tree_reason(previous);
  if (!why.empty())
    warn_left_behind("checkpoint '" + dir + "' was saved, but the previous checkpoint it " +
                         "replaced could not be removed",
                     previous, why);
}

void abandon_save(const std::string& staging) noexcept {
  if (staging.empty()) return;
  if (!has_marker(staging)) {
    // Its marker is gone: someone removed (part of) the staging directory during the save, and
    // a rank's file may have landed in it after. Nothing unmarked is ever removed, so it stays
    // — said, not silent (Note [Checkpoint publication]).
    bool exists = false;
    try {
      exists = path_exists(staging);
    } catch (...) {
    }
    if (exists)
      warn_left_behind("a failed save's side directory lost its marker during the save",
                       staging, "it is no longer marked as flatshard's, so it is not removed");
    return;
  }
  const std::string why = remove_tree_reason(staging);
  if (!why.empty())
    warn_left_behind("a failed save could not remove its side directory", staging, why);
}

bool recover_interrupted_save(const std::string& dir_arg, const std::string& manifest_name) {
  const std::string dir = resolve_save_dir(dir_arg);
  if (path_exists(join_path(dir, manifest_name))) return false;
  TORCH_CHECK(!lstat_is(dir, any_mode), "checkpoint: '", dir, "' exists but holds no ",
              manifest_name, "; not recovering over it");
  const std::string backup = find_backup(dir, manifest_name);
  TORCH_CHECK(!backup.empty(), "checkpoint: '", dir,
              "' is missing and no complete flatshard backup of it (", dir, kBackupInfix,
              "<token>/ holding ", kMarkerName, " and ", manifest_name, ") exists to recover from");
  restore_backup(dir, backup, /*durable=*/true);
  return true;
}

std::string describe_side_dirs(const std::string& dir, const std::string& manifest_name) {
  std::string out;
  try {
    for (const SideDir& s : side_dirs(dir, manifest_name)) {
      if (!s.marked) continue;
      if (s.backup && s.complete && !path_exists(dir))
        out += "; an interrupted save left the previous checkpoint in '" + s.path +
               "': flatshard::recover_checkpoint(\"" + dir + "\") restores it";
      else
        out += "; '" + s.path + "' is debris of an interrupted save (ignored)";
    }
  } catch (const c10::Error&) {
  }
  return out;
}

}  // namespace flatshard
