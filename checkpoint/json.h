// flatshard/checkpoint/json.h — the little JSON a checkpoint needs: a strict reader and quoting.
//
// Reads RFC 8259 JSON (objects keep their key order; numbers keep their text, so 64-bit byte
// offsets stay exact) and nothing else: no comments, no trailing commas, nesting depth <= 64.
// Errors throw c10::Error with the byte offset; the accessors throw naming the key or the
// expected type. Writers build JSON text by hand with json_quote(): the two formats we write
// (safetensors headers, manifests) are flat enough that a builder would be more code, not less.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace flatshard {

class Json {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

  // `what` names the text in error messages (e.g. the file it came from).
  static Json parse(const std::string& text, const std::string& what);

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_object() const { return type_ == Type::kObject; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_string() const { return type_ == Type::kString; }

  const std::string& str() const;  // a string
  int64_t as_int() const;          // an integer number (no fraction, no exponent)
  double as_double() const;        // any number
  bool as_bool() const;            // true / false
  const std::vector<Json>& array() const;
  const std::vector<std::pair<std::string, Json>>& object() const;
  // Object members: find() returns nullptr when absent; at() throws naming the key.
  const Json* find(const std::string& key) const;
  const Json& at(const std::string& key) const;

 private:
  friend class JsonParser;
  Type type_ = Type::kNull;
  bool bool_ = false;
  std::string text_;  // string value, or a number's literal text
  std::vector<Json> items_;
  std::vector<std::pair<std::string, Json>> members_;
};

// `s` as a JSON string literal, quotes included (escapes ", \ and control characters; other
// bytes, UTF-8 included, pass through).
std::string json_quote(const std::string& s);

}  // namespace flatshard
