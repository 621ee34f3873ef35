#include "checkpoint/crc32.h"

#include <zlib.h>

#include <cstdio>

namespace flatshard {

uint32_t crc32_update(uint32_t crc, const void* data, size_t size) {
  // zlib returns its initial value (0), not `crc`, for a null buffer; an empty tensor's
  // data_ptr() is null.
  if (size == 0) return crc;
  // crc32_z takes a z_size_t length (no 4 GiB split needed, unlike crc32's uInt).
  return static_cast<uint32_t>(::crc32_z(crc, static_cast<const Bytef*>(data), size));
}

std::string crc32_hex(uint32_t crc) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", crc);
  return buf;
}

}  // namespace flatshard
