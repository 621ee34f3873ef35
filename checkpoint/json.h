// flatshard/checkpoint/json.h — flatshard's one JSON module: a small, strict reader (RFC 8259),
// a value type with builders, and a compact writer. The checkpoint reads its manifests and
// safetensors headers with it; the diagnostics tools (tools/trace_summary, flatshard-trace) and
// the trace and bench tests read traces and benchmark output with it.
//
// Contract
// - parse() accepts exactly RFC 8259 JSON: one value, surrounded by optional whitespace; no
//   comments, no trailing commas, no NaN/Infinity, no leading '+', no leading zeros ("01" is the
//   number 0 followed by stray text), no control characters in strings; \u escapes (surrogate
//   pairs included) become UTF-8, unpaired surrogates are refused; other bytes pass through
//   unchecked. Nesting deeper than 64 levels is rejected (the smaller of the two limits the
//   readers this one replaced had: no stack overflow on hostile input, and far more than any
//   format we read needs).
// - Parse errors throw c10::Error "<what>: invalid JSON at byte B (line L, column C): <why>"
//   (`what` names the text, e.g. its file; without one the message starts at "invalid JSON";
//   columns count bytes). Accessor errors throw "JSON: expected an array, got a string",
//   "JSON: missing key 'name'"; callers add the context (file, entry) around them.
// - Objects keep their members in document order. Duplicate keys are kept as they are: find()
//   and at() return the first, as_object() shows all.
// - Numbers keep their literal text: as_int() is exact for every integer literal that fits
//   int64_t (safetensors byte offsets beyond 2^53 included) and refuses fractions, exponents
//   and out-of-range values; as_number() is the nearest double. Numbers built with
//   Value::integer() are exact the same way; Value::number() holds a double.
// - write() emits compact JSON that parse() reads back to an equal value: parsed numbers as
//   their literal text, built doubles with 17 significant digits (they round-trip); non-finite
//   doubles throw. quote() is the string escaping it uses, for writers that lay out their JSON
//   by hand (the manifest and safetensors headers have a fixed, human-readable layout).
// - fsdp/trace.cpp writes its trace JSON by hand on purpose, not with write(): the tests that
//   read traces with this reader then check that writer independently instead of agreeing with
//   it. Keep it that way.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace flatshard {
namespace json {

class Value {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  using Array = std::vector<Value>;
  using Object = std::vector<std::pair<std::string, Value>>;

  Value() = default;  // null
  static Value boolean(bool b);
  static Value number(double d);
  static Value integer(int64_t i);  // exact, unlike number() beyond 2^53
  static Value string(std::string s);
  static Value array(Array a);
  static Value object(Object o);

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_bool() const { return type_ == Type::kBool; }
  bool is_number() const { return type_ == Type::kNumber; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }

  // Typed access; each throws c10::Error naming the expected and actual type.
  bool as_bool() const;
  double as_number() const;  // any number, nearest double
  int64_t as_int() const;    // an integer number, exact (see the contract)
  const std::string& as_string() const;
  const Array& as_array() const;
  Array& as_array();
  const Object& as_object() const;

  // Object member or nullptr (also for non-objects).
  const Value* find(const std::string& key) const;
  // Member that must exist; throws naming the key (or the type, for non-objects).
  const Value& at(const std::string& key) const;
  // Member if present with the right type, else `fallback`.
  double number_or(const std::string& key, double fallback) const;
  std::string string_or(const std::string& key, const std::string& fallback) const;

  // Same type and value; numbers compare by value (1, 1.0 and 1e0 are equal), integers exactly.
  bool operator==(const Value& o) const;
  bool operator!=(const Value& o) const { return !(*this == o); }

 private:
  friend class Parser;
  friend void write(std::ostream& os, const Value& v);
  bool exact_int(int64_t* out) const;

  Type type_ = Type::kNull;
  bool bool_ = false;
  double number_ = 0;
  std::string string_;  // a string's value, or a number's literal text (empty from number())
  Array array_;
  Object object_;
};

// `what` names the text in error messages (e.g. the file it came from); may be empty.
Value parse(std::string_view text, const std::string& what = {});
// Reads and parses a file; errors name the path.
Value parse_file(const std::string& path);
void write(std::ostream& os, const Value& v);
std::string write(const Value& v);
// `s` as a JSON string literal, quotes included: escapes ", \ and control characters; other
// bytes, UTF-8 included, pass through.
std::string quote(std::string_view s);

}  // namespace json
}  // namespace flatshard
