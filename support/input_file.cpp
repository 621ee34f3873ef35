// flatshard/support/input_file.cpp — see input_file.h. Modelled on checkpoint/file_io.cpp's
// InputFile (Note [Checkpoint confinement]), without its confinement: a tool's input may be any
// path the user names, links included.
#include "support/input_file.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace flatshard {

namespace {

const char* file_type(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m) || S_ISBLK(m)) return "a device";
  return "not a regular file";
}

// Closes the descriptor on every path out, exceptions included.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// The one way a user's file is opened: without blocking (a FIFO never hangs the open), and
// refused unless it is a regular file. Fills *st; errors name `where`.
int open_regular(const std::string& path, const std::string& where, struct stat* st) {
  Fd f{::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC)};
  TORCH_CHECK(f.fd >= 0, where, ": cannot open: ", std::strerror(errno));
  TORCH_CHECK(::fstat(f.fd, st) == 0, where, ": cannot stat: ", std::strerror(errno));
  TORCH_CHECK(S_ISREG(st->st_mode), where, ": is ", file_type(st->st_mode),
              ", not a regular file (refusing to read it)");
  const int fd = f.fd;
  f.fd = -1;  // the caller owns it now
  return fd;
}

}  // namespace

std::string printable_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  auto hex = [&](unsigned char c) {
    char buf[5];
    std::snprintf(buf, sizeof buf, "\\x%02x", c);
    out += buf;
  };
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      hex(c);
    } else if (c == 0xc2 && i + 1 < s.size() && static_cast<unsigned char>(s[i + 1]) >= 0x80 &&
               static_cast<unsigned char>(s[i + 1]) <= 0x9f) {
      hex(c);  // U+0080..U+009F: C1 controls (U+009B is CSI)
      hex(static_cast<unsigned char>(s[++i]));
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string read_input_file(const std::string& path, int64_t max_bytes, const std::string& what,
                            const std::string& limit_name) {
  const std::string where = what + " '" + printable_escape(path) + "'";
  struct stat st {};
  Fd f{open_regular(path, where, &st)};
  TORCH_CHECK(st.st_size <= max_bytes, where, ": ", st.st_size, " bytes, more than ", limit_name,
              " of ", max_bytes, " bytes");
  std::string text;
  text.resize(static_cast<size_t>(st.st_size) + 1);  // one more: growth shows up
  size_t have = 0;
  while (true) {
    if (have == text.size()) {
      TORCH_CHECK(static_cast<int64_t>(have) <= max_bytes, where, ": more than ", limit_name,
                  " of ", max_bytes, " bytes (it grew while being read)");
      text.resize(std::min<size_t>(2 * have + 4096, static_cast<size_t>(max_bytes) + 1));
    }
    const ssize_t got = ::read(f.fd, text.data() + have, text.size() - have);
    if (got < 0 && errno == EINTR) continue;
    TORCH_CHECK(got >= 0, where, ": read failed: ", std::strerror(errno));
    if (got == 0) break;
    have += static_cast<size_t>(got);
  }
  TORCH_CHECK(static_cast<int64_t>(have) <= max_bytes, where, ": more than ", limit_name, " of ",
              max_bytes, " bytes (it grew while being read)");
  text.resize(have);
  return text;
}

json::Json read_json_file(const std::string& path, int64_t max_bytes, const std::string& what,
                          const std::string& limit_name) {
  const std::string text = read_input_file(path, max_bytes, what, limit_name);
  return json::parse(text, what + " '" + printable_escape(path) + "'");
}

MappedInputFile::MappedInputFile(const std::string& path, const std::string& what) {
  const std::string where = what + " '" + printable_escape(path) + "'";
  struct stat st {};
  Fd f{open_regular(path, where, &st)};
  size_ = static_cast<int64_t>(st.st_size);
  if (size_ == 0) return;
  void* p = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_PRIVATE, f.fd, 0);
  TORCH_CHECK(p != MAP_FAILED, where, ": cannot map ", size_, " bytes: ", std::strerror(errno));
  data_ = static_cast<const unsigned char*>(p);
}

MappedInputFile::~MappedInputFile() {
  // munmap of a mapping we made cannot fail in a way a caller could act on.
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), static_cast<size_t>(size_));
}

}  // namespace flatshard
