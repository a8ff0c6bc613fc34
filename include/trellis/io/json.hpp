// A JSON value for safetensors headers, checkpoint indexes, metrics lines and cluster files, read
// and written by nlohmann-json (the component trellis::json; docs/checkpoint.md says why this
// small Value stays in front of it: typed access whose errors name the file and the field).
// Integers are kept exactly as int64 (file offsets, shapes); other numbers are doubles, written
// in their shortest round-trip form; non-finite doubles are written as null (JSON has no NaN).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "trellis/core/error.hpp"

namespace trellis::io::json {

class Value;
using Array = std::vector<Value>;
using Object = std::map<std::string, Value, std::less<>>;  // sorted keys: deterministic output

class Value {
 public:
  using Storage = std::variant<std::nullptr_t, bool, std::int64_t, double, std::string, Array, Object>;

  Value() : v_(nullptr) {}
  Value(std::nullptr_t) : v_(nullptr) {}
  Value(bool b) : v_(b) {}
  template <class I>
    requires(std::is_integral_v<I> && !std::is_same_v<I, bool>)
  Value(I i) : v_(static_cast<std::int64_t>(i)) {}
  Value(double d) : v_(d) {}
  Value(float f) : v_(static_cast<double>(f)) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(std::string_view s) : v_(std::string(s)) {}
  Value(Array a) : v_(std::move(a)) {}
  Value(Object o) : v_(std::move(o)) {}

  bool is_null() const { return std::holds_alternative<std::nullptr_t>(v_); }
  bool is_bool() const { return std::holds_alternative<bool>(v_); }
  bool is_int() const { return std::holds_alternative<std::int64_t>(v_); }
  bool is_number() const { return is_int() || std::holds_alternative<double>(v_); }
  bool is_string() const { return std::holds_alternative<std::string>(v_); }
  bool is_array() const { return std::holds_alternative<Array>(v_); }
  bool is_object() const { return std::holds_alternative<Object>(v_); }

  // Typed access; `what` names the value in the error (e.g. "header of shard-0.safetensors").
  bool as_bool(std::string_view what = "value") const { return get<bool>(what, "a boolean"); }
  std::int64_t as_int(std::string_view what = "value") const {
    return get<std::int64_t>(what, "an integer");
  }
  double as_double(std::string_view what = "value") const {
    if (is_int()) return static_cast<double>(std::get<std::int64_t>(v_));
    return get<double>(what, "a number");
  }
  const std::string& as_string(std::string_view what = "value") const {
    return get<std::string>(what, "a string");
  }
  const Array& as_array(std::string_view what = "value") const { return get<Array>(what, "an array"); }
  const Object& as_object(std::string_view what = "value") const {
    return get<Object>(what, "an object");
  }
  Array& as_array(std::string_view what = "value") {
    return const_cast<Array&>(std::as_const(*this).as_array(what));
  }
  Object& as_object(std::string_view what = "value") {
    return const_cast<Object&>(std::as_const(*this).as_object(what));
  }

  // Object member access: `at` throws naming the missing key, `find` returns nullptr.
  const Value& at(std::string_view key, std::string_view what = "object") const {
    const Object& o = as_object(what);
    auto it = o.find(key);
    if (it == o.end()) TRELLIS_THROW(what, ": missing key \"", key, "\"");
    return it->second;
  }
  const Value* find(std::string_view key) const {
    if (!is_object()) return nullptr;
    const Object& o = std::get<Object>(v_);
    auto it = o.find(key);
    return it == o.end() ? nullptr : &it->second;
  }
  Value& operator[](const std::string& key) {
    if (is_null()) v_ = Object{};
    return as_object()[key];
  }

  const Storage& storage() const { return v_; }

 private:
  template <class T>
  const T& get(std::string_view what, const char* kind) const {
    if (!std::holds_alternative<T>(v_)) TRELLIS_THROW(what, " is not ", kind);
    return std::get<T>(v_);
  }
  Storage v_;
};

// ---- reading and writing: nlohmann-json --------------------------------------------------------
// The text is parsed and written by nlohmann-json (a well-kept, fuzzed library; docs/checkpoint.md);
// this file only maps it to and from Value. The parse goes through nlohmann's SAX interface
// straight into a Value, so no second tree is built, and adds the rules our files rely on:
// duplicate keys are an error (nlohmann keeps the last one silently), nesting is capped at 64
// (bounded recursion everywhere after), and a non-negative integer above int64 is a double, as
// any other integer that does not fit.
namespace detail {

inline constexpr int max_depth = 64;

class SaxBuilder {
 public:
  using number_integer_t = nlohmann::json::number_integer_t;
  using number_unsigned_t = nlohmann::json::number_unsigned_t;
  using number_float_t = nlohmann::json::number_float_t;
  using string_t = nlohmann::json::string_t;
  using binary_t = nlohmann::json::binary_t;

  explicit SaxBuilder(std::string_view what) : what_(what) {}

  bool null() { return add(Value(nullptr)); }
  bool boolean(bool b) { return add(Value(b)); }
  bool number_integer(number_integer_t i) { return add(Value(static_cast<std::int64_t>(i))); }
  bool number_unsigned(number_unsigned_t u) {
    if (u <= static_cast<number_unsigned_t>(INT64_MAX)) return add(Value(static_cast<std::int64_t>(u)));
    return add(Value(static_cast<double>(u)));
  }
  bool number_float(number_float_t d, const string_t&) { return add(Value(static_cast<double>(d))); }
  bool string(string_t& s) { return add(Value(std::move(s))); }
  bool binary(binary_t&) { return fail("binary values are not JSON"); }  // never from text input
  bool start_object(std::size_t) { return open(Value(Object{})); }
  bool start_array(std::size_t) { return open(Value(Array{})); }
  bool key(string_t& k) {
    Frame& f = stack_.back();
    if (f.value.as_object().contains(k)) return fail("duplicate key \"" + k + "\" in " + path());
    f.key = std::move(k);
    return true;
  }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool parse_error(std::size_t position, const std::string&, const nlohmann::detail::exception& e) {
    // nlohmann's message: "[json.exception.parse_error.101] parse error at line L, column C: why".
    // Keep the why; the byte (0-based, the character that failed) replaces line and column.
    std::string_view why = e.what();
    if (auto at = why.find("column "); at != std::string_view::npos)
      if (auto colon = why.find(": ", at); colon != std::string_view::npos) why.remove_prefix(colon + 2);
    error_ = " at byte " + std::to_string(position > 0 ? position - 1 : 0) + ": " + std::string(why);
    return false;
  }

  Value take(bool ok) {
    if (!ok || !error_.empty() || !root_)
      TRELLIS_THROW("invalid JSON in ", what_, error_.empty() ? std::string(": no value") : error_);
    return std::move(*root_);
  }

 private:
  struct Frame {
    Value value;
    std::string key;  // the key of the member being read (objects)
  };

  bool fail(const std::string& why) {
    error_ = ": " + why;
    return false;
  }
  bool add(Value v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return true;
    }
    Frame& f = stack_.back();
    if (f.value.is_array()) f.value.as_array().push_back(std::move(v));
    else f.value.as_object().emplace(std::move(f.key), std::move(v));
    return true;
  }
  bool open(Value container) {
    if (static_cast<int>(stack_.size()) >= max_depth)
      return fail("nesting deeper than " + std::to_string(max_depth) + " levels");
    stack_.push_back(Frame{std::move(container), {}});
    return true;
  }
  bool close() {
    Value done = std::move(stack_.back().value);
    stack_.pop_back();
    return add(std::move(done));
  }
  // Where the parser is, as a JSON pointer ("/a/3"), for our own errors (SAX gives no position).
  std::string path() const {
    std::string p;  // every frame but the innermost names the child being read
    for (std::size_t i = 0; i + 1 < stack_.size(); ++i) {
      const Frame& f = stack_[i];
      p += "/" + (f.value.is_array() ? std::to_string(f.value.as_array().size()) : f.key);
    }
    return p.empty() ? "/" : p;
  }

  std::string_view what_;
  std::vector<Frame> stack_;
  std::optional<Value> root_;
  std::string error_;
};

// Values are at most max_depth deep when parsed; ones built in code are shallow.
inline nlohmann::json to_nlohmann(const Value& v) {
  return std::visit(
      [](const auto& x) -> nlohmann::json {
        using X = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<X, Array>) {
          nlohmann::json a = nlohmann::json::array();
          for (const Value& e : x) a.push_back(to_nlohmann(e));
          return a;
        } else if constexpr (std::is_same_v<X, Object>) {
          nlohmann::json o = nlohmann::json::object();
          for (const auto& [k, e] : x) o[k] = to_nlohmann(e);
          return o;
        } else {
          return nlohmann::json(x);
        }
      },
      v.storage());
}

}  // namespace detail

// Compact by default; indent > 0 pretty-prints (index.json, config.json: files people read). Keys
// come out sorted; doubles in their shortest round-trip form, always with a '.' or an exponent
// (so a double reads back as a double, -0.0 keeps its sign); NaN and infinities as null. A string
// that is not valid UTF-8 is an error (JSON text is UTF-8).
inline std::string dump(const Value& v, int indent = 0) {
  try {
    return detail::to_nlohmann(v).dump(indent > 0 ? indent : -1, ' ', false, nlohmann::json::error_handler_t::strict);
  } catch (const nlohmann::json::exception& e) {
    TRELLIS_THROW("cannot write JSON: ", e.what());
  }
}

// Parses one JSON document (RFC 8259, strict: no comments, no trailing commas, UTF-8); errors name
// `what` (a file or a header) and the byte position, or the path for a duplicate key or too deep
// nesting.
inline Value parse(std::string_view text, std::string_view what = "JSON text") {
  detail::SaxBuilder builder(what);
  const bool ok = nlohmann::json::sax_parse(text, &builder, nlohmann::json::input_format_t::json,
                                            /*strict=*/true, /*ignore_comments=*/false);
  return builder.take(ok);
}

}  // namespace trellis::io::json
