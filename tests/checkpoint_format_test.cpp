// The checkpoint's building blocks against independent references: CRC-32 check values (the
// ones zlib and the IEEE standard publish), the manifest's strict reading (JSON itself:
// tests/json_test.cpp), safetensors per its spec (and against the reference implementation:
// tests/safetensors_interop_test.cpp).
#include <ATen/ATen.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>

#include "checkpoint/crc32.h"
#include "checkpoint/file_io.h"
#include "checkpoint/manifest.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_file.h"
#include "temp_dir.h"

using namespace flatshard;
using Catch::Contains;

TEST_CASE("crc32 matches zlib's check values, incrementally too", "[checkpoint][format]") {
  const std::string s = "123456789";
  CHECK(crc32(s.data(), s.size()) == 0xCBF43926u);
  CHECK(crc32(s.data(), 0) == 0u);
  const std::string fox = "The quick brown fox jumps over the lazy dog";
  CHECK(crc32(fox.data(), fox.size()) == 0x414FA339u);
  // Split at every point (exercises the 8-byte fold and the byte tail).
  for (size_t cut = 0; cut <= fox.size(); ++cut)
    CHECK(crc32_update(crc32(fox.data(), cut), fox.data() + cut, fox.size() - cut) == 0x414FA339u);
  CHECK(crc32_hex(0x0a0b0c0du) == "0a0b0c0d");
  // An empty tensor's data_ptr() is null: nothing to add, the running value stays.
  CHECK(crc32_update(0x414FA339u, nullptr, 0) == 0x414FA339u);
}

namespace {

// A manifest with one parameter and one file whose sizes and offsets sit at int64's top.
Manifest small_manifest() {
  Manifest m;
  m.kind = "sharded";
  m.world_size = 2;
  m.crc_chunk_bytes = 8;
  m.optimizer = OptimizerRecord{};  // step counts need one (its state fields: none here)
  m.optimizer->type = "AdamW";
  ValueRecord v;
  v.name = "wte.weight";
  v.shape = {2, 3};
  v.unit = "root";
  v.step = 1;
  v.pieces = {Piece{"shard-0.safetensors", 0, 6}};
  m.params.push_back(v);
  FileRecord f;
  f.name = "shard-0.safetensors";
  f.bytes = INT64_MAX;
  f.header_crc32 = 0xdeadbeefu;
  FileTensor t;
  t.entry.name = "wte.weight";
  t.entry.shape = {2, 3};
  t.entry.begin = INT64_MAX - 25;  // 24 bytes: 6 F32 elements
  t.entry.end = INT64_MAX - 1;
  t.crc32 = {0x01020304u, 0xffffffffu};
  f.tensors.push_back(t);
  m.files.push_back(f);
  return m;
}

// `text` with `from` replaced by `to` and the manifest CRC recomputed, so that only the edit
// is wrong with it. (The layout: the text ends with ,\n"manifest_crc32": "xxxxxxxx"\n}\n and
// the CRC covers everything before that member.)
std::string edited(const std::string& text, const std::string& from, const std::string& to) {
  std::string s = text;
  const size_t at = s.find(from);
  REQUIRE(at != std::string::npos);
  s.replace(at, from.size(), to);
  const std::string member = ",\n\"manifest_crc32\": ";
  const size_t end = s.rfind(member);
  REQUIRE(end != std::string::npos);
  return s.substr(0, end) + member + "\"" + crc32_hex(crc32(s.data(), end)) + "\"\n}\n";
}

}  // namespace

TEST_CASE("manifest: round trip, int64 extremes exact", "[checkpoint][format][json]") {
  const std::string text = small_manifest().to_json();
  const Manifest m = Manifest::parse(text, "d/manifest.json");
  REQUIRE(m.files.size() == 1);
  REQUIRE(m.files[0].tensors.size() == 1);
  CHECK(m.files[0].bytes == INT64_MAX);
  CHECK(m.files[0].header_crc32 == 0xdeadbeefu);
  CHECK(m.files[0].tensors[0].entry.begin == INT64_MAX - 25);
  CHECK(m.files[0].tensors[0].entry.end == INT64_MAX - 1);
  CHECK(m.files[0].tensors[0].crc32 == std::vector<uint32_t>{0x01020304u, 0xffffffffu});
  REQUIRE(m.params.size() == 1);
  CHECK(m.params[0].name == "wte.weight");
  CHECK(m.params[0].shape == std::vector<int64_t>{2, 3});
  CHECK(m.params[0].step == 1);
  CHECK(text.find("\"bytes\": 9223372036854775807") != std::string::npos);
  // edited() itself leaves a manifest that loads.
  CHECK_NOTHROW(Manifest::parse(edited(text, "\"step\": 1", "\"step\": 2"), "d/manifest.json"));
}

TEST_CASE("manifest: duplicate keys are refused, naming the key and the file",
          "[checkpoint][format][json]") {
  const std::string text = small_manifest().to_json();
  // Another reader would silently take one of the two step counts.
  CHECK_THROWS_WITH(
      Manifest::parse(edited(text, "\"step\": 1", "\"step\": 1, \"step\": 7"), "d/manifest.json"),
      Contains("d/manifest.json: invalid JSON: duplicate key 'step' in the object at /params/0"));
  CHECK_THROWS_WITH(
      Manifest::parse(edited(text, "\"world_size\": 2", "\"world_size\": 2,\n\"world_size\": 4"),
                      "d/manifest.json"),
      Contains("d/manifest.json") && Contains("duplicate key 'world_size'"));
}

TEST_CASE("manifest: a wrong-typed field names the file, the key and the entry",
          "[checkpoint][format][json]") {
  const std::string text = small_manifest().to_json();
  CHECK_THROWS_WITH(
      Manifest::parse(edited(text, "\"step\": 1", "\"step\": 1.5"), "d/manifest.json"),
      Contains("d/manifest.json: /params/0/step: expected an integer, got 1.5 "
               "(entry 'wte.weight')"));
  CHECK_THROWS_WITH(Manifest::parse(edited(text, "\"bytes\": 9223372036854775807",
                                           "\"bytes\": \"9223372036854775807\""),
                                    "d/manifest.json"),
                    Contains("d/manifest.json: /files/0/bytes: expected an integer, got a string "
                             "(file 'shard-0.safetensors')"));
  CHECK_THROWS_WITH(Manifest::parse(edited(text, "\"bytes\": 9223372036854775807",
                                           "\"bytes\": 9223372036854775808"),
                                    "d/manifest.json"),
                    Contains("/files/0/bytes: integer 9223372036854775808 does not fit in int64"));
  CHECK_THROWS_WITH(Manifest::parse(edited(text, "\"kind\": \"sharded\"", "\"kind\": \"half\""),
                                    "d/manifest.json"),
                    Contains("d/manifest.json: /kind: unknown kind 'half'"));
  CHECK_THROWS_WITH(Manifest::parse(edited(text, "\"01020304\"", "\"0102030\""), "d/manifest.json"),
                    Contains("d/manifest.json: /files/0/tensors/0/crc32/0: bad crc32 '0102030'"));
}

TEST_CASE("safetensors: written files parse back, dtypes, alignment, metadata",
          "[checkpoint][format]") {
  flatshard_test::TempDir tmp;
  std::vector<TensorEntry> entries;
  const std::vector<at::Tensor> values = {at::arange(6, at::kFloat).view({2, 3}),
                                          at::arange(5, at::kLong), at::ones({3}, at::kBFloat16),
                                          at::zeros({0}, at::kFloat), at::arange(3) % 2 == 0};
  const char* names[] = {"w", "idx", "b16", "empty", "mask"};
  for (size_t i = 0; i < values.size(); ++i) {
    TensorEntry e;
    e.name = names[i];
    e.dtype = values[i].scalar_type();
    e.shape = values[i].sizes().vec();
    entries.push_back(e);
  }
  TensorFileWriter w(tmp.path(), "t.safetensors", entries, {{"format", "pt"}, {"k\"ey", "v"}}, 8,
                     nullptr, false);
  for (size_t i = values.size(); i-- > 0;) w.write(names[i], values[i]);  // any order
  const FileRecord rec = w.finish();
  CHECK(!path_exists(tmp / "t.safetensors.tmp"));
  InputFile f(tmp / "t.safetensors");
  const SafetensorsHeader h = SafetensorsHeader::read(f);
  CHECK(h.data_start() % 8 == 0);
  CHECK(h.metadata() == Metadata{{"format", "pt"}, {"k\"ey", "v"}});
  REQUIRE(h.tensors().size() == values.size());
  CHECK(rec.find("w")->crc32.size() == 3);  // 24 bytes in 8-byte chunks
  TensorFileReader r(tmp.path(), rec, 8);
  for (size_t i = 0; i < values.size(); ++i) {
    const TensorEntry* e = h.find(names[i]);
    REQUIRE(e != nullptr);
    CHECK(e->dtype == values[i].scalar_type());
    CHECK(e->shape == values[i].sizes().vec());
    at::Tensor back = at::empty_like(values[i]);
    r.read(names[i], 0, e->nbytes(), back.data_ptr());
    CHECK(at::equal(back, values[i]));
  }
  at::Tensor mid = at::empty({2}, at::kFloat);  // elements 2..3 of w, across a chunk boundary
  r.read("w", 8, 16, mid.data_ptr());
  CHECK(at::equal(mid, at::tensor({2.0f, 3.0f})));
  CHECK(safetensors_dtype("BF16", "t") == at::kBFloat16);
  CHECK_THROWS_WITH(safetensors_dtype("F8_E4M3", "x.safetensors"),
                    Contains("x.safetensors") && Contains("unknown safetensors dtype 'F8_E4M3'"));
}

TEST_CASE("safetensors reader rejects overlapping, gapped and oversized data",
          "[checkpoint][format]") {
  flatshard_test::TempDir tmp;
  auto file_with = [&](const std::string& json, size_t data_bytes) {
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((json.size() >> (8 * i)) & 0xFF);
    bytes += json + std::string(data_bytes, '\0');
    flatshard_test::write_bytes(tmp / "x.safetensors", bytes);
    return InputFile(tmp / "x.safetensors");
  };
  CHECK_THROWS_WITH(
      SafetensorsHeader::read(file_with(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                        R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                                        8)),
      Contains("'b'") && Contains("does not follow"));
  CHECK_THROWS_WITH(SafetensorsHeader::read(
                        file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8)),
                    Contains("'a'"));
  CHECK_THROWS_WITH(SafetensorsHeader::read(
                        file_with(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}})", 8)),
                    Contains("truncated") && Contains("'a'"));
  CHECK_THROWS_WITH(SafetensorsHeader::read(
                        file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8)),
                    Contains("4 unexpected bytes"));
  CHECK_THROWS_WITH(SafetensorsHeader::read(file_with("[]", 0)),
                    Contains("does not start with '{'"));
  // Empty tensors share their offset with the next tensor, in any header order (20 pairs: past
  // the sizes where std::sort happens to be stable).
  std::string many = "{";
  for (int i = 19; i >= 0; --i) {
    const std::string at = std::to_string(4 * i), end = std::to_string(4 * i + 4);
    many += std::string(i < 19 ? "," : "") + "\"n" + std::to_string(i) +
            "\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[" + at + "," + end + "]}," +
            "\"e" + std::to_string(i) + "\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[" +
            at + "," + at + "]}";
  }
  CHECK(SafetensorsHeader::read(file_with(many + "}", 80)).tensors().size() == 40);
}

TEST_CASE("a save never replaces a directory that is not a checkpoint", "[checkpoint][format]") {
  flatshard_test::TempDir tmp;
  const std::string dir = tmp / "mine";
  make_dirs(dir);
  const std::string staging = begin_save(dir, kManifestName, false, {});  // empty: fine
  CHECK(has_marker(staging));
  CHECK(has_marker(dir));  // adopted: it will be swapped out and must be recognisable then
  abandon_save(staging);
  CHECK(!path_exists(staging));
  ::unlink((dir + "/" + kMarkerName).c_str());
  flatshard_test::write_bytes(dir + "/notes.txt", "precious");
  CHECK_THROWS_WITH(begin_save(dir, kManifestName, false, {}),
                    Contains("refusing to replace") && Contains(dir));
  CHECK(flatshard_test::read_bytes(dir + "/notes.txt") == "precious");
  // An interrupted two-rename publication left only flatshard's marked, complete backup:
  // loads do not use it; recover_interrupted_save() and the next save restore it.
  const std::string ckpt = tmp / "ckpt";
  const std::string backup = ckpt + kBackupInfix + "0123456789abcdef";
  make_dirs(backup);
  flatshard_test::write_bytes(backup + "/" + kManifestName, "{}");
  CHECK_THROWS_WITH(recover_interrupted_save(ckpt, kManifestName), Contains("no complete"));
  flatshard_test::write_bytes(backup + "/" + kMarkerName, "flatshard checkpoint directory\n");
  CHECK(describe_side_dirs(ckpt, kManifestName).find("recover_checkpoint") != std::string::npos);
  const std::string s2 = begin_save(ckpt, kManifestName, false, {});
  CHECK(path_exists(ckpt + "/" + kManifestName));
  CHECK(!path_exists(backup));
  CHECK(is_directory(s2));
  CHECK(recover_interrupted_save(ckpt, kManifestName) == false);  // nothing to recover
}

TEST_CASE("check_plain_name refuses paths", "[checkpoint][format][trust]") {
  for (const std::string& bad : std::vector<std::string>{"", ".", "..", "../x", "a/b",
                                                         "/etc/passwd", std::string("a\0b", 3)})
    CHECK_THROWS_WITH(check_plain_name(bad, "entry"), Contains("not a plain name"));
  check_plain_name("shard-00000-of-00002.safetensors", "entry");
  check_plain_name("..x", "entry");  // a name, not a parent
}
