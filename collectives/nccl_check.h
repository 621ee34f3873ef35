// flatshard/collectives/nccl_check.h — the one macro that checks every NCCL call.
//
// FLATSHARD_NCCL_CHECK(call, comm, rank) evaluates `call`; on any result other than ncclSuccess
// it throws c10::DistBackendError whose message carries the call's text, file:line, the rank,
// ncclGetErrorString(result), ncclGetLastError(comm) and the NCCL version (loaded library and
// header). Pass comm = nullptr where no communicator exists yet (ncclGetUniqueId,
// ncclCommInitRank*): NCCL then reports its last global error.
#pragma once

#include <c10/macros/Macros.h>
#include <nccl.h>

#include <string>

namespace flatshard {
namespace detail {

[[noreturn]] void throw_nccl_error(const char* call, ncclResult_t result, ncclComm_t comm, int rank,
                                   const char* file, int line);
// "2.28.9" (the loaded library), plus " (built against X)" when the header differs.
std::string nccl_version_string();

}  // namespace detail
}  // namespace flatshard

#define FLATSHARD_NCCL_CHECK(call, comm, rank)                                               \
  do {                                                                                       \
    const ncclResult_t flatshard_nccl_result_ = (call);                                      \
    if (C10_UNLIKELY(flatshard_nccl_result_ != ncclSuccess)) {                               \
      ::flatshard::detail::throw_nccl_error(#call, flatshard_nccl_result_, (comm), (rank),   \
                                            __FILE__, __LINE__);                             \
    }                                                                                        \
  } while (0)
