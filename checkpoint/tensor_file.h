// flatshard/checkpoint/tensor_file.h — one safetensors file of a checkpoint, checksummed.
//
// TensorFileWriter writes the header first (every tensor's name, dtype and shape is known
// before any data), then each tensor whole, in any order (a full checkpoint lists parameters in
// model order but receives them unit by unit), computing the CRC-32 of each `crc_chunk` bytes
// as it goes; finish() commits the file (AtomicFile: temporary name, fsync, rename) and returns
// the FileRecord the manifest stores.
//
// TensorFileReader opens a file against its FileRecord and refuses it, naming the file (and the
// tensor, where one is at fault), when it is missing, truncated, longer than recorded, has a
// corrupt header or a header that disagrees with the manifest. read() verifies the checksum of
// every chunk it touches: a load reads, and checks, only the ranges it needs.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"

namespace flatshard {

class TensorFileWriter {
 public:
  // Creates `<dir>/<name>` (as a temporary until finish()).
  TensorFileWriter(const std::string& dir, std::string name, std::vector<TensorEntry> entries,
                   Metadata metadata, int64_t crc_chunk, IoHook hook, bool durable);
  // `t`: CPU, contiguous, with the dtype and numel of the entry `name` (shape may be flat).
  void write(const std::string& name, const at::Tensor& t);
  FileRecord finish();
  int64_t bytes_written() const { return file_.bytes_written(); }

 private:
  std::string name_;
  SafetensorsHeader header_;
  int64_t crc_chunk_;
  AtomicFile file_;
  std::vector<std::vector<uint32_t>> crcs_;
  std::vector<bool> written_;
};

class TensorFileReader {
 public:
  TensorFileReader(const std::string& dir, const FileRecord& record, int64_t crc_chunk);
  const std::string& path() const { return file_.path(); }
  // Copies bytes [begin, end) of tensor `name`'s data to `dst`.
  void read(const std::string& name, int64_t begin, int64_t end, void* dst) const;

 private:
  InputFile file_;
  const FileRecord& record_;
  int64_t crc_chunk_;
  int64_t data_start_ = 0;
};

}  // namespace flatshard
