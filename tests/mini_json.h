// A minimal JSON reader for tests (no JSON library is available): objects, arrays, strings with
// the standard escapes (\uXXXX kept as UTF-8 for the BMP), numbers, true/false/null. Throws
// std::runtime_error with the byte offset on malformed input, and on a missing key or a type
// mismatch naming the key, so a failing test says what was wrong with the document.
#pragma once

#include <cstdlib>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace mini_json {

struct Value {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<Value> array;
  std::map<std::string, Value> object;

  bool is_null() const { return type == Type::kNull; }
  bool has(const std::string& key) const { return object.count(key) > 0; }
  const Value& at(const std::string& key) const {
    if (type != Type::kObject) throw std::runtime_error("'" + key + "': parent is not an object");
    auto it = object.find(key);
    if (it == object.end()) throw std::runtime_error("missing key '" + key + "'");
    return it->second;
  }
  double num(const std::string& key) const {
    const Value& v = at(key);
    if (v.type != Type::kNumber) throw std::runtime_error("'" + key + "' is not a number");
    return v.number;
  }
  const std::string& str(const std::string& key) const {
    const Value& v = at(key);
    if (v.type != Type::kString) throw std::runtime_error("'" + key + "' is not a string");
    return v.string;
  }
};

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}

  Value parse() {
    Value v = value();
    ws();
    if (i_ != s_.size()) fail("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("JSON: " + what + " at offset " + std::to_string(i_));
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t'))
      ++i_;
  }
  bool eat(char c) {
    ws();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  bool word(const char* w) {
    const std::string ws_(w);
    if (s_.compare(i_, ws_.size(), ws_) != 0) return false;
    i_ += ws_.size();
    return true;
  }

  Value value() {
    ws();
    if (i_ >= s_.size()) fail("unexpected end");
    Value v;
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      v.type = Value::Type::kObject;
      if (eat('}')) return v;
      do {
        ws();
        std::string key = string();
        expect(':');
        v.object[key] = value();
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      ++i_;
      v.type = Value::Type::kArray;
      if (eat(']')) return v;
      do v.array.push_back(value());
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.type = Value::Type::kString;
      v.string = string();
    } else if (word("true")) {
      v.type = Value::Type::kBool;
      v.boolean = true;
    } else if (word("false")) {
      v.type = Value::Type::kBool;
    } else if (word("null")) {
      v.type = Value::Type::kNull;
    } else {
      const char* begin = s_.c_str() + i_;
      char* end = nullptr;
      v.number = std::strtod(begin, &end);
      if (end == begin) fail("unexpected character");
      i_ += static_cast<size_t>(end - begin);
      v.type = Value::Type::kNumber;
    }
    return v;
  }

  std::string string() {
    if (i_ >= s_.size() || s_[i_] != '"') fail("expected a string");
    ++i_;
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (static_cast<unsigned char>(c) < 0x20) fail("raw control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      c = s_[i_++];
      switch (c) {
        case '"': case '\\': case '/': out += c; break;
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          if (i_ + 4 > s_.size()) fail("short \\u escape");
          const unsigned cp = static_cast<unsigned>(std::stoul(s_.substr(i_, 4), nullptr, 16));
          i_ += 4;
          if (cp < 0x80) {
            out += static_cast<char>(cp);
          } else if (cp < 0x800) {
            out += static_cast<char>(0xC0 | (cp >> 6));
            out += static_cast<char>(0x80 | (cp & 0x3F));
          } else {
            out += static_cast<char>(0xE0 | (cp >> 12));
            out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (cp & 0x3F));
          }
          break;
        }
        default: fail(std::string("bad escape \\") + c);
      }
    }
    if (i_ >= s_.size()) fail("unterminated string");
    ++i_;
    return out;
  }

  const std::string& s_;
  size_t i_ = 0;
};

inline Value parse(const std::string& text) { return Parser(text).parse(); }

}  // namespace mini_json
