#include "checkpoint/json.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace flatshard {

class JsonParser {
 public:
  JsonParser(const std::string& text, const std::string& what) : s_(text), what_(what) {}

  Json document() {
    Json v = value(0);
    skip_space();
    if (pos_ != s_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    TORCH_CHECK(false, what_, ": invalid JSON at byte ", pos_, ": ", why);
  }
  void skip_space() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t'))
      ++pos_;
  }
  bool eat(char c) {
    skip_space();
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  void literal(const char* word) {
    for (const char* p = word; *p; ++p, ++pos_)
      if (pos_ >= s_.size() || s_[pos_] != *p) fail(std::string("expected '") + word + "'");
  }

  Json value(int depth) {
    if (depth > 64) fail("nesting deeper than 64");
    skip_space();
    if (pos_ >= s_.size()) fail("unexpected end of text");
    Json v;
    const char c = s_[pos_];
    if (c == '{') {
      ++pos_;
      v.type_ = Json::Type::kObject;
      if (eat('}')) return v;
      do {
        skip_space();
        std::string key = string_literal();
        expect(':');
        v.members_.emplace_back(std::move(key), value(depth + 1));
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      ++pos_;
      v.type_ = Json::Type::kArray;
      if (eat(']')) return v;
      do v.items_.push_back(value(depth + 1));
      while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.type_ = Json::Type::kString;
      v.text_ = string_literal();
    } else if (c == 't' || c == 'f') {
      v.type_ = Json::Type::kBool;
      v.bool_ = c == 't';
      literal(v.bool_ ? "true" : "false");
    } else if (c == 'n') {
      literal("null");
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.type_ = Json::Type::kNumber;
      v.text_ = number_literal();
    } else {
      fail(std::string("unexpected character '") + c + "'");
    }
    return v;
  }

  std::string number_literal() {
    const size_t start = pos_;
    auto digits = [&] {
      const size_t d = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      if (pos_ == d) fail("expected a digit");
    };
    if (s_[pos_] == '-') ++pos_;
    if (pos_ < s_.size() && s_[pos_] == '0') {
      ++pos_;
    } else {
      digits();
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      digits();
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      digits();
    }
    return s_.substr(start, pos_ - start);
  }

  unsigned hex4() {
    if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = s_[pos_++];
      v <<= 4;
      if (h >= '0' && h <= '9')
        v |= h - '0';
      else if (h >= 'a' && h <= 'f')
        v |= h - 'a' + 10;
      else if (h >= 'A' && h <= 'F')
        v |= h - 'A' + 10;
      else
        fail("bad hex digit in \\u escape");
    }
    return v;
  }

  static void put_utf8(std::string& out, unsigned cp) {
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

  std::string string_literal() {
    if (pos_ >= s_.size() || s_[pos_] != '"') fail("expected a string");
    ++pos_;
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated escape");
      const char e = s_[pos_++];
      static const char kEscaped[] = "\"\\/bfnrt", kMeaning[] = "\"\\/\b\f\n\r\t";
      if (const char* k = e ? std::strchr(kEscaped, e) : nullptr) {
        out += kMeaning[k - kEscaped];
        continue;
      }
      if (e != 'u') fail(std::string("bad escape '\\") + e + "'");
      unsigned cp = hex4();
      if (cp >= 0xD800 && cp < 0xDC00) {  // a surrogate pair encodes one code point
        if (pos_ + 2 > s_.size() || s_[pos_] != '\\' || s_[pos_ + 1] != 'u')
          fail("unpaired surrogate");
        pos_ += 2;
        const unsigned lo = hex4();
        if (lo < 0xDC00 || lo >= 0xE000) fail("unpaired surrogate");
        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
      } else if (cp >= 0xDC00 && cp < 0xE000) {
        fail("unpaired surrogate");
      }
      put_utf8(out, cp);
    }
  }

  const std::string& s_;
  const std::string& what_;
  size_t pos_ = 0;
};

Json Json::parse(const std::string& text, const std::string& what) {
  return JsonParser(text, what).document();
}

namespace {
const char* type_name(Json::Type t) {
  switch (t) {
    case Json::Type::kNull:
      return "null";
    case Json::Type::kBool:
      return "a boolean";
    case Json::Type::kNumber:
      return "a number";
    case Json::Type::kString:
      return "a string";
    case Json::Type::kArray:
      return "an array";
    case Json::Type::kObject:
      return "an object";
  }
  return "?";
}
}  // namespace

const std::string& Json::str() const {
  TORCH_CHECK(type_ == Type::kString, "JSON: expected a string, got ", type_name(type_));
  return text_;
}

int64_t Json::as_int() const {
  TORCH_CHECK(type_ == Type::kNumber, "JSON: expected an integer, got ", type_name(type_));
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text_.c_str(), &end, 10);
  TORCH_CHECK(errno == 0 && end && *end == '\0', "JSON: expected an integer, got ", text_);
  return v;
}

double Json::as_double() const {
  TORCH_CHECK(type_ == Type::kNumber, "JSON: expected a number, got ", type_name(type_));
  return std::strtod(text_.c_str(), nullptr);
}

bool Json::as_bool() const {
  TORCH_CHECK(type_ == Type::kBool, "JSON: expected a boolean, got ", type_name(type_));
  return bool_;
}

const std::vector<Json>& Json::array() const {
  TORCH_CHECK(type_ == Type::kArray, "JSON: expected an array, got ", type_name(type_));
  return items_;
}

const std::vector<std::pair<std::string, Json>>& Json::object() const {
  TORCH_CHECK(type_ == Type::kObject, "JSON: expected an object, got ", type_name(type_));
  return members_;
}

const Json* Json::find(const std::string& key) const {
  for (const auto& [k, v] : object())
    if (k == key) return &v;
  return nullptr;
}

const Json& Json::at(const std::string& key) const {
  const Json* v = find(key);
  TORCH_CHECK(v != nullptr, "JSON: missing key '", key, "'");
  return *v;
}

std::string json_quote(const std::string& s) {
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

}  // namespace flatshard
