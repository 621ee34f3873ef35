// flatshard/support/output_file.cpp — see output_file.h for the contract.
#include "support/output_file.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>

namespace flatshard {

namespace {

std::string failed(const std::string& what, const std::string& path, const char* step,
                   int err) {
  return what + " '" + path + "': " + step + " failed: " + std::strerror(err);
}

// Writes all of `contents` to `fd`, retrying short writes and EINTR; errno on failure.
int write_all(int fd, const std::string& contents) {
  const char* p = contents.data();
  size_t left = contents.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;
    p += n;
    left -= static_cast<size_t>(n);
  }
  return 0;
}

// The file a write to `path` ends up in: a symbolic link's target (renaming over the link would
// replace the link, not the file it points to).
std::string resolved(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return path;
  char buf[PATH_MAX];
  return ::realpath(path.c_str(), buf) ? std::string(buf) : path;
}

std::string temp_name(const std::string& target) {
  return target + ".tmp." + std::to_string(::getpid());
}

}  // namespace

void write_file(const std::string& path, const std::string& contents, const std::string& what) {
  TORCH_CHECK(!path.empty(), what, ": empty output path");
  const std::string target = resolved(path);
  struct stat st {};
  const bool exists = ::stat(target.c_str(), &st) == 0;
  TORCH_CHECK(!exists || !S_ISDIR(st.st_mode), what, " '", path, "' is a directory");
  if (exists && !S_ISREG(st.st_mode)) {
    // A device or FIFO: written in place (no O_TRUNC: /dev/null and FIFOs have nothing to cut).
    const int fd = ::open(target.c_str(), O_WRONLY | O_CLOEXEC);
    const int open_err = errno;
    TORCH_CHECK(fd >= 0, failed(what, path, "open", open_err));
    const int err = write_all(fd, contents);
    const int close_err = ::close(fd) != 0 ? errno : 0;
    TORCH_CHECK(err == 0, failed(what, path, "write", err));
    TORCH_CHECK(close_err == 0, failed(what, path, "close", close_err));
    return;
  }
  const std::string tmp = temp_name(target);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  const int open_err = errno;  // before anything else can overwrite it
  TORCH_CHECK(fd >= 0, failed(what, path, ("creating '" + tmp + "'").c_str(), open_err));
  int err = write_all(fd, contents);
  const char* step = "write";
  if (err == 0 && exists && ::fchmod(fd, st.st_mode & 07777) != 0) err = errno, step = "chmod";
  // fsync before rename: otherwise a crash could leave the new name with no data behind it.
  if (err == 0 && ::fsync(fd) != 0) err = errno, step = "fsync";
  if (::close(fd) != 0 && err == 0) err = errno, step = "close";
  if (err == 0 && ::rename(tmp.c_str(), target.c_str()) != 0) err = errno, step = "rename";
  if (err != 0) {
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, failed(what, path, step, err));
  }
}

void check_output_path(const std::string& path, const std::string& what) {
  if (path.empty()) return;
  const std::string target = resolved(path);
  struct stat st {};
  if (::stat(target.c_str(), &st) == 0) {
    TORCH_CHECK(!S_ISDIR(st.st_mode), what, " '", path, "' is a directory");
    if (!S_ISREG(st.st_mode)) {
      const int fd = ::open(target.c_str(), O_WRONLY | O_CLOEXEC | O_NONBLOCK);
      const int open_err = errno;
      // A FIFO without a reader yet is fine (ENXIO): someone may open it by the time we write.
      TORCH_CHECK(fd >= 0 || open_err == ENXIO, failed(what, path, "open", open_err));
      if (fd >= 0) ::close(fd);
      return;
    }
  }
  const std::string tmp = temp_name(target);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  const int open_err = errno;
  TORCH_CHECK(fd >= 0, failed(what, path, ("creating '" + tmp + "'").c_str(), open_err));
  ::close(fd);
  ::unlink(tmp.c_str());
}

void flush_stdout() {
  std::cout.flush();
  errno = 0;
  const bool ok = std::fflush(stdout) == 0 && !std::ferror(stdout) && std::cout.good();
  const int err = errno;
  TORCH_CHECK(ok, "writing to standard output failed",
              err ? std::string(": ") + std::strerror(err) : std::string());
}

}  // namespace flatshard
