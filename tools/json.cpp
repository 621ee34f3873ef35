// flatshard/tools/json.cpp — see json.h.
#include "tools/json.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace flatshard {
namespace json {

Value Value::boolean(bool b) {
  Value v;
  v.type_ = Type::kBool;
  v.bool_ = b;
  return v;
}
Value Value::number(double d) {
  Value v;
  v.type_ = Type::kNumber;
  v.number_ = d;
  return v;
}
Value Value::string(std::string s) {
  Value v;
  v.type_ = Type::kString;
  v.string_ = std::move(s);
  return v;
}
Value Value::array(Array a) {
  Value v;
  v.type_ = Type::kArray;
  v.array_ = std::move(a);
  return v;
}
Value Value::object(Object o) {
  Value v;
  v.type_ = Type::kObject;
  v.object_ = std::move(o);
  return v;
}

const char* to_string(Value::Type t) {
  switch (t) {
    case Value::Type::kNull:
      return "null";
    case Value::Type::kBool:
      return "bool";
    case Value::Type::kNumber:
      return "number";
    case Value::Type::kString:
      return "string";
    case Value::Type::kArray:
      return "array";
    case Value::Type::kObject:
      return "object";
  }
  return "?";
}

#define FLATSHARD_JSON_EXPECT(want) \
  TORCH_CHECK(type_ == want, "json: expected ", to_string(want), ", got ", to_string(type_))

bool Value::as_bool() const {
  FLATSHARD_JSON_EXPECT(Type::kBool);
  return bool_;
}
double Value::as_number() const {
  FLATSHARD_JSON_EXPECT(Type::kNumber);
  return number_;
}
const std::string& Value::as_string() const {
  FLATSHARD_JSON_EXPECT(Type::kString);
  return string_;
}
const Value::Array& Value::as_array() const {
  FLATSHARD_JSON_EXPECT(Type::kArray);
  return array_;
}
Value::Array& Value::as_array() {
  FLATSHARD_JSON_EXPECT(Type::kArray);
  return array_;
}
const Value::Object& Value::as_object() const {
  FLATSHARD_JSON_EXPECT(Type::kObject);
  return object_;
}
#undef FLATSHARD_JSON_EXPECT

const Value* Value::find(const std::string& key) const {
  if (type_ != Type::kObject) return nullptr;
  for (const auto& [k, v] : object_)
    if (k == key) return &v;
  return nullptr;
}

const Value& Value::at(const std::string& key) const {
  const Value* v = find(key);
  TORCH_CHECK(v != nullptr, "json: missing member '", key, "'");
  return *v;
}

double Value::number_or(const std::string& key, double fallback) const {
  const Value* v = find(key);
  return v && v->is_number() ? v->number_ : fallback;
}

std::string Value::string_or(const std::string& key, const std::string& fallback) const {
  const Value* v = find(key);
  return v && v->is_string() ? v->string_ : fallback;
}

bool Value::operator==(const Value& o) const {
  if (type_ != o.type_) return false;
  switch (type_) {
    case Type::kNull:
      return true;
    case Type::kBool:
      return bool_ == o.bool_;
    case Type::kNumber:
      return number_ == o.number_;
    case Type::kString:
      return string_ == o.string_;
    case Type::kArray:
      return array_ == o.array_;
    case Type::kObject:
      return object_ == o.object_;
  }
  return false;
}

namespace {

constexpr int kMaxDepth = 256;

class Parser {
 public:
  explicit Parser(std::string_view text) : s_(text) {}

  Value document() {
    skip_ws();
    Value v = value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected data after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < pos_ && i < s_.size(); ++i) {
      if (s_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    TORCH_CHECK(false, "json: ", what, " at line ", line, ", column ", col);
  }

  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[pos_]; }

  void skip_ws() {
    while (!at_end() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }

  void expect_word(std::string_view w) {
    if (s_.substr(pos_, w.size()) != w) fail("invalid literal");
    pos_ += w.size();
  }

  Value value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than 256 levels");
    switch (peek()) {
      case '{':
        return object(depth);
      case '[':
        return array(depth);
      case '"':
        return Value::string(string());
      case 't':
        expect_word("true");
        return Value::boolean(true);
      case 'f':
        expect_word("false");
        return Value::boolean(false);
      case 'n':
        expect_word("null");
        return Value();
      default:
        if (peek() == '-' || (peek() >= '0' && peek() <= '9')) return number();
        fail(at_end() ? "unexpected end of input" : "unexpected character");
    }
  }

  Value object(int depth) {
    ++pos_;  // '{'
    Value::Object members;
    skip_ws();
    if (peek() == '}') {
      ++pos_;
      return Value::object(std::move(members));
    }
    for (;;) {
      skip_ws();
      if (peek() != '"') fail("expected a string key");
      std::string key = string();
      skip_ws();
      if (peek() != ':') fail("expected ':'");
      ++pos_;
      skip_ws();
      members.emplace_back(std::move(key), value(depth + 1));
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        return Value::object(std::move(members));
      }
      fail("expected ',' or '}'");
    }
  }

  Value array(int depth) {
    ++pos_;  // '['
    Value::Array items;
    skip_ws();
    if (peek() == ']') {
      ++pos_;
      return Value::array(std::move(items));
    }
    for (;;) {
      skip_ws();
      items.push_back(value(depth + 1));
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        return Value::array(std::move(items));
      }
      fail("expected ',' or ']'");
    }
  }

  unsigned hex4() {
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = peek();
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= static_cast<unsigned>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v |= static_cast<unsigned>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        v |= static_cast<unsigned>(c - 'A' + 10);
      } else {
        fail("invalid \\u escape");
      }
      ++pos_;
    }
    return v;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    ++pos_;  // '"'
    std::string out;
    for (;;) {
      if (at_end()) fail("unterminated string");
      const char c = s_[pos_];
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        ++pos_;
        continue;
      }
      ++pos_;
      const char e = peek();
      ++pos_;
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {  // high surrogate: a low one must follow
            if (s_.substr(pos_, 2) != "\\u") fail("unpaired surrogate");
            pos_ += 2;
            const unsigned lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("invalid low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default:
          --pos_;
          fail("invalid escape");
      }
    }
  }

  Value number() {
    const size_t start = pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (!at_end() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ - from;
    };
    if (peek() == '-') ++pos_;
    if (peek() == '0') {
      ++pos_;
      if (peek() >= '0' && peek() <= '9') fail("leading zero in number");
    } else if (digits() == 0) {
      fail("expected digits");
    }
    if (peek() == '.') {
      ++pos_;
      if (digits() == 0) fail("expected digits after '.'");
    }
    if (peek() == 'e' || peek() == 'E') {
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (digits() == 0) fail("expected exponent digits");
    }
    const std::string text(s_.substr(start, pos_ - start));
    return Value::number(std::strtod(text.c_str(), nullptr));
  }

  std::string_view s_;
  size_t pos_ = 0;
};

void write_string(std::ostream& os, const std::string& s) {
  os << '"';
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      os << '\\' << static_cast<char>(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      os << buf;
    } else {
      os << static_cast<char>(c);
    }
  }
  os << '"';
}

}  // namespace

Value parse(std::string_view text) { return Parser(text).document(); }

Value parse_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f.good(), "json: cannot open '", path, "'");
  std::ostringstream buf;
  buf << f.rdbuf();
  try {
    return parse(buf.str());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, ": ", e.what_without_backtrace());
  }
}

void write(std::ostream& os, const Value& v) {
  switch (v.type()) {
    case Value::Type::kNull:
      os << "null";
      return;
    case Value::Type::kBool:
      os << (v.as_bool() ? "true" : "false");
      return;
    case Value::Type::kNumber: {
      const double d = v.as_number();
      TORCH_CHECK(std::isfinite(d), "json: cannot write a non-finite number");
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.17g", d);
      os << buf;
      return;
    }
    case Value::Type::kString:
      write_string(os, v.as_string());
      return;
    case Value::Type::kArray: {
      os << '[';
      bool first = true;
      for (const auto& item : v.as_array()) {
        if (!first) os << ',';
        write(os, item);
        first = false;
      }
      os << ']';
      return;
    }
    case Value::Type::kObject: {
      os << '{';
      bool first = true;
      for (const auto& [k, item] : v.as_object()) {
        if (!first) os << ',';
        write_string(os, k);
        os << ':';
        write(os, item);
        first = false;
      }
      os << '}';
      return;
    }
  }
}

std::string write(const Value& v) {
  std::ostringstream os;
  write(os, v);
  return os.str();
}

}  // namespace json
}  // namespace flatshard
