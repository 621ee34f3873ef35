#include "checkpoint/tensor_file.h"

#include <algorithm>
#include <cstring>

#include "checkpoint/crc32.h"

namespace flatshard {

namespace {
std::string join(const std::string& dir, const std::string& name) { return join_path(dir, name); }
}  // namespace

TensorFileWriter::TensorFileWriter(const std::string& dir, std::string name,
                                   std::vector<TensorEntry> entries, Metadata metadata,
                                   int64_t crc_chunk, IoHook hook, bool durable)
    : name_(std::move(name)),
      header_(SafetensorsHeader::make(std::move(entries), std::move(metadata))),
      crc_chunk_(crc_chunk),
      file_(join(dir, name_), std::move(hook), durable),
      crcs_(header_.tensors().size()),
      written_(header_.tensors().size(), false) {
  TORCH_CHECK(crc_chunk_ > 0, "checkpoint: crc_chunk_bytes must be positive");
  file_.write_at(0, header_.bytes().data(), header_.bytes().size());
}

void TensorFileWriter::write(const std::string& name, const at::Tensor& t) {
  const TensorEntry* e = header_.find(name);
  TORCH_INTERNAL_ASSERT(e != nullptr, "checkpoint: no tensor '", name, "' in ", name_);
  const size_t i = static_cast<size_t>(e - header_.tensors().data());
  TORCH_INTERNAL_ASSERT(!written_[i], "checkpoint: tensor '", name, "' written twice");
  TORCH_INTERNAL_ASSERT(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == e->dtype &&
                            t.numel() == e->numel(),
                        "checkpoint: tensor '", name, "' does not match its header entry");
  const auto* p = static_cast<const char*>(t.data_ptr());
  const int64_t n = e->nbytes();
  if (n == 0) crcs_[i].push_back(crc32(p, 0));  // one (empty) chunk per tensor at least
  for (int64_t off = 0; off < n; off += crc_chunk_)
    crcs_[i].push_back(crc32(p + off, static_cast<size_t>(std::min(crc_chunk_, n - off))));
  if (n > 0) file_.write_at(header_.data_start() + e->begin, p, static_cast<size_t>(n));
  written_[i] = true;
}

FileRecord TensorFileWriter::finish() {
  for (size_t i = 0; i < written_.size(); ++i)
    TORCH_INTERNAL_ASSERT(written_[i], "checkpoint: tensor '", header_.tensors()[i].name, "' of ",
                          name_, " was never written");
  file_.commit();
  FileRecord r;
  r.name = name_;
  r.bytes = header_.file_bytes();
  r.header_crc32 = crc32(header_.bytes().data(), header_.bytes().size());
  for (size_t i = 0; i < crcs_.size(); ++i)
    r.tensors.push_back(FileTensor{header_.tensors()[i], crcs_[i]});
  return r;
}

TensorFileReader::TensorFileReader(const std::string& dir, const FileRecord& record,
                                   int64_t crc_chunk)
    : file_(join(dir, record.name)), record_(record), crc_chunk_(crc_chunk) {
  const std::string& path = file_.path();
  // Note [Checkpoint confinement]: the size first, before a byte is read, and described from
  // the manifest's record (what should be there), never from the file's own bytes.
  if (file_.size() != record.bytes) {
    int64_t data_bytes = 0;
    for (const auto& t : record.tensors) data_bytes = std::max(data_bytes, t.entry.end);
    const int64_t data_start = record.bytes - data_bytes;
    TORCH_CHECK(file_.size() <= record.bytes, path, ": ", file_.size(),
                " bytes, the manifest says ", record.bytes, " (", file_.size() - record.bytes,
                " unexpected bytes after the last tensor)");
    TORCH_CHECK(file_.size() >= data_start, path,
                ": truncated inside the safetensors header: the file has only ", file_.size(),
                " bytes, the manifest says ", record.bytes, " (the header alone takes ", data_start,
                ")");
    for (const auto& t : record.tensors)
      TORCH_CHECK(data_start + t.entry.end <= file_.size(), path, ": truncated: the file has ",
                  file_.size(), " bytes, the manifest says ", record.bytes, "; tensor '",
                  t.entry.name, "' needs bytes [", data_start + t.entry.begin, ", ",
                  data_start + t.entry.end, ")");
  }
  std::string raw = SafetensorsHeader::read_raw(file_);
  const uint32_t got = crc32(raw.data(), raw.size());
  TORCH_CHECK(got == record.header_crc32, path, ": header checksum mismatch (manifest says ",
              crc32_hex(record.header_crc32), ", file has ", crc32_hex(got),
              "): the safetensors header is corrupt or belongs to another save");
  const SafetensorsHeader h = SafetensorsHeader::parse(std::move(raw), path, file_.size());
  TORCH_CHECK(h.tensors().size() == record.tensors.size(), path, ": header lists ",
              h.tensors().size(), " tensors, the manifest ", record.tensors.size());
  for (const auto& t : record.tensors) {
    const TensorEntry* e = h.find(t.entry.name);
    TORCH_CHECK(e != nullptr, path, ": tensor '", t.entry.name,
                "' is in the manifest but not in the file's header");
    TORCH_CHECK(e->dtype == t.entry.dtype && e->shape == t.entry.shape &&
                    e->begin == t.entry.begin && e->end == t.entry.end,
                path, ": tensor '", t.entry.name, "': header says ",
                safetensors_dtype_name(e->dtype), " ", c10::IntArrayRef(e->shape), " at [",
                e->begin, ", ", e->end, "), the manifest ", safetensors_dtype_name(t.entry.dtype),
                " ", c10::IntArrayRef(t.entry.shape), " at [", t.entry.begin, ", ", t.entry.end,
                ")");
    const int64_t chunks = std::max<int64_t>(1, (t.entry.nbytes() + crc_chunk_ - 1) / crc_chunk_);
    TORCH_CHECK(static_cast<int64_t>(t.crc32.size()) == chunks, path, ": tensor '", t.entry.name,
                "': the manifest has ", t.crc32.size(), " checksums, expected ", chunks);
  }
  data_start_ = h.data_start();
}

void TensorFileReader::read(const std::string& name, int64_t begin, int64_t end, void* dst) const {
  const FileTensor* t = record_.find(name);
  TORCH_CHECK(t != nullptr, file_.path(), ": no tensor '", name, "' (the manifest lists pieces ",
              "the file does not have)");
  const int64_t n = t->entry.nbytes();
  TORCH_CHECK(0 <= begin && begin <= end && end <= n, file_.path(), ": tensor '", name,
              "': bytes [", begin, ", ", end, ") are outside its ", n, " bytes");
  std::vector<char> buf;
  auto* out = static_cast<char*>(dst);
  for (int64_t k = begin / crc_chunk_; k * crc_chunk_ < end; ++k) {
    const int64_t c0 = k * crc_chunk_, c1 = std::min(n, c0 + crc_chunk_);
    buf.resize(static_cast<size_t>(c1 - c0));
    file_.read(data_start_ + t->entry.begin + c0, buf.data(), buf.size());
    const uint32_t got = crc32(buf.data(), buf.size());
    TORCH_CHECK(got == t->crc32[k], file_.path(), ": checksum mismatch in tensor '", name,
                "', bytes [", c0, ", ", c1, ") of its data (chunk ", k, "): expected ",
                crc32_hex(t->crc32[k]), ", got ", crc32_hex(got), "; the file is corrupt");
    const int64_t lo = std::max(begin, c0), hi = std::min(end, c1);
    std::memcpy(out + (lo - begin), buf.data() + (lo - c0), static_cast<size_t>(hi - lo));
  }
}

}  // namespace flatshard
