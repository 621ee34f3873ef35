// flatshard/cli/launch.cpp — see launch.h for the contract.
#include "cli/launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace flatshard {
namespace cli {

namespace {

// A TCP port the kernel considers free right now (bind to port 0). Another process could take
// it before rank 0's store binds it; the store then fails with "address in use", naming it.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("socket(): ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const std::string err = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("finding a free port on 127.0.0.1: " + err);
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace

std::optional<LaunchEnv> launcher_env() {
  try {
    return LaunchEnv::ranks_from_env();
  } catch (const c10::Error& e) {
    throw UsageError(e.what_without_backtrace());  // a launch mistake: exit 2, one line
  }
}

int launch_local_ranks(int nproc, char** argv, int failed_from) {
  const std::string port = std::to_string(free_port());
  const std::vector<std::string> ours = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                         "MASTER_ADDR", "MASTER_PORT"};
  std::vector<std::string> base;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (std::find(ours.begin(), ours.end(), key) == ours.end()) base.push_back(kv);
  }

  std::vector<pid_t> pids;
  for (int r = 0; r < nproc; ++r) {
    std::vector<std::string> env = base;
    env.push_back("RANK=" + std::to_string(r));
    env.push_back("WORLD_SIZE=" + std::to_string(nproc));
    env.push_back("LOCAL_RANK=" + std::to_string(r));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(nproc));
    env.push_back("MASTER_ADDR=127.0.0.1");
    env.push_back("MASTER_PORT=" + port);
    std::vector<char*> envp;
    for (auto& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);
    pid_t pid = 0;
    const int rc = ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data());
    if (rc != 0) {
      for (pid_t p : pids) ::kill(p, SIGTERM);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
      throw std::runtime_error("launching rank " + std::to_string(r) + ": posix_spawn: " +
                               std::strerror(rc));
    }
    pids.push_back(pid);
  }

  int worst = 0;
  std::vector<pid_t> running = pids;
  while (!running.empty()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    auto it = std::find(running.begin(), running.end(), pid);
    if (it == running.end()) continue;
    running.erase(it);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status)
                                       : (WIFSIGNALED(status) ? 128 + WTERMSIG(status) : 1);
    // A failed rank strands the others inside collectives: stop them instead of waiting for the
    // timeout (once: the first failure's SIGTERM is enough).
    if (code >= failed_from && worst < failed_from)
      for (pid_t p : running) ::kill(p, SIGTERM);
    worst = std::max(worst, code);
  }
  return worst;
}

}  // namespace cli
}  // namespace flatshard
