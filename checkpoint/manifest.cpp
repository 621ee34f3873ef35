#include "checkpoint/manifest.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>

#include "checkpoint/crc32.h"
#include "support/json.h"

namespace flatshard {

namespace {

constexpr const char* kFormatName = "flatshard-checkpoint";
// The manifest ends with this member; its CRC covers every byte before it.
constexpr const char* kCrcMember = ",\n\"manifest_crc32\": ";

std::string ints(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + "]";
}

std::string strings(const std::vector<std::string>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + json::quote(v[i]);
  return s + "]";
}

uint32_t parse_crc(const json::Node& j) {
  const std::string& s = j.as_string();
  char* end = nullptr;
  const unsigned long v = std::strtoul(s.c_str(), &end, 16);
  if (!(s.size() == 8 && end && *end == '\0')) j.fail("bad crc32 '" + s + "'");
  return static_cast<uint32_t>(v);
}

std::vector<int64_t> parse_ints(const json::Node& j) {
  std::vector<int64_t> v;
  for (const auto& x : j.items()) v.push_back(x.as_int());
  return v;
}

// Errors inside one named entry also name it: the pointer says where, the name which one.
template <class F>
void naming(const std::string& label, const std::string& name, F&& parse) {
  try {
    parse();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, e.msg(), " (", label, " '", name, "')");
  }
}

std::string value_json(const ValueRecord& v) {
  std::string s = "{\"name\": " + json::quote(v.name) + ", \"dtype\": \"" +
                  safetensors_dtype_name(v.dtype) + "\", \"shape\": " + ints(v.shape);
  if (!v.aliases.empty()) s += ", \"tied\": " + strings(v.aliases);
  if (!v.unit.empty()) s += ", \"unit\": " + json::quote(v.unit);
  s += ", \"step\": " + std::to_string(v.step) + ", \"pieces\": [";
  for (size_t i = 0; i < v.pieces.size(); ++i)
    s += std::string(i ? ", " : "") + "{\"file\": " + json::quote(v.pieces[i].file) +
         ", \"begin\": " + std::to_string(v.pieces[i].begin) +
         ", \"end\": " + std::to_string(v.pieces[i].end) + "}";
  return s + "]}";
}

ValueRecord parse_value(const json::Node& j) {
  ValueRecord v;
  v.name = j.at("name").as_string();
  naming("entry", v.name, [&] {
    const json::Node dtype = j.at("dtype");
    v.dtype = safetensors_dtype(dtype.as_string(), dtype.where() + " ('" + v.name + "')");
    v.shape = parse_ints(j.at("shape"));
    if (const auto t = j.find("tied"))
      for (const auto& a : t->items()) v.aliases.push_back(a.as_string());
    if (const auto u = j.find("unit")) v.unit = u->as_string();
    v.step = j.at("step").as_int();
    for (const auto& p : j.at("pieces").items())
      v.pieces.push_back(
          Piece{p.at("file").as_string(), p.at("begin").as_int(), p.at("end").as_int()});
  });
  return v;
}

}  // namespace

int64_t ValueRecord::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const FileTensor* FileRecord::find(const std::string& tensor) const {
  for (const auto& t : tensors)
    if (t.entry.name == tensor) return &t;
  return nullptr;
}

const FileRecord* Manifest::file(const std::string& name) const {
  for (const auto& f : files)
    if (f.name == name) return &f;
  return nullptr;
}

std::string file_record_json(const FileRecord& f) {
  std::string s = "{\"name\": " + json::quote(f.name) + ", \"bytes\": " + std::to_string(f.bytes) +
                  ", \"header_crc32\": \"" + crc32_hex(f.header_crc32) + "\", \"tensors\": [";
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    const TensorEntry& e = f.tensors[i].entry;
    s += std::string(i ? "," : "") + "\n  {\"name\": " + json::quote(e.name) + ", \"dtype\": \"" +
         safetensors_dtype_name(e.dtype) + "\", \"shape\": " + ints(e.shape) +
         ", \"data_offsets\": [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
         "], \"crc32\": [";
    for (size_t k = 0; k < f.tensors[i].crc32.size(); ++k)
      s += std::string(k ? "," : "") + "\"" + crc32_hex(f.tensors[i].crc32[k]) + "\"";
    s += "]}";
  }
  return s + "]}";
}

FileRecord parse_file_record(const json::Node& j) {
  FileRecord f;
  f.name = j.at("name").as_string();
  naming("file", f.name, [&] {
    f.bytes = j.at("bytes").as_int();
    f.header_crc32 = parse_crc(j.at("header_crc32"));
    for (const auto& t : j.at("tensors").items()) {
      FileTensor ft;
      ft.entry.name = t.at("name").as_string();
      const json::Node dtype = t.at("dtype");
      ft.entry.dtype =
          safetensors_dtype(dtype.as_string(), dtype.where() + " (tensor '" + ft.entry.name + "')");
      ft.entry.shape = parse_ints(t.at("shape"));
      const json::Node offsets = t.at("data_offsets");
      const auto off = parse_ints(offsets);
      if (off.size() != 2)
        offsets.fail("tensor '" + ft.entry.name + "': data_offsets needs 2 numbers, got " +
                     std::to_string(off.size()));
      ft.entry.begin = off[0];
      ft.entry.end = off[1];
      for (const auto& c : t.at("crc32").items()) ft.crc32.push_back(parse_crc(c));
      f.tensors.push_back(std::move(ft));
    }
  });
  return f;
}

std::string Manifest::to_json() const {
  std::ostringstream os;
  os << "{\n\"format\": \"" << kFormatName << "\",\n\"version\": " << version
     << ",\n\"kind\": " << json::quote(kind) << ",\n\"world_size\": " << world_size
     << ",\n\"crc_chunk_bytes\": " << crc_chunk_bytes << ",\n\"optimizer\": ";
  if (optimizer) {
    const auto& o = *optimizer;
    os << "{\"type\": " << json::quote(o.type) << ", \"fields\": " << strings(o.fields)
       << ", \"file\": " << json::quote(o.file) << ", \"lr\": " << json::number(o.lr)
       << ", \"betas\": [" << json::number(o.beta1) << ", " << json::number(o.beta2)
       << "], \"eps\": " << json::number(o.eps)
       << ", \"weight_decay\": " << json::number(o.weight_decay)
       << ", \"amsgrad\": " << (o.amsgrad ? "true" : "false") << "}";
  } else {
    os << "null";
  }
  os << ",\n\"units\": [";
  for (size_t i = 0; i < units.size(); ++i)
    os << (i ? "," : "") << "\n {\"name\": " << json::quote(units[i].name)
       << ", \"strategy\": " << json::quote(units[i].strategy) << ", \"numel\": " << units[i].numel
       << ", \"padded_numel\": " << units[i].padded_numel << "}";
  os << "],\n\"params\": [";
  for (size_t i = 0; i < params.size(); ++i) os << (i ? "," : "") << "\n " << value_json(params[i]);
  os << "],\n\"buffers\": [";
  for (size_t i = 0; i < buffers.size(); ++i)
    os << (i ? "," : "") << "\n " << value_json(buffers[i]);
  os << "],\n\"files\": [";
  for (size_t i = 0; i < files.size(); ++i)
    os << (i ? "," : "") << "\n " << file_record_json(files[i]);
  os << "]";
  std::string body = os.str();
  return body + kCrcMember + "\"" + crc32_hex(crc32(body.data(), body.size())) + "\"\n}\n";
}

Manifest Manifest::parse(const std::string& text, const std::string& path) {
  const size_t at = text.rfind(kCrcMember);
  TORCH_CHECK(at != std::string::npos, path,
              ": no manifest_crc32 at the end: the manifest is "
              "truncated or was not written by flatshard");
  const json::Json parsed = json::parse(text, path);
  const json::Node doc(parsed, path);  // errors below name the path and the field
  const uint32_t want = crc32(text.data(), at);
  const uint32_t got = parse_crc(doc.at("manifest_crc32"));
  TORCH_CHECK(got == want, path, ": manifest checksum mismatch (stored ", crc32_hex(got),
              ", computed ", crc32_hex(want), "): the manifest is corrupt");
  Manifest m;
  const json::Node format = doc.at("format");
  if (format.as_string() != kFormatName)
    format.fail("format is '" + format.as_string() + "', expected '" + kFormatName + "'");
  const json::Node version = doc.at("version");
  m.version = static_cast<int>(version.as_int());
  if (m.version != kCheckpointFormatVersion)
    version.fail("format version " + std::to_string(m.version) +
                 " is not supported (this build reads version " +
                 std::to_string(kCheckpointFormatVersion) + ")");
  const json::Node kind = doc.at("kind");
  m.kind = kind.as_string();
  if (m.kind != "sharded" && m.kind != "full") kind.fail("unknown kind '" + m.kind + "'");
  m.world_size = static_cast<int>(doc.at("world_size").as_int());
  const json::Node chunk = doc.at("crc_chunk_bytes");
  m.crc_chunk_bytes = chunk.as_int();
  if (m.crc_chunk_bytes <= 0) chunk.fail("crc_chunk_bytes must be positive");
  const json::Node o = doc.at("optimizer");
  if (!o.is_null()) {
    OptimizerRecord r;
    r.type = o.at("type").as_string();
    for (const auto& f : o.at("fields").items()) r.fields.push_back(f.as_string());
    r.file = o.at("file").as_string();
    r.lr = o.at("lr").as_number();
    const json::Node betas = o.at("betas");
    const auto b = betas.items();
    if (b.size() != 2) betas.fail("optimizer betas must have two numbers");
    r.beta1 = b[0].as_number();
    r.beta2 = b[1].as_number();
    r.eps = o.at("eps").as_number();
    r.weight_decay = o.at("weight_decay").as_number();
    r.amsgrad = o.at("amsgrad").as_bool();
    m.optimizer = r;
  }
  for (const auto& u : doc.at("units").items())
    m.units.push_back(UnitRecord{u.at("name").as_string(), u.at("strategy").as_string(),
                                 u.at("numel").as_int(), u.at("padded_numel").as_int()});
  for (const auto& p : doc.at("params").items()) m.params.push_back(parse_value(p));
  for (const auto& b : doc.at("buffers").items()) m.buffers.push_back(parse_value(b));
  for (const auto& f : doc.at("files").items()) m.files.push_back(parse_file_record(f));
  return m;
}

}  // namespace flatshard
