#include "checkpoint/manifest.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "checkpoint/file_io.h"

#include "checkpoint/crc32.h"
#include "support/input_file.h"
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

// A member this build does not know is an error naming it (Note [Strict manifest]: a newer
// writer bumps the format version instead of adding fields a reader would silently ignore).
void only(const json::Node& j, std::initializer_list<const char*> known) {
  for (const auto& [key, value] : j.members()) {
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    if (ok) continue;
    std::string list;
    for (const char* k : known) list += std::string(list.empty() ? "" : ", ") + k;
    j.fail("unknown field '" + key.substr(0, 100) + "' (this build knows " + list + ")");
  }
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

std::string value_json(const ValueRecord& v, bool with_tp) {
  std::string s = "{\"name\": " + json::quote(v.name) + ", \"dtype\": \"" +
                  safetensors_dtype_name(v.dtype) + "\", \"shape\": " + ints(v.shape);
  if (with_tp) s += ", \"tp\": " + json::quote(to_string(v.tp));
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
    only(j, {"name", "dtype", "shape", "tied", "unit", "step", "pieces", "tp"});
    if (const auto t = j.find("tp")) {
      const auto placement = parse_tp_placement(t->as_string());
      if (!placement)
        t->fail("unknown tp placement '" + printable_escape(t->as_string().substr(0, 100)) +
                "' (known: replicate, colwise, colwise/K, rowwise)");
      v.tp = *placement;
    }
    const json::Node dtype = j.at("dtype");
    // where() searches the document (support/json.h): only for the error.
    const auto known = find_safetensors_dtype(dtype.as_string());
    v.dtype = known ? *known
                    : safetensors_dtype(dtype.as_string(), dtype.where() + " ('" + v.name + "')");
    v.shape = parse_ints(j.at("shape"));
    if (const auto t = j.find("tied"))
      for (const auto& a : t->items()) v.aliases.push_back(a.as_string());
    if (const auto u = j.find("unit")) v.unit = u->as_string();
    v.step = j.at("step").as_int();
    for (const auto& p : j.at("pieces").items()) {
      only(p, {"file", "begin", "end"});
      v.pieces.push_back(
          Piece{p.at("file").as_string(), p.at("begin").as_int(), p.at("end").as_int()});
    }
  });
  return v;
}

std::string dims(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// Note [Strict manifest]
// A CRC guards against accidents, not against someone who edits a manifest and recomputes it,
// so everything a load relies on is checked here, before any file is opened: the format
// version first (its own message for newer versions), unknown fields (parse), duplicate keys
// (support/json.h), plain file names (Note [Checkpoint confinement]); shapes whose products
// fit int64; each value's pieces sorted, non-overlapping and covering its elements exactly;
// every piece's tensor (and optimizer field) present in its file's record with the value's
// dtype and the piece's element count; step counts >= 0, 0 without an optimizer and equal
// within a unit (a load gives a unit one step count); names unique; a tp placement only on a
// parameter of a manifest with tp_size in [2, 2^16], on a shape it can split (tp_split_error:
// dim 0 a multiple of parts x tp for colwise, a 2-D shape with dim 1 a multiple of tp for
// rowwise), so tp_unslice never meets a shape it cannot reshape; a grad scaler's state
// usable (GradScalerState::check: a finite positive scale, ...). What it cannot check is
// whether the values are the ones that were saved: that needs a signature (docs/checkpoints.md,
// "Trust model").
void validate(const Manifest& m, const std::string& path) {
  if (m.grad_scaler) m.grad_scaler->check(path + ": grad_scaler");
  std::unordered_map<std::string, const FileRecord*> files;
  for (const FileRecord& f : m.files) {
    const std::string where = path + ": file '" + f.name.substr(0, 200) + "'";
    check_plain_name(f.name, where);
    TORCH_CHECK(files.emplace(f.name, &f).second, where, " is listed twice");
    TORCH_CHECK(f.bytes >= 0, where, ": negative size ", f.bytes);
    std::unordered_set<std::string> names;
    for (const FileTensor& t : f.tensors) {
      const TensorEntry& e = t.entry;
      TORCH_CHECK(names.insert(e.name).second, where, ": tensor '", e.name, "' is listed twice");
      int64_t n = 0, bytes = 0;
      TORCH_CHECK(
          checked_numel(e.shape, &n) &&
              !__builtin_mul_overflow(n, static_cast<int64_t>(c10::elementSize(e.dtype)), &bytes),
          where, ": tensor '", e.name, "' has shape ", dims(e.shape),
          ", which has a negative dimension or more elements than int64 holds");
      TORCH_CHECK(0 <= e.begin && e.begin <= e.end && e.end - e.begin == bytes, where, ": tensor '",
                  e.name, "' (", safetensors_dtype_name(e.dtype), " ", dims(e.shape),
                  ") has data_offsets [", e.begin, ", ", e.end, "], expected ", bytes, " bytes");
    }
  }
  std::vector<std::string> fields;
  if (m.optimizer) {
    if (!m.optimizer->file.empty()) {
      check_plain_name(m.optimizer->file, path + ": optimizer file");
      TORCH_CHECK(files.count(m.optimizer->file), path, ": optimizer file '", m.optimizer->file,
                  "' is not listed in the manifest's files");
    }
    std::unordered_set<std::string> seen;
    for (const std::string& f : m.optimizer->fields) {
      TORCH_CHECK(f == "exp_avg" || f == "exp_avg_sq" || f == "max_exp_avg_sq", path,
                  ": unknown optimizer field '", f.substr(0, 100),
                  "' (known: exp_avg, exp_avg_sq, max_exp_avg_sq)");
      TORCH_CHECK(seen.insert(f).second, path, ": optimizer field '", f, "' is listed twice");
    }
    fields = m.optimizer->fields;
  }
  std::unordered_set<std::string> names;
  std::unordered_map<std::string, const ValueRecord*> unit_step;
  auto check_value = [&](const ValueRecord& v, bool param) {
    const std::string where =
        path + ": " + (param ? "parameter" : "buffer") + " '" + v.name.substr(0, 200) + "'";
    TORCH_CHECK(names.insert(v.name).second, where, " is listed twice");
    for (const auto& a : v.aliases)
      TORCH_CHECK(names.insert(a).second, where, ": tied name '", a, "' is listed twice");
    int64_t numel = 0;
    TORCH_CHECK(checked_numel(v.shape, &numel), where, ": shape ", dims(v.shape),
                " has a negative dimension or more elements than int64 holds");
    TORCH_CHECK(v.step >= 0, where, ": negative optimizer step count ", v.step);
    if (v.tp.style != TpStyle::kReplicate) {
      TORCH_CHECK(param && m.tp_size > 1, where, ": tp placement '", to_string(v.tp), "' but ",
                  param ? "the manifest's tp_size is 1" : "buffers are never split");
      const std::string bad = tp_split_error(v.shape, v.tp, m.tp_size);
      TORCH_CHECK(bad.empty(), where, ": tp placement '", to_string(v.tp), "' at tp_size ",
                  m.tp_size, " does not fit: ", bad);
    }
    if (param) {
      TORCH_CHECK(m.optimizer || v.step == 0, where, ": step count ", v.step,
                  " but the checkpoint has no optimizer state");
      auto [it, fresh] = unit_step.emplace(v.unit, &v);
      TORCH_CHECK(fresh || it->second->step == v.step, where, ": step count ", v.step,
                  " differs from that of '", it->second->name, "' (", it->second->step,
                  ") in the same unit '", v.unit, "'");
    } else {
      TORCH_CHECK(v.step == 0, where, ": buffers carry no optimizer state, but step is ", v.step);
    }
    int64_t expect = 0;  // elements covered so far, in order
    for (size_t i = 0; i < v.pieces.size(); ++i) {
      const Piece& p = v.pieces[i];
      const std::string piece = where + ": piece " + std::to_string(i) + " [" +
                                std::to_string(p.begin) + ", " + std::to_string(p.end) + ")";
      check_plain_name(p.file, piece);
      TORCH_CHECK(p.begin <= p.end, piece, " is reversed");
      TORCH_CHECK(p.begin >= expect, piece, " overlaps the previous pieces, which end at ", expect,
                  " (pieces must be sorted and disjoint)");
      TORCH_CHECK(p.begin == expect, piece, " leaves elements [", expect, ", ", p.begin,
                  ") uncovered");
      TORCH_CHECK(p.end <= numel, piece, " runs past the value's ", numel, " elements");
      expect = p.end;
      auto tensor_of = [&](const std::string& file, const std::string& tensor) {
        auto f = files.find(file);
        TORCH_CHECK(f != files.end(), piece, ": file '", file,
                    "' is not listed in the manifest's files");
        const FileTensor* t = f->second->find(tensor);
        TORCH_CHECK(t != nullptr, piece, ": file '", file, "' has no tensor '", tensor, "'");
        const TensorEntry& e = t->entry;
        TORCH_CHECK(e.dtype == v.dtype, piece, ": tensor '", tensor, "' in '", file, "' is ",
                    safetensors_dtype_name(e.dtype), ", the value is ",
                    safetensors_dtype_name(v.dtype));
        TORCH_CHECK(e.numel() == p.end - p.begin &&
                        (e.shape == std::vector<int64_t>{p.end - p.begin} || e.shape == v.shape),
                    piece, ": tensor '", tensor, "' in '", file, "' has shape ", dims(e.shape),
                    ", expected [", p.end - p.begin, "] or ", dims(v.shape));
      };
      tensor_of(p.file, v.name);
      if (param)
        for (const std::string& f : fields)
          tensor_of(m.optimizer->file.empty() ? p.file : m.optimizer->file, v.name + "." + f);
    }
    TORCH_CHECK(expect == numel, where, ": pieces cover elements [0, ", expect, ") of its ", numel);
  };
  for (const ValueRecord& v : m.params) check_value(v, true);
  for (const ValueRecord& v : m.buffers) check_value(v, false);
}

}  // namespace

int64_t ValueRecord::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // parse() checked that it does not overflow
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
    only(j, {"name", "bytes", "header_crc32", "tensors"});
    f.bytes = j.at("bytes").as_int();
    f.header_crc32 = parse_crc(j.at("header_crc32"));
    for (const auto& t : j.at("tensors").items()) {
      only(t, {"name", "dtype", "shape", "data_offsets", "crc32"});
      FileTensor ft;
      ft.entry.name = t.at("name").as_string();
      const json::Node dtype = t.at("dtype");
      const auto known = find_safetensors_dtype(dtype.as_string());
      ft.entry.dtype = known ? *known
                             : safetensors_dtype(dtype.as_string(), dtype.where() + " (tensor '" +
                                                                        ft.entry.name + "')");
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
 << ",\n\"kind\": " << json::quote(kind) << ",\n\"world_size\": " << world_size;
  if (tp_size > 1) os << ",\n\"tp_size\": " << tp_size;  // other manifests stay as they were
  os << ",\n\"crc_chunk_bytes\": " << crc_chunk_bytes << ",\n\"optimizer\": ";
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
  if (grad_scaler) {  // only when saved with a scaler, so other manifests stay as they were
    const auto& g = *grad_scaler;
    os << ",\n\"grad_scaler\": {\"scale\": " << json::number(g.scale)
       << ", \"growth_factor\": " << json::number(g.growth_factor)
       << ", \"backoff_factor\": " << json::number(g.backoff_factor)
       << ", \"growth_interval\": " << g.growth_interval
       << ", \"growth_tracker\": " << g.growth_tracker << "}";
  }
  if (training_state) os << ",\n\"training_state\": " << *training_state;
  os << ",\n\"units\": [";
  for (size_t i = 0; i < units.size(); ++i)
    os << (i ? "," : "") << "\n {\"name\": " << json::quote(units[i].name)
       << ", \"strategy\": " << json::quote(units[i].strategy) << ", \"numel\": " << units[i].numel
       << ", \"padded_numel\": " << units[i].padded_numel << "}";
  os << "],\n\"params\": [";
  for (size_t i = 0; i < params.size(); ++i) os << (i ? "," : "") << "\n " << value_json(params[i], tp_size > 1);
  os << "],\n\"buffers\": [";
  for (size_t i = 0; i < buffers.size(); ++i)
    os << (i ? "," : "") << "\n " << value_json(buffers[i], false);
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
  // The version first: a newer writer may have changed anything after it, the checksum too.
  const json::Node version = doc.at("version");
  const int64_t v = version.as_int();
  if (v > kCheckpointFormatVersion)
    version.fail("format version " + std::to_string(v) + " was written by a newer flatshard; " +
                 "this build reads version " + std::to_string(kCheckpointFormatVersion) +
                 " (upgrade flatshard to load it)");
  if (v != kCheckpointFormatVersion)
    version.fail("format version " + std::to_string(v) + " is not supported (this build reads " +
                 "version " + std::to_string(kCheckpointFormatVersion) + ")");
  const uint32_t want = crc32(text.data(), at);
  const uint32_t got = parse_crc(doc.at("manifest_crc32"));
  TORCH_CHECK(got == want, path, ": manifest checksum mismatch (stored ", crc32_hex(got),
              ", computed ", crc32_hex(want), "): the manifest is corrupt");
  only(doc, {"format", "version", "kind", "world_size", "tp_size", "crc_chunk_bytes", "optimizer",
             "grad_scaler", "training_state", "units", "params", "buffers", "files",
             "manifest_crc32"});
  Manifest m;
  const json::Node format = doc.at("format");
  if (format.as_string() != kFormatName)
    format.fail("format is '" + format.as_string() + "', expected '" + kFormatName + "'");
  m.version = static_cast<int>(v);
  const json::Node kind = doc.at("kind");
  m.kind = kind.as_string();
  if (m.kind != "sharded" && m.kind != "full") kind.fail("unknown kind '" + m.kind + "'");
  const json::Node world = doc.at("world_size");
  const int64_t w = world.as_int();
  if (w < 1 || w > (int64_t{1} << 24))
    world.fail("world_size " + std::to_string(w) + " is not in [1, 2^24]");
  m.world_size = static_cast<int>(w);
  if (const auto tp = doc.find("tp_size")) {
    const int64_t t = tp->as_int();
    if (t < 2 || t > (int64_t{1} << 16))
      tp->fail("tp_size " + std::to_string(t) + " is not in [2, 2^16] (absent means 1)");
    m.tp_size = static_cast<int>(t);
  }
  const json::Node chunk = doc.at("crc_chunk_bytes");
  m.crc_chunk_bytes = chunk.as_int();
  if (m.crc_chunk_bytes <= 0 || m.crc_chunk_bytes > (int64_t{1} << 40))
    chunk.fail("crc_chunk_bytes must be in [1, 2^40]");
  const json::Node o = doc.at("optimizer");
  if (!o.is_null()) {
    only(o, {"type", "fields", "file", "lr", "betas", "eps", "weight_decay", "amsgrad"});
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
  if (const auto g = doc.find("grad_scaler")) {
    only(*g, {"scale", "growth_factor", "backoff_factor", "growth_interval", "growth_tracker"});
    GradScalerState r;
    r.scale = g->at("scale").as_number();
    r.growth_factor = g->at("growth_factor").as_number();
    r.backoff_factor = g->at("backoff_factor").as_number();
    r.growth_interval = g->at("growth_interval").as_int();
    r.growth_tracker = g->at("growth_tracker").as_int();
    m.grad_scaler = r;
  }
  if (const auto t = doc.find("training_state")) {
    if (!t->is_object()) t->fail("training_state must be a JSON object");
    std::string compact = t->json().dump();
    if (static_cast<int64_t>(compact.size()) > kMaxTrainingStateBytes)
      t->fail("training_state is " + std::to_string(compact.size()) + " bytes, more than " +
              std::to_string(kMaxTrainingStateBytes));
    m.training_state = std::move(compact);
  }
  for (const auto& u : doc.at("units").items()) {
    only(u, {"name", "strategy", "numel", "padded_numel"});
    m.units.push_back(UnitRecord{u.at("name").as_string(), u.at("strategy").as_string(),
                                 u.at("numel").as_int(), u.at("padded_numel").as_int()});
  }
  for (const auto& p : doc.at("params").items()) m.params.push_back(parse_value(p));
  for (const auto& b : doc.at("buffers").items()) m.buffers.push_back(parse_value(b));
  for (const auto& f : doc.at("files").items()) m.files.push_back(parse_file_record(f));
  validate(m, path);
  return m;
}

std::string check_training_state(const std::string& text, const std::string& what) {
  TORCH_CHECK(static_cast<int64_t>(text.size()) <= kMaxTrainingStateBytes, what, ": ",
              text.size(), " bytes, more than the limit of ", kMaxTrainingStateBytes, " bytes");
  const json::Json doc = json::parse(text, what);
  TORCH_CHECK(doc.is_object(), what, ": expected a JSON object, got ", doc.type_name());
  std::string compact = doc.dump();
  TORCH_CHECK(static_cast<int64_t>(compact.size()) <= kMaxTrainingStateBytes, what, ": ",
              compact.size(), " bytes, more than the limit of ", kMaxTrainingStateBytes, " bytes");
  return compact;
}

}  // namespace flatshard
