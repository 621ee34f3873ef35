// flatshard/checkpoint/crc32.h — CRC-32 (IEEE 802.3, the polynomial of zlib, gzip and PNG).
//
// zlib's own crc32_z, so checksums in a manifest are exactly Python's zlib.crc32 and
// binascii.crc32 and can be verified outside flatshard. Incremental:
// crc32_update(crc32_update(0, a), b) == crc of a||b. (Not the SSE4.2 crc32 instruction, which
// computes CRC-32C, another polynomial.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace flatshard {

uint32_t crc32_update(uint32_t crc, const void* data, size_t size);
inline uint32_t crc32(const void* data, size_t size) { return crc32_update(0, data, size); }

// "%08x": the form checksums take in manifests.
std::string crc32_hex(uint32_t crc);

}  // namespace flatshard
