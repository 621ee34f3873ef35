// The checkpoint's building blocks against independent references: CRC-32 check values (the
// ones zlib and the IEEE standard publish), JSON per RFC 8259 (checkpoint/json.h, which the
// diagnostics tools share), safetensors per its spec.
#include <ATen/ATen.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>

#include "checkpoint/crc32.h"
#include "checkpoint/file_io.h"
#include "checkpoint/json.h"
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
}

TEST_CASE("json reader: values, escapes, exact integers, errors with positions",
          "[checkpoint][format][json]") {
  const json::Value j =
      json::parse(R"({"a": [1, -2, 3.5e2, true, false, null], "s": "q\"\\\/\n\u00e9\ud83d\ude00", )"
                  R"("big": 9007199254740993, "o": {}})",
                  "test");
  REQUIRE(j.at("a").as_array().size() == 6);
  CHECK(j.at("a").as_array()[1].as_int() == -2);
  CHECK(j.at("a").as_array()[2].as_number() == 350.0);
  CHECK(j.at("a").as_array()[3].as_bool());
  CHECK(j.at("a").as_array()[5].is_null());
  CHECK(j.at("s").as_string() == "q\"\\/\n\xc3\xa9\xf0\x9f\x98\x80");
  CHECK(j.at("big").as_int() == 9007199254740993LL);  // not representable as a double
  CHECK(j.at("o").as_object().empty());
  CHECK(j.find("missing") == nullptr);
  CHECK_THROWS_WITH(j.at("missing"), Contains("missing key 'missing'"));
  CHECK_THROWS_WITH(j.at("a").as_array()[2].as_int(), Contains("expected an integer"));
  CHECK_THROWS_WITH(j.at("s").as_array(), Contains("expected an array, got a string"));
  CHECK_THROWS_WITH(json::parse("{\"a\": 1,}", "f.json"), Contains("f.json") && Contains("byte 8"));
  CHECK_THROWS_WITH(json::parse("[1] x", "t"), Contains("after the JSON value"));
  CHECK_THROWS_WITH(json::parse("\"abc", "t"), Contains("unterminated string"));
  CHECK_THROWS_WITH(json::parse("\"\\ud800\"", "t"), Contains("surrogate"));
  CHECK_THROWS_WITH(json::parse(std::string(100, '['), "t"), Contains("deeper than 64"));
  CHECK_THROWS_WITH(json::parse("01", "t"), Contains("after the JSON value"));
  const std::string odd = "a\"b\\c\n\x01/\xc3\xa9";
  CHECK(json::parse(json::quote(odd), "t").as_string() == odd);
}

TEST_CASE("json reader: 64-bit integers stay exact, through the writer too",
          "[checkpoint][format][json]") {
  const json::Value v = json::parse("[9223372036854775807, -9223372036854775808, 0, -0, 1e2, 1.0]");
  const auto& a = v.as_array();
  CHECK(a[0].as_int() == INT64_MAX);
  CHECK(a[1].as_int() == INT64_MIN);
  CHECK(a[2].as_int() == 0);
  CHECK(a[3].as_int() == 0);
  CHECK_THROWS_WITH(a[4].as_int(), Contains("expected an integer, got 1e2"));
  CHECK_THROWS_WITH(a[5].as_int(), Contains("expected an integer, got 1.0"));
  CHECK(a[4] == json::Value::number(100));  // numbers compare by value
  CHECK_THROWS_WITH(json::parse("9223372036854775808").as_int(), Contains("does not fit in 64"));
  CHECK_THROWS_WITH(json::parse("\"7\"").as_int(), Contains("expected an integer, got a string"));
  // Parsed and built integers write back their exact text.
  CHECK(json::write(v) == "[9223372036854775807,-9223372036854775808,0,-0,1e2,1.0]");
  const json::Value big = json::Value::integer((int64_t{1} << 53) + 1);
  CHECK(json::write(big) == "9007199254740993");
  CHECK(json::parse(json::write(big)).as_int() == (int64_t{1} << 53) + 1);
  CHECK(json::Value::number(12).as_int() == 12);
  CHECK_THROWS_WITH(json::Value::number(0.5).as_int(), Contains("expected an integer"));
  // Equal doubles, different integers.
  CHECK(json::parse("9007199254740993") != json::parse("9007199254740992"));
  CHECK(json::parse("9007199254740993") == big);
}

TEST_CASE("json reader: strict RFC 8259, positions, depth, duplicate keys",
          "[checkpoint][format][json]") {
  const auto v =
      json::parse(R"( {"a": [1, -2.5e3, true, false, null], "s": "q\"\\\/\n\u00e9\ud83d\ude00"} )");
  CHECK(v.at("a").as_array().size() == 5);
  CHECK(v.at("a").as_array()[1].as_number() == -2500);
  CHECK(v.at("s").as_string() == "q\"\\/\n\xc3\xa9\xf0\x9f\x98\x80");
  CHECK(json::parse(json::write(v)) == v);
  CHECK(json::parse(json::write(json::Value::number(0.1))).as_number() == 0.1);
  CHECK_THROWS(json::write(json::Value::number(std::nan(""))));
  for (const char* bad :
       {"",         " ",       "{",   "[1,]",     "{\"a\":1,}",  "01",          "[01]",
        "1.",       ".5",      "-",   "+1",       "1e",          "nul",         "\"\\x\"",
        "\"\x01\"", "[1] 2",   "NaN", "Infinity", "\"\\ud83d\"", "\"\\udc00\"", "{a:1}",
        "[1 2]",    "// c\n1", "'a'"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(json::parse(bad), c10::Error);
  }
  CHECK_THROWS_WITH(json::parse("[1,\n  x]", "f"),
                    Contains("f: invalid JSON at byte 6 (line 2, column 3)"));
  CHECK_THROWS_WITH(json::parse("[1,\n  x]"), Catch::StartsWith("invalid JSON at byte 6"));
  // Depth: 64 nested containers are fine, 65 are not.
  CHECK_NOTHROW(json::parse(std::string(64, '[') + std::string(64, ']')));
  CHECK_THROWS_WITH(json::parse(std::string(65, '[') + std::string(65, ']')),
                    Contains("deeper than 64"));
  CHECK_THROWS(json::parse(std::string(300, '[') + std::string(300, ']')));
  // Duplicate keys are kept; lookups see the first.
  const auto d = json::parse(R"({"k": 1, "k": 2})");
  CHECK(d.as_object().size() == 2);
  CHECK(d.at("k").as_int() == 1);
  // Files: errors name the path.
  flatshard_test::TempDir tmp;
  flatshard_test::write_bytes(tmp / "bad.json", "{\"a\": tru}");
  CHECK_THROWS_WITH(json::parse_file(tmp / "bad.json"),
                    Contains("bad.json: invalid JSON at byte 6") && Contains("expected 'true'"));
  CHECK_THROWS_WITH(json::parse_file(tmp / "none.json"),
                    Contains("cannot open") && Contains("none.json"));
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
}

TEST_CASE("a save never replaces a directory that is not a checkpoint", "[checkpoint][format]") {
  flatshard_test::TempDir tmp;
  const std::string dir = tmp / "mine";
  make_dirs(dir);
  begin_save(dir, kManifestName, false);  // empty: fine
  abandon_save(dir);
  CHECK(!path_exists(staging_dir(dir)));
  flatshard_test::write_bytes(dir + "/notes.txt", "precious");
  CHECK_THROWS_WITH(begin_save(dir, kManifestName, false),
                    Contains("refusing to replace") && Contains(dir));
  CHECK(flatshard_test::read_bytes(dir + "/notes.txt") == "precious");
  // An interrupted two-rename publication left only <dir>.old: loads find it, saves restore it.
  const std::string ckpt = tmp / "ckpt";
  make_dirs(retired_dir(ckpt));
  flatshard_test::write_bytes(retired_dir(ckpt) + "/" + kManifestName, "{}");
  CHECK(resolve_checkpoint_dir(ckpt, kManifestName) == retired_dir(ckpt));
  begin_save(ckpt, kManifestName, false);
  CHECK(path_exists(ckpt + "/" + kManifestName));
  CHECK(!path_exists(retired_dir(ckpt)));
  CHECK(is_directory(staging_dir(ckpt)));
}
