// flatshard/tools/json.h — a small, strict JSON reader and writer (RFC 8259) for the diagnostics
// tools and their tests. Written independently of the trace writer (fsdp/trace.cpp) so that a
// test reading a trace with it checks the writer rather than agreeing with it.
//
// Contract
// - parse() accepts exactly RFC 8259 JSON: one value, surrounded by optional whitespace; no
//   comments, no trailing commas, no NaN/Infinity, no leading zeros, no control characters in
//   strings; \u escapes (surrogate pairs included) become UTF-8. Nesting deeper than 256 levels
//   is rejected (no stack overflow on hostile input).
// - Errors throw c10::Error: "json: <what> at line L, column C".
// - Objects keep their members in document order; duplicate keys are kept, find() returns the
//   first.
// - write() emits compact JSON that parse() reads back to an equal value (numbers with 17
//   significant digits, so doubles round-trip).
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
  static Value string(std::string s);
  static Value array(Array a);
  static Value object(Object o);

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_number() const { return type_ == Type::kNumber; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }

  // Typed access; each throws c10::Error naming the expected and actual type.
  bool as_bool() const;
  double as_number() const;
  const std::string& as_string() const;
  const Array& as_array() const;
  Array& as_array();
  const Object& as_object() const;

  // Object member or nullptr (also for non-objects).
  const Value* find(const std::string& key) const;
  // Member that must exist; throws naming the key.
  const Value& at(const std::string& key) const;
  // Member if present with the right type, else `fallback`.
  double number_or(const std::string& key, double fallback) const;
  std::string string_or(const std::string& key, const std::string& fallback) const;

  bool operator==(const Value& o) const;
  bool operator!=(const Value& o) const { return !(*this == o); }

 private:
  Type type_ = Type::kNull;
  bool bool_ = false;
  double number_ = 0;
  std::string string_;
  Array array_;
  Object object_;
};

const char* to_string(Value::Type t);

Value parse(std::string_view text);
// Reads and parses a file; errors name the path.
Value parse_file(const std::string& path);
void write(std::ostream& os, const Value& v);
std::string write(const Value& v);

}  // namespace json
}  // namespace flatshard
