// flatshard/support/json.h — flatshard's strict JSON reader over nlohmann::json, typed access
// whose errors say where, and the two scalar writers the hand-laid formats use.
//
// Who uses it: the checkpoint reads its manifests and safetensors headers with it and writes
// their strings and numbers with quote() / number(); the benchmark report writes its strings
// with quote(); tests read benchmark output with it. A bottom-layer helper: it depends on
// nothing of flatshard.
//
// Contract
// - parse() accepts exactly RFC 8259 JSON (nlohmann's parser, strict mode): one value with
//   optional whitespace around it; no comments, trailing commas, NaN/Infinity, leading '+' or
//   leading zeros; no control characters or ill-formed UTF-8 in strings; \u escapes (surrogate
//   pairs included) become UTF-8, unpaired surrogates are refused.
// - On top of nlohmann, three promises nlohmann does not make:
//   * Duplicate keys are an error naming the key and the object (nlohmann, like most readers,
//     silently keeps the last one; for a manifest that is a silent choice between two values).
//   * Nesting deeper than kMaxDepth (64) containers is an error (no deep recursion on hostile
//     input; far more than any format we read needs).
//   * Integers are exact: every integer literal is kept as a 64-bit integer; one beyond
//     uint64's range is an error instead of becoming a rounded double. Node::as_int() is exact
//     for every value in int64's range (safetensors offsets up to 2^63-1 included) and refuses
//     fractions and exponents ("1.0", "1e2") as well as values beyond int64.
// - Parse errors throw c10::Error "<what>: invalid JSON at byte B (line L, column C): <why>"
//   (`what` names the text, e.g. its file; without one the message starts at "invalid JSON";
//   B counts from 0, L and C from 1, columns in bytes). Duplicate keys and depth:
//   "<what>: invalid JSON: duplicate key 'k' in the object at /files/0" (or "at the top
//   level").
// - Objects keep their members in document order (nlohmann::ordered_json).
// - Node: a value of a parsed document plus where it is, as a JSON Pointer (RFC 6901,
//   "/files/2/bytes"). Its typed accessors throw "<what>: <pointer>: expected an integer, got
//   1.5" — the file and the key in every message, without callers adding context by hand.
//   A Node refers to the document: the Json it was made from must outlive it. Taking a Node
//   (at, items, members) costs no string: the pointer is found in the document when asked
//   (pointer(), where(), an error), in time linear in the document, so where() belongs on an
//   error path, not in a loop (a safetensors header of 524,288 tensors built ~3.6 million
//   pointer strings that no message used, issue 49).
// - quote() and number() write with nlohmann's serializer: quote() escapes what JSON requires
//   (", \, control characters; UTF-8 passes through) and refuses ill-formed UTF-8, which parse()
//   would refuse to read back; number() is the shortest text that reads back as the same double
//   ("0.9", "1.0", "1e-08") and refuses NaN and infinities, which JSON cannot hold.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace flatshard {
namespace json {

using Json = nlohmann::ordered_json;

inline constexpr int kMaxDepth = 64;  // containers inside containers, the outermost counted

// `what` names the text in error messages (e.g. the file it came from); may be empty.
Json parse(std::string_view text, const std::string& what = {});
// Files: support/input_file.h's read_json_file (bounded, never blocking; the one way a file is
// read, so this layer has no unbounded file reader of its own).

class Node {
 public:
  // The root of `doc`, which must outlive this Node and every Node taken from it.
  Node(const Json& doc, std::string what);
  Node(Json&& doc, std::string what) = delete;  // would refer to a temporary

  const Json& json() const { return *value_; }
  std::string pointer() const;  // "" at the root; searched in the document (see the contract)
  // "<what>: <pointer>", either part left out when empty ("JSON" when both are): how error
  // messages start.
  std::string where() const;

  bool is_null() const { return value_->is_null(); }
  bool is_object() const { return value_->is_object(); }

  // Object member that must exist; throws naming the key (or the type, for non-objects).
  Node at(const std::string& key) const;
  // Object member, or nullopt when absent; throws for non-objects.
  std::optional<Node> find(const std::string& key) const;
  // An array's elements / an object's members in document order; throw for other types.
  std::vector<Node> items() const;
  std::vector<std::pair<std::string, Node>> members() const;
  // members() without copying the keys: views of the document's own keys.
  std::vector<std::pair<std::string_view, Node>> member_views() const;

  // Typed access; each throws naming where() and what was found instead.
  bool as_bool() const;
  double as_number() const;  // any number, nearest double
  int64_t as_int() const;    // an integer within int64, exact (see the contract)
  const std::string& as_string() const;

  // Throws c10::Error "<where()>: <why>", for callers' own checks of a value.
  [[noreturn]] void fail(const std::string& why) const;

 private:
  struct Doc {
    std::string what;
    const Json* root;  // where pointer() searches from
  };
  Node(const Json* value, std::shared_ptr<const Doc> doc) : value_(value), doc_(std::move(doc)) {}
  [[noreturn]] void fail_type(const char* expected) const;

  const Json* value_;
  std::shared_ptr<const Doc> doc_;
};

// `s` as a JSON string literal, quotes included. Throws on ill-formed UTF-8.
std::string quote(std::string_view s);
// `d` as the shortest JSON number that reads back as `d`. Throws on NaN and infinities.
std::string number(double d);

}  // namespace json
}  // namespace flatshard
