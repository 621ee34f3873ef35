// support/json.h against RFC 8259 and the promises it adds to nlohmann's parser: duplicate keys
// refused, a depth limit, exact 64-bit integers, errors that name the text and the key (a JSON
// Pointer). Expected values are written out by hand (decoded strings as bytes, integers as
// C++ literals, byte positions counted in the input), not produced by the code under test.
#include <c10/util/Exception.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "support/input_file.h"
#include "support/json.h"
#include "temp_dir.h"

using namespace flatshard;
using Catch::Contains;

namespace {

// The message of the c10::Error `f` throws (without the stack trace what() adds), for exact
// comparisons.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.msg();
  }
  return "(no error)";
}

// Parses `text` and returns its root, kept alive in `keep`.
json::Node root(json::Json& keep, const std::string& text, const std::string& what = "t") {
  keep = json::parse(text, what);
  return json::Node(keep, what);
}

}  // namespace

TEST_CASE("json: values, escapes, typed access with the key in every error", "[support][json]") {
  json::Json doc;
  const json::Node j =
      root(doc,
           R"({"a": [1, -2, 3.5e2, true, false, null], "s": "q\"\\\/\n\u00e9\ud83d\ude00", )"
           R"("big": 9007199254740993, "o": {}})",
           "test");
  const auto a = j.at("a").items();
  REQUIRE(a.size() == 6);
  CHECK(a[1].as_int() == -2);
  CHECK(a[2].as_number() == 350.0);
  CHECK(a[3].as_bool());
  CHECK(!a[4].as_bool());
  CHECK(a[5].is_null());
  CHECK(j.at("s").as_string() == "q\"\\/\n\xc3\xa9\xf0\x9f\x98\x80");
  CHECK(j.at("big").as_int() == 9007199254740993LL);  // not representable as a double
  CHECK(j.at("o").members().empty());
  CHECK(!j.find("missing").has_value());
  CHECK(j.find("s")->as_string().size() == 11);
  CHECK_THROWS_WITH(j.at("missing"), Contains("test: missing key 'missing'"));
  CHECK_THROWS_WITH(a[2].as_int(), Contains("test: /a/2: expected an integer, got 350.0"));
  CHECK_THROWS_WITH(j.at("s").items(), Contains("test: /s: expected an array, got a string"));
  CHECK_THROWS_WITH(j.at("a").at("x"),
                    Contains("/a: expected an object with key 'x', got an array"));
  CHECK_THROWS_WITH(a[3].as_string(), Contains("/a/3: expected a string, got true"));
  CHECK_THROWS_WITH(a[5].as_number(), Contains("/a/5: expected a number, got null"));
  CHECK_THROWS_WITH(j.at("o").as_bool(), Contains("/o: expected a boolean, got an object"));
  // Without a name the messages start at the pointer; at the root, with "JSON".
  json::Json plain = json::parse("[7]");
  CHECK_THROWS_WITH(json::Node(plain, "").at("k"), Catch::StartsWith("JSON: expected an object"));
  CHECK_THROWS_WITH(json::Node(plain, "").items()[0].as_string(), Catch::StartsWith("/0: "));
  // fail(): a caller's own check, with the same prefix.
  CHECK(error_of([&] { j.at("big").fail("too big"); }) == "test: /big: too big");
}

TEST_CASE("json: a wrong-typed field names the file and the key", "[support][json]") {
  json::Json doc;
  const json::Node j = root(doc, R"({"files": [{"name": "a", "bytes": 1.5}], "a/b~c": {"d": "x"}})",
                            "dir/manifest.json");
  const json::Node f = j.at("files").items()[0];
  CHECK(f.pointer() == "/files/0");
  CHECK(error_of([&] { f.at("bytes").as_int(); }) ==
        "dir/manifest.json: /files/0/bytes: expected an integer, got 1.5");
  // RFC 6901 escapes '/' as ~1 and '~' as ~0, so the pointer is unambiguous.
  CHECK(error_of([&] { j.at("a/b~c").at("d").as_int(); }) ==
        "dir/manifest.json: /a~1b~0c/d: expected an integer, got a string");
  CHECK(j.at("a/b~c").where() == "dir/manifest.json: /a~1b~0c");
}

TEST_CASE("json: 64-bit integers stay exact, at both ends of int64", "[support][json]") {
  json::Json doc;
  const auto a = root(doc,
                      "[9223372036854775807, -9223372036854775808, 0, -0, 1e2, 1.0, "
                      "9007199254740993, 18446744073709551615]")
                     .items();
  CHECK(a[0].as_int() == std::numeric_limits<int64_t>::max());
  CHECK(a[1].as_int() == std::numeric_limits<int64_t>::min());
  CHECK(a[2].as_int() == 0);
  CHECK(a[3].as_int() == 0);
  CHECK(a[6].as_int() == (int64_t{1} << 53) + 1);
  // A float where an integer is expected is an error, even when its value is integral.
  CHECK_THROWS_WITH(a[4].as_int(), Contains("/4: expected an integer, got 100.0"));
  CHECK_THROWS_WITH(a[5].as_int(), Contains("/5: expected an integer, got 1.0"));
  CHECK(a[4].as_number() == 100.0);
  // Beyond int64 (but within uint64): kept exactly, refused by as_int.
  CHECK_THROWS_WITH(a[7].as_int(), Contains("integer 18446744073709551615 does not fit in int64"));
  CHECK(a[7].json().get<uint64_t>() == std::numeric_limits<uint64_t>::max());
  json::Json other;  // `a` refers to doc
  CHECK_THROWS_WITH(root(other, "9223372036854775808").as_int(), Contains("does not fit in int64"));
  // Beyond 64 bits altogether: nlohmann would round to a double; the parse refuses it.
  CHECK_THROWS_WITH(json::parse("[1, 18446744073709551616]", "m"),
                    Contains("m: invalid JSON: integer 18446744073709551616 does not fit in 64 "
                             "bits, at /1"));
  CHECK_THROWS_WITH(json::parse(R"({"o": -9223372036854775809})"),
                    Contains("integer -9223372036854775809 does not fit in 64 bits, at /o"));
  CHECK_THROWS_WITH(root(other, "\"7\"").as_int(), Contains("expected an integer, got a string"));
  // Offsets up to 2^63-1 round-trip through the writers the formats use (std::to_string for
  // integers, as the safetensors header and the manifest write them).
  for (const int64_t v : {std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(),
                          (int64_t{1} << 53) + 1, int64_t{-1}}) {
    CAPTURE(v);
    CHECK(root(other, "[" + std::to_string(v) + "]").items()[0].as_int() == v);
  }
  // Equal doubles, different integers.
  CHECK(json::parse("9007199254740993") != json::parse("9007199254740992"));
}

TEST_CASE("json: strict RFC 8259, byte positions", "[support][json]") {
  for (const char* bad :
       {"",         " ",       "{",   "[1,]",     "{\"a\":1,}",  "01",          "[01]",
        "1.",       ".5",      "-",   "+1",       "1e",          "nul",         "\"\\x\"",
        "\"\x01\"", "[1] 2",   "NaN", "Infinity", "\"\\ud83d\"", "\"\\udc00\"", "{a:1}",
        "[1 2]",    "// c\n1", "'a'", "\"\xff\"", "\"abc",       "[1] x",       "\"\\ud800\""}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(json::parse(bad), c10::Error);
  }
  // Byte B counts from 0 (the offending byte), line and column from 1.
  CHECK_THROWS_WITH(json::parse("[1,\n  x]", "f"),
                    Contains("f: invalid JSON at byte 6 (line 2, column 3)"));
  CHECK_THROWS_WITH(json::parse("[1,\n  x]"), Catch::StartsWith("invalid JSON at byte 6"));
  CHECK_THROWS_WITH(json::parse("{\"a\": 1,}", "f.json"), Contains("f.json") && Contains("byte 8"));
  CHECK_THROWS_WITH(json::parse("\"abc", "t"), Contains("missing closing quote"));
  CHECK_THROWS_WITH(json::parse("\"\\ud800\"", "t"), Contains("surrogate"));
  CHECK_THROWS_WITH(json::parse("01", "t"), Contains("expected end of input"));
  CHECK_THROWS_WITH(json::parse("\"\xff\"", "t"), Contains("UTF-8"));
  // Objects keep document order.
  json::Json doc;
  const auto m = root(doc, R"({"b": 1, "a": 2, "c": 3})").members();
  REQUIRE(m.size() == 3);
  CHECK((m[0].first == "b" && m[1].first == "a" && m[2].first == "c"));
  CHECK(m[1].second.as_int() == 2);
  CHECK(m[1].second.pointer() == "/a");
}

TEST_CASE("json: nesting deeper than 64 containers is refused", "[support][json]") {
  CHECK_NOTHROW(json::parse(std::string(64, '[') + std::string(64, ']')));
  CHECK_THROWS_WITH(json::parse(std::string(65, '[') + std::string(65, ']'), "deep.json"),
                    Contains("deep.json: invalid JSON: nesting deeper than 64 levels"));
  // Objects count alike; the error says where.
  std::string objects;
  for (int i = 0; i < 65; ++i) objects += "{\"k\":";
  objects += "1" + std::string(65, '}');
  CHECK_THROWS_WITH(json::parse(objects), Contains("deeper than 64") && Contains("at /k/k/k"));
  std::string mixed;  // 64 levels: an object holding arrays
  mixed = "{\"a\":" + std::string(63, '[') + std::string(63, ']') + "}";
  CHECK_NOTHROW(json::parse(mixed));
  // Far deeper input fails the same way, without recursing that deep.
  CHECK_THROWS_WITH(json::parse(std::string(100000, '[')), Contains("deeper than 64"));
}

TEST_CASE("json: duplicate keys are an error naming the key", "[support][json]") {
  CHECK(error_of([] { json::parse(R"({"k": 1, "k": 2})", "m.json"); }) ==
        "m.json: invalid JSON: duplicate key 'k' in the object at the top level");
  CHECK_THROWS_WITH(
      json::parse(R"({"files": [{"name": "a"}, {"name": "b", "bytes": 1, "bytes": 2}]})", "m.json"),
      Contains("duplicate key 'bytes' in the object at /files/1"));
  // Keys compare after unescaping: "\u006b" is "k".
  CHECK_THROWS_WITH(json::parse(R"({"o": {"k": 1, "\u006b": 2}})"),
                    Contains("duplicate key 'k' in the object at /o"));
  // The same key in different objects is fine, and so are keys that differ only in case.
  CHECK_NOTHROW(json::parse(R"({"a": {"k": 1}, "b": [{"k": 2}, {"k": 3}], "k": 4, "K": 5})"));
  // Objects past the scanned size are checked through their key index (grown several times
  // here): every duplicate is found, wherever it sits, and nested pointers still name the key.
  std::string big = "{";
  for (int i = 0; i < 5000; ++i) big += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":" + std::to_string(i);
  CHECK_NOTHROW(json::parse(big + "}"));
  for (const int dup : {0, 7, 8, 9, 63, 64, 4999}) {
    CAPTURE(dup);
    CHECK(error_of([&] { json::parse(big + ",\"k" + std::to_string(dup) + "\":1}", "m.json"); }) ==
          "m.json: invalid JSON: duplicate key 'k" + std::to_string(dup) +
              "' in the object at the top level");
  }
  CHECK_THROWS_WITH(json::parse("{\"a/b\": [0, " + big + ",\"k17\":1}]}"),
                    Contains("duplicate key 'k17' in the object at /a~1b/1"));
  CHECK_THROWS_WITH(json::parse(big + ",\"z\": {\"y\": 99999999999999999999999}}"),
                    Contains("does not fit in 64 bits, at /z/y"));
}

TEST_CASE("json: a Node's pointer is found in the document when asked", "[support][json]") {
  // Nodes carry no pointer string (support/json.h): where() searches the document, and says
  // the same as a pointer built on the way down did.
  std::string text = "{\"files\": [";
  for (int i = 0; i < 1000; ++i)
    text += (i ? ",{" : "{") + std::string("\"name\": \"f") + std::to_string(i) + "\", \"bytes\": 1}";
  text += "], \"a/b~c\": {\"x\": [true, \"s\"]}}";
  const json::Json doc = json::parse(text);
  const json::Node root(doc, "m.json");
  CHECK(root.pointer().empty());
  CHECK(root.where() == "m.json");
  const auto files = root.at("files").items();
  CHECK(files[999].at("bytes").pointer() == "/files/999/bytes");
  CHECK(error_of([&] { files[998].at("name").as_int(); }) ==
        "m.json: /files/998/name: expected an integer, got a string");
  const auto x = root.at("a/b~c").at("x").items();
  CHECK(x[1].where() == "m.json: /a~1b~0c/x/1");
  const auto members = root.member_views();
  REQUIRE(members.size() == 2);
  CHECK(members[1].first == "a/b~c");
  CHECK(members[1].second.pointer() == "/a~1b~0c");
  CHECK(json::Node(doc, "").at("files").where() == "/files");
}

TEST_CASE("json: files (read_json_file); errors name the path", "[support][json]") {
  flatshard_test::TempDir tmp;
  auto read = [&](const std::string& name) {
    return flatshard::read_json_file(tmp / name, 1 << 20, "test file");
  };
  flatshard_test::write_bytes(tmp / "bad.json", "{\"a\": tru}");
  CHECK_THROWS_WITH(read("bad.json"),
                    Contains("bad.json") && Contains("invalid JSON at byte 9") &&
                        Contains("invalid literal"));
  CHECK_THROWS_WITH(read("none.json"), Contains("cannot open") && Contains("none.json"));
  flatshard_test::write_bytes(tmp / "ok.json", "{\"n\": [1, 2]}\n");
  CHECK(read("ok.json").at("n").size() == 2);
}

TEST_CASE("json writers: quote() and number() read back the same", "[support][json]") {
  CHECK(json::quote("plain") == "\"plain\"");
  CHECK(json::quote("a\"b\\c\n") == "\"a\\\"b\\\\c\\n\"");
  CHECK(json::quote(std::string("\x01", 1)) == "\"\\u0001\"");
  CHECK(json::quote("\xc3\xa9") == "\"\xc3\xa9\"");  // UTF-8 passes through
  const std::string odd = "a\"b\\c\n\x01/\xc3\xa9\t\r\b\f";
  json::Json doc;
  CHECK(root(doc, json::quote(odd)).as_string() == odd);
  CHECK_THROWS_WITH(json::quote("\xff"), Contains("cannot write the string"));
  // Shortest round-trip decimals, as a person would write them.
  CHECK(json::number(0.9) == "0.9");
  CHECK(json::number(0.001) == "0.001");
  CHECK(json::number(1e-08) == "1e-08");
  for (const double d : {0.1, 1.0 / 3, 1e300, -2.5e-300, 0.0, 123456789.0}) {
    CAPTURE(d);
    CHECK(root(doc, "[" + json::number(d) + "]").items()[0].as_number() == d);
  }
  CHECK_THROWS_WITH(json::number(std::nan("")), Contains("JSON has no NaN or infinity"));
  CHECK_THROWS(json::number(std::numeric_limits<double>::infinity()));
}
