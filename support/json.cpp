// flatshard/support/json.cpp — see json.h.
#include "support/json.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <unordered_set>

namespace flatshard {
namespace json {

namespace {

// RFC 6901: '~' and '/' inside a key are escaped as ~0 and ~1.
std::string pointer_token(const std::string& key) {
  std::string out;
  for (const char c : key) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}

// Builds the document through nlohmann's SAX interface (no DOM parser of nlohmann's own is
// involved), refusing what nlohmann would accept but the contract does not: duplicate keys,
// nesting beyond kMaxDepth and integer literals beyond 64 bits. Members go into objects with a
// plain vector append; the per-object key sets keep the duplicate check O(1) per key (a
// safetensors header has one key per tensor, thousands of them).
class StrictBuilder : public nlohmann::json_sax<Json> {
 public:
  explicit StrictBuilder(Json& root) : root_(root) {}

  bool null() override { return add(Json()); }
  bool boolean(bool b) override { return add(Json(b)); }
  bool number_integer(number_integer_t v) override { return add(Json(v)); }
  bool number_unsigned(number_unsigned_t v) override { return add(Json(v)); }
  bool number_float(number_float_t v, const string_t& text) override {
    // nlohmann turns an integer literal beyond uint64 into a double; we refuse it instead.
    if (text.find_first_of(".eE") == std::string::npos)
      return refuse("integer " + text + " does not fit in 64 bits, at " + location(levels_.size()));
    return add(Json(v));
  }
  bool string(string_t& s) override { return add(Json(std::move(s))); }
  bool binary(binary_t&) override { return refuse("binary value"); }  // not in JSON text

  bool start_object(std::size_t) override { return open(Json::object()); }
  bool start_array(std::size_t) override { return open(Json::array()); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }

  bool key(string_t& k) override {
    Level& top = levels_.back();
    if (seen_before(top, k))
      return refuse("duplicate key '" + k + "' in the object at " + location(levels_.size() - 1));
    top.key = std::move(k);
    return true;
  }

  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::json::exception& e) override {
    // position: characters read, the offending one included.
    error_position_ = position > 0 ? position - 1 : 0;
    // e.what(): "[json.exception.parse_error.101] parse error at line L, column C: why".
    const std::string what = e.what();
    const size_t col = what.find("column ");
    const size_t sep = col == std::string::npos ? col : what.find(": ", col);
    error_ = sep == std::string::npos ? what : what.substr(sep + 2);
    return false;
  }

  const std::string& error() const { return error_; }
  // Byte offset of a syntax error; nullopt for errors of the contract's own (duplicates...).
  std::optional<size_t> error_position() const { return error_position_; }

 private:
  using Members = std::vector<Json::object_t::value_type>;
  static Members& members_of(Json& object) {
    return static_cast<Members&>(object.get_ref<Json::object_t&>());
  }

  struct Level {
    Json* value;
    // Objects of more than kScanned members: an open-addressing index of their keys, slot =
    // member index + 1 (0: empty), so the duplicate check is O(1) per key without a second copy
    // of each key (a safetensors header has one key per tensor; a set of strings per object
    // was ~9% of reading 524,288 tensors, issue 49). Smaller objects are scanned.
    std::vector<uint32_t> slots;
    std::string key;  // objects: the member being read, until it is placed
  };
  static constexpr size_t kScanned = 8;

  // Whether `k` is a key of `l`'s object already; if not, indexes it as the member that
  // place() appends next.
  static bool seen_before(Level& l, const std::string& k) {
    const Members& m = members_of(*l.value);
    if (m.size() < kScanned) {
      for (const auto& p : m)
        if (p.first == k) return true;
      return false;
    }
    if (l.slots.size() < 2 * (m.size() + 1)) {  // at most half full; rebuilt from the members
      size_t size = 64;
      while (size < 4 * (m.size() + 1)) size *= 2;
      l.slots.assign(size, 0);
      for (size_t i = 0; i < m.size(); ++i) {
        size_t h = std::hash<std::string>()(m[i].first) & (l.slots.size() - 1);
        while (l.slots[h] != 0) h = (h + 1) & (l.slots.size() - 1);
        l.slots[h] = static_cast<uint32_t>(i + 1);
      }
    }
    size_t h = std::hash<std::string>()(k) & (l.slots.size() - 1);
    for (; l.slots[h] != 0; h = (h + 1) & (l.slots.size() - 1))
      if (m[l.slots[h] - 1].first == k) return true;
    l.slots[h] = static_cast<uint32_t>(m.size() + 1);
    return false;
  }

  // The JSON Pointer of the value being read inside the first `n` open containers. A container
  // with an open container inside already holds it (an array's last element, an object's last
  // member, its key moved there); the innermost one is about to receive the value being read
  // (an array's index size(), an object's pending key).
  std::string pointer(size_t n) const {
    std::string p;
    for (size_t i = 0; i < n; ++i) {
      const Level& l = levels_[i];
      const bool placed = i + 1 < levels_.size();
      if (l.value->is_array()) {
        p += "/" + std::to_string(l.value->size() - (placed ? 1 : 0));
      } else {
        p += "/" + pointer_token(placed ? members_of(*l.value).back().first : l.key);
      }
    }
    return p;
  }
  std::string location(size_t n) const {
    const std::string p = pointer(n);
    return p.empty() ? "the top level" : p;
  }

  bool refuse(std::string why) {
    error_ = std::move(why);
    return false;
  }

  // Places `v` where the document is at; returns false (with error_) on a contract violation.
  Json* place(Json&& v) {
    if (levels_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Json& top = *levels_.back().value;
    if (top.is_array()) {
      auto& a = top.get_ref<Json::array_t&>();
      a.push_back(std::move(v));
      return &a.back();
    }
    // ordered_map's own emplace searches for the key linearly; key() already made it unique.
    auto& members =
        static_cast<std::vector<Json::object_t::value_type>&>(top.get_ref<Json::object_t&>());
    if (members.size() == members.capacity()) {
      // A member's pair has a const key, so vector's own growth deep-copies every value before
      // it (a safetensors header: 14% of reading 524,288 tensors). Grown by hand, the values
      // move; nothing points into them (only the innermost open container is appended to).
      std::vector<Json::object_t::value_type> grown;
      grown.reserve(std::max<size_t>(4, 2 * members.size()));
      for (auto& m : members) grown.emplace_back(m.first, std::move(m.second));
      members.swap(grown);
    }
    members.emplace_back(std::move(levels_.back().key), std::move(v));  // pointer() reads it there
    return &members.back().second;
  }

  bool add(Json&& v) {
    place(std::move(v));
    return true;
  }

  bool open(Json&& container) {
    if (levels_.size() >= static_cast<size_t>(kMaxDepth))
      return refuse("nesting deeper than " + std::to_string(kMaxDepth) + " levels, at " +
                    location(levels_.size()));
    // Pointers stay valid: a container is only appended to while it is the innermost open one.
    Json* c = place(std::move(container));
    levels_.push_back(Level{c, {}, {}});
    return true;
  }

  bool close() {
    levels_.pop_back();
    return true;
  }

  Json& root_;
  std::vector<Level> levels_;  // the open containers, outermost first
  std::string error_;
  std::optional<size_t> error_position_;
};

// For messages: "a string", "an array"; numbers show their value.
std::string describe(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return v.get<bool>() ? "true" : "false";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
    case Json::value_t::number_float:
      return v.dump();
    case Json::value_t::string:
      return "a string";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::object:
      return "an object";
    default:
      return "a binary value";
  }
}

}  // namespace

Json parse(std::string_view text, const std::string& what) {
  Json root;
  StrictBuilder builder(root);
  if (Json::sax_parse(text.data(), text.data() + text.size(), &builder)) return root;
  const std::string prefix = what.empty() ? "" : what + ": ";
  const std::optional<size_t> at = builder.error_position();
  if (!at) TORCH_CHECK(false, prefix, "invalid JSON: ", builder.error());
  const size_t pos = std::min(*at, text.size());
  size_t line = 1, col = 1;
  for (size_t i = 0; i < pos; ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  TORCH_CHECK(false, prefix, "invalid JSON at byte ", pos, " (line ", line, ", column ", col,
              "): ", builder.error());
}

Node::Node(const Json& doc, std::string what)
    : Node(&doc, std::make_shared<const Doc>(Doc{std::move(what), &doc})) {}

namespace {

// Appends to `path` the JSON Pointer of `target` inside `v`; false if it is not there. Recurses
// once per level: a parsed document is at most kMaxDepth deep.
bool find_pointer(const Json& v, const Json* target, std::string& path) {
  if (&v == target) return true;
  const size_t size = path.size();
  if (v.is_object()) {
    for (const auto& kv : v.get_ref<const Json::object_t&>()) {
      path += "/" + pointer_token(kv.first);
      if (find_pointer(kv.second, target, path)) return true;
      path.resize(size);
    }
  } else if (v.is_array()) {
    for (size_t i = 0; i < v.size(); ++i) {
      path += "/" + std::to_string(i);
      if (find_pointer(v[i], target, path)) return true;
      path.resize(size);
    }
  }
  return false;
}

}  // namespace

std::string Node::pointer() const {
  std::string path;
  const bool found = find_pointer(*doc_->root, value_, path);
  TORCH_INTERNAL_ASSERT(found, "json::Node: the value is not in its document");
  return path;
}

std::string Node::where() const {
  const std::string p = pointer();
  const std::string& what = doc_->what;
  if (what.empty()) return p.empty() ? "JSON" : p;
  return p.empty() ? what : what + ": " + p;
}

void Node::fail(const std::string& why) const { TORCH_CHECK(false, where(), ": ", why); }

void Node::fail_type(const char* expected) const {
  fail(std::string("expected ") + expected + ", got " + describe(*value_));
}

Node Node::at(const std::string& key) const {
  if (!value_->is_object())
    fail("expected an object with key '" + key + "', got " + describe(*value_));
  const auto it = value_->find(key);
  if (it == value_->end()) fail("missing key '" + key + "'");
  return Node(&*it, doc_);
}

std::optional<Node> Node::find(const std::string& key) const {
  if (!value_->is_object())
    fail("expected an object with key '" + key + "', got " + describe(*value_));
  const auto it = value_->find(key);
  if (it == value_->end()) return std::nullopt;
  return Node(&*it, doc_);
}

std::vector<Node> Node::items() const {
  if (!value_->is_array()) fail_type("an array");
  std::vector<Node> out;
  out.reserve(value_->size());
  for (size_t i = 0; i < value_->size(); ++i)
    out.push_back(Node(&(*value_)[i], doc_));
  return out;
}

std::vector<std::pair<std::string, Node>> Node::members() const {
  if (!value_->is_object()) fail_type("an object");
  std::vector<std::pair<std::string, Node>> out;
  out.reserve(value_->size());
  for (const auto& [k, v] : value_->items()) out.emplace_back(k, Node(&v, doc_));
  return out;
}

std::vector<std::pair<std::string_view, Node>> Node::member_views() const {
  if (!value_->is_object()) fail_type("an object");
  std::vector<std::pair<std::string_view, Node>> out;
  out.reserve(value_->size());
  // The object's own pairs: the views are of the document's keys.
  for (const auto& kv : value_->get_ref<const Json::object_t&>())
    out.emplace_back(kv.first, Node(&kv.second, doc_));
  return out;
}

bool Node::as_bool() const {
  if (!value_->is_boolean()) fail_type("a boolean");
  return value_->get<bool>();
}

double Node::as_number() const {
  if (!value_->is_number()) fail_type("a number");
  return value_->get<double>();
}

int64_t Node::as_int() const {
  if (value_->is_number_unsigned()) {
    const uint64_t u = value_->get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail("integer " + std::to_string(u) + " does not fit in int64");
    return static_cast<int64_t>(u);
  }
  if (!value_->is_number_integer()) fail_type("an integer");  // floats: "got 1.5"
  return value_->get<int64_t>();
}

const std::string& Node::as_string() const {
  if (!value_->is_string()) fail_type("a string");
  return value_->get_ref<const std::string&>();
}

std::string quote(std::string_view s) {
  try {
    return Json(std::string(s)).dump();  // strict: ill-formed UTF-8 throws
  } catch (const Json::type_error& e) {
    TORCH_CHECK(false, "JSON: cannot write the string '", s, "': ", e.what());
  }
}

std::string number(double d) {
  TORCH_CHECK(std::isfinite(d), "JSON: cannot write the number ", d,
              " (JSON has no NaN or infinity)");
  return Json(d).dump();
}

}  // namespace json
}  // namespace flatshard
