// flatshard/checkpoint/json.cpp — see json.h.
#include "checkpoint/json.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace flatshard {
namespace json {

namespace {

constexpr int kMaxDepth = 64;  // containers inside containers, the outermost counted

// For messages: "a string", "an array".
const char* type_name(Value::Type t) {
  switch (t) {
    case Value::Type::kNull:
      return "null";
    case Value::Type::kBool:
      return "a boolean";
    case Value::Type::kNumber:
      return "a number";
    case Value::Type::kString:
      return "a string";
    case Value::Type::kArray:
      return "an array";
    case Value::Type::kObject:
      return "an object";
  }
  return "?";
}

// An integer literal: no fraction, no exponent (the grammar already checked the rest).
bool integer_literal(const std::string& text) {
  return !text.empty() && text.find_first_of(".eE") == std::string::npos;
}

std::string format_double(double d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", d);
  return buf;
}

}  // namespace

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
Value Value::integer(int64_t i) {
  Value v;
  v.type_ = Type::kNumber;
  v.number_ = static_cast<double>(i);
  v.string_ = std::to_string(i);
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

#define FLATSHARD_JSON_EXPECT(want) \
  TORCH_CHECK(type_ == want, "JSON: expected ", type_name(want), ", got ", type_name(type_))

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

bool Value::exact_int(int64_t* out) const {
  if (type_ != Type::kNumber) return false;
  if (string_.empty()) {  // built from a double: integral and inside int64's range
    if (!(std::trunc(number_) == number_ && number_ >= -0x1p63 && number_ < 0x1p63)) return false;
    *out = static_cast<int64_t>(number_);
    return true;
  }
  if (!integer_literal(string_)) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(string_.c_str(), &end, 10);
  if (errno != 0 || end == nullptr || *end != '\0') return false;
  *out = v;
  return true;
}

int64_t Value::as_int() const {
  TORCH_CHECK(type_ == Type::kNumber, "JSON: expected an integer, got ", type_name(type_));
  int64_t v = 0;
  if (exact_int(&v)) return v;
  const std::string text = string_.empty() ? format_double(number_) : string_;
  const bool integral = string_.empty() ? std::isfinite(number_) && std::trunc(number_) == number_
                                        : integer_literal(string_);
  TORCH_CHECK(integral, "JSON: expected an integer, got ", text);
  TORCH_CHECK(false, "JSON: integer ", text, " does not fit in 64 bits");
}

const Value* Value::find(const std::string& key) const {
  if (type_ != Type::kObject) return nullptr;
  for (const auto& [k, v] : object_)
    if (k == key) return &v;
  return nullptr;
}

const Value& Value::at(const std::string& key) const {
  TORCH_CHECK(type_ == Type::kObject, "JSON: expected an object with key '", key, "', got ",
              type_name(type_));
  const Value* v = find(key);
  TORCH_CHECK(v != nullptr, "JSON: missing key '", key, "'");
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
    case Type::kNumber: {
      if (number_ != o.number_) return false;
      int64_t a = 0, b = 0;  // equal doubles can still be different integers beyond 2^53
      return !(exact_int(&a) && o.exact_int(&b)) || a == b;
    }
    case Type::kString:
      return string_ == o.string_;
    case Type::kArray:
      return array_ == o.array_;
    case Type::kObject:
      return object_ == o.object_;
  }
  return false;
}

class Parser {
 public:
  Parser(std::string_view text, const std::string& what) : s_(text), what_(what) {}

  Value document() {
    skip_ws();
    Value v = value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < pos_ && i < s_.size(); ++i) {
      if (s_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    TORCH_CHECK(false, what_, what_.empty() ? "" : ": ", "invalid JSON at byte ", pos_, " (line ",
                line, ", column ", col, "): ", why);
  }

  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[pos_]; }

  void skip_ws() {
    while (!at_end() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }

  void expect_word(std::string_view w) {
    if (s_.substr(pos_, w.size()) != w) fail("expected '" + std::string(w) + "'");
    pos_ += w.size();
  }

  // `depth`: the containers around this value.
  Value value(int depth) {
    if ((peek() == '{' || peek() == '[') && depth >= kMaxDepth)
      fail("nesting deeper than " + std::to_string(kMaxDepth) + " levels");
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
        if (at_end()) fail("unexpected end of text");
        fail(std::string("unexpected character '") + peek() + "'");
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
        fail("bad hex digit in \\u escape");
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
      if (at_end()) fail("unterminated string");
      const char e = s_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
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
            if (lo < 0xDC00 || lo > 0xDFFF) fail("unpaired surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default:
          --pos_;
          fail(std::string("bad escape '\\") + e + "'");
      }
    }
  }

  // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? ; a digit after a leading 0 is left for the
  // caller, which refuses it as stray text.
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
    } else if (digits() == 0) {
      fail("expected a digit");
    }
    if (peek() == '.') {
      ++pos_;
      if (digits() == 0) fail("expected a digit after '.'");
    }
    if (peek() == 'e' || peek() == 'E') {
      ++pos_;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (digits() == 0) fail("expected an exponent digit");
    }
    Value v;
    v.type_ = Value::Type::kNumber;
    v.string_ = std::string(s_.substr(start, pos_ - start));
    v.number_ = std::strtod(v.string_.c_str(), nullptr);
    return v;
  }

  std::string_view s_;
  const std::string& what_;
  size_t pos_ = 0;
};

Value parse(std::string_view text, const std::string& what) {
  return Parser(text, what).document();
}

Value parse_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  TORCH_CHECK(f.good(), "cannot open '", path, "'");
  std::ostringstream buf;
  buf << f.rdbuf();
  return parse(buf.str(), path);
}

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

void write(std::ostream& os, const Value& v) {
  switch (v.type()) {
    case Value::Type::kNull:
      os << "null";
      return;
    case Value::Type::kBool:
      os << (v.bool_ ? "true" : "false");
      return;
    case Value::Type::kNumber:
      if (!v.string_.empty()) {  // parsed or integer(): the exact text
        os << v.string_;
      } else {
        TORCH_CHECK(std::isfinite(v.number_), "JSON: cannot write a non-finite number");
        os << format_double(v.number_);
      }
      return;
    case Value::Type::kString:
      os << quote(v.string_);
      return;
    case Value::Type::kArray: {
      os << '[';
      bool first = true;
      for (const auto& item : v.array_) {
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
      for (const auto& [k, item] : v.object_) {
        if (!first) os << ',';
        os << quote(k);
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
