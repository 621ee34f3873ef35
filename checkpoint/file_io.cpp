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
#include <cstring>

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
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd_ >= 0, "checkpoint: cannot open '", path_, "': ", os_error());
  struct stat st;
  TORCH_CHECK(::fstat(fd_, &st) == 0, "checkpoint: cannot stat '", path_, "': ", os_error());
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

bool remove_tree(const std::string& path) noexcept {
  if (!path_exists(path)) return true;
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) {
    return ::remove(p) == 0 ? 0 : -1;
  };
  return ::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) == 0;
}

std::string read_text_file(const std::string& path) {
  InputFile f(path);
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

void begin_save(const std::string& dir, const std::string& manifest_name, bool durable) {
  const std::string staging = staging_dir(dir), retired = retired_dir(dir);
  if (!path_exists(dir) && path_exists(join_path(retired, manifest_name))) {
    // An earlier two-rename publication stopped between its renames: put the checkpoint back.
    rename_or_throw(retired, dir);
  }
  if (path_exists(dir)) {
    TORCH_CHECK(is_directory(dir), "checkpoint: '", dir, "' exists and is not a directory");
    TORCH_CHECK(path_exists(join_path(dir, manifest_name)) || list_dir(dir).empty(),
                "checkpoint: refusing to replace '", dir,
                "': it is neither empty nor a "
                "checkpoint (it has no ",
                manifest_name, "); choose another directory");
  }
  TORCH_CHECK(remove_tree(staging), "checkpoint: cannot remove the stale staging directory '",
              staging, "': ", os_error());
  remove_tree(retired);  // `dir` holds the checkpoint (restored above if need be)
  make_dirs(staging);
  if (durable) fsync_path(parent_of(staging));
}

void publish(const std::string& dir, const IoHook& hook, bool durable, bool use_exchange) {
  const std::string staging = staging_dir(dir), retired = retired_dir(dir);
  call(hook, IoPoint::Kind::kPublish, dir);
  std::string previous;  // where the replaced checkpoint ends up
  if (!path_exists(dir)) {
    rename_or_throw(staging, dir);
  } else if (use_exchange &&
             ::renameat2(AT_FDCWD, staging.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    previous = staging;
  } else {
    TORCH_CHECK(!use_exchange || errno == EINVAL || errno == ENOSYS || errno == ENOTSUP,
                "checkpoint: cannot exchange '", staging, "' and '", dir, "': ", os_error());
    // Two renames; see Note [Checkpoint publication].
    rename_or_throw(dir, retired);
    call(hook, IoPoint::Kind::kPublish, dir);  // `dir` is missing until the next rename
    rename_or_throw(staging, dir);
    previous = retired;
  }
  if (durable) fsync_path(parent_of(dir));
  call(hook, IoPoint::Kind::kCleanup, dir);
  if (!previous.empty()) remove_tree(previous);
}

void abandon_save(const std::string& dir) noexcept { remove_tree(staging_dir(dir)); }

std::string resolve_checkpoint_dir(const std::string& dir, const std::string& manifest_name) {
  if (path_exists(join_path(dir, manifest_name))) return dir;
  const std::string retired = retired_dir(dir);
  if (!path_exists(dir) && path_exists(join_path(retired, manifest_name))) return retired;
  return dir;
}

}  // namespace flatshard
