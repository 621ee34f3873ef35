#include "collectives/nccl_check.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>

#include <sstream>

namespace flatshard {
namespace detail {

std::string nccl_version_string() {
  static const std::string version = [] {
    int v = 0;
    std::ostringstream os;
    if (ncclGetVersion(&v) == ncclSuccess)
      os << v / 10000 << "." << (v % 10000) / 100 << "." << v % 100;  // code of NCCL >= 2.9
    else
      os << "unknown";
    if (v != NCCL_VERSION_CODE)
      os << " (built against " << NCCL_MAJOR << "." << NCCL_MINOR << "." << NCCL_PATCH << ")";
    return os.str();
  }();
  return version;
}

void throw_nccl_error(const char* call, ncclResult_t result, ncclComm_t comm, int rank,
                      const char* file, int line) {
  const char* last = ncclGetLastError(comm);
  C10_THROW_ERROR(DistBackendError,
                  c10::str("NCCL error in ", call, " at ", file, ":", line, " (rank ", rank,
                           ", NCCL ", nccl_version_string(), "): ", ncclGetErrorString(result),
                           "; last NCCL error: ", (last && *last) ? last : "(none)"));
}

}  // namespace detail
}  // namespace flatshard
