// A small JSON value with a strict parser and a deterministic writer: enough for safetensors
// headers, checkpoint indexes and metrics lines without a third-party dependency (see
// docs/checkpoint.md for why). Integers are kept exactly as int64 (file offsets, shapes); other
// numbers are doubles, written in their shortest round-trip form; non-finite doubles are written
// as null (JSON has no NaN).
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

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

// ---- writer ------------------------------------------------------------------------------------
inline void write_string(std::string& out, std::string_view s) {
  out += '"';
  for (char c : s) {
    auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (u < 0x20) {
          static constexpr char hex[] = "0123456789abcdef";
          out += "\\u00";
          out += hex[u >> 4];
          out += hex[u & 15];
        } else {
          out += c;  // UTF-8 passes through unchanged
        }
    }
  }
  out += '"';
}

inline void write_number(std::string& out, double d) {
  if (!std::isfinite(d)) {
    out += "null";
    return;
  }
  if (d == 0 && std::signbit(d)) {  // "-0" would read back as the integer 0, losing the sign
    out += "-0.0";
    return;
  }
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d);  // shortest form that reads back exactly
  out.append(buf, r.ptr);
}

// Compact by default; indent > 0 pretty-prints (used for index.json, which people read).
inline void write(std::string& out, const Value& v, int indent = 0, int depth = 0) {
  auto newline = [&](int d) {
    if (indent <= 0) return;
    out += '\n';
    out.append(static_cast<std::size_t>(indent * d), ' ');
  };
  std::visit(
      [&](const auto& x) {
        using X = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<X, std::nullptr_t>) {
          out += "null";
        } else if constexpr (std::is_same_v<X, bool>) {
          out += x ? "true" : "false";
        } else if constexpr (std::is_same_v<X, std::int64_t>) {
          out += std::to_string(x);
        } else if constexpr (std::is_same_v<X, double>) {
          write_number(out, x);
        } else if constexpr (std::is_same_v<X, std::string>) {
          write_string(out, x);
        } else if constexpr (std::is_same_v<X, Array>) {
          // Arrays of scalars stay on one line (shapes, offsets) even when pretty-printing.
          bool flat = true;
          for (const auto& e : x) flat = flat && !e.is_array() && !e.is_object();
          out += '[';
          for (std::size_t i = 0; i < x.size(); ++i) {
            if (i) out += indent > 0 && flat ? ", " : ",";
            if (!flat) newline(depth + 1);
            write(out, x[i], indent, depth + 1);
          }
          if (!flat && !x.empty()) newline(depth);
          out += ']';
        } else {
          out += '{';
          bool first = true;
          for (const auto& [k, e] : x) {
            if (!first) out += ',';
            first = false;
            newline(depth + 1);
            write_string(out, k);
            out += indent > 0 ? ": " : ":";
            write(out, e, indent, depth + 1);
          }
          if (!x.empty()) newline(depth);
          out += '}';
        }
      },
      v.storage());
}

inline std::string dump(const Value& v, int indent = 0) {
  std::string out;
  write(out, v, indent);
  return out;
}

// ---- parser ------------------------------------------------------------------------------------
namespace detail {
class Parser {
 public:
  Parser(std::string_view text, std::string_view what) : s_(text), what_(what) {}

  Value parse_document() {
    Value v = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("trailing characters after the JSON value");
    return v;
  }

 private:
  static constexpr int max_depth = 64;

  [[noreturn]] void fail(std::string_view why) const {
    TRELLIS_THROW("invalid JSON in ", what_, " at byte ", pos_, ": ", why);
  }
  void skip_ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  char peek() {
    skip_ws();
    if (pos_ >= s_.size()) fail("unexpected end of input");
    return s_[pos_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }
  bool consume_literal(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) == lit) {
      pos_ += lit.size();
      return true;
    }
    return false;
  }

  Value parse_value(int depth) {
    if (depth > max_depth) fail("nesting too deep");
    char c = peek();
    if (c == '{') return parse_object(depth);
    if (c == '[') return parse_array(depth);
    if (c == '"') return Value(parse_string());
    if (consume_literal("true")) return Value(true);
    if (consume_literal("false")) return Value(false);
    if (consume_literal("null")) return Value(nullptr);
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
    fail(std::string("unexpected character '") + c + "'");
  }

  Value parse_object(int depth) {
    expect('{');
    Object o;
    if (peek() == '}') {
      ++pos_;
      return Value(std::move(o));
    }
    while (true) {
      if (peek() != '"') fail("expected a string key");
      std::string key = parse_string();
      expect(':');
      Value v = parse_value(depth + 1);
      if (!o.emplace(std::move(key), std::move(v)).second) fail("duplicate key");
      char c = peek();
      ++pos_;
      if (c == '}') break;
      if (c != ',') fail("expected ',' or '}'");
    }
    return Value(std::move(o));
  }

  Value parse_array(int depth) {
    expect('[');
    Array a;
    if (peek() == ']') {
      ++pos_;
      return Value(std::move(a));
    }
    while (true) {
      a.push_back(parse_value(depth + 1));
      char c = peek();
      ++pos_;
      if (c == ']') break;
      if (c != ',') fail("expected ',' or ']'");
    }
    return Value(std::move(a));
  }

  Value parse_number() {
    std::size_t start = pos_;
    if (s_[pos_] == '-') ++pos_;
    if (pos_ >= s_.size() || s_[pos_] < '0' || s_[pos_] > '9') fail("malformed number");
    if (s_[pos_] == '0' && pos_ + 1 < s_.size() && s_[pos_ + 1] >= '0' && s_[pos_ + 1] <= '9')
      fail("leading zero in number");
    bool integral = true;
    while (pos_ < s_.size()) {
      char c = s_[pos_];
      if (c >= '0' && c <= '9') {
        ++pos_;
      } else if (c == '.' || c == 'e' || c == 'E' || c == '+' || (c == '-' && pos_ > start)) {
        integral = false;
        ++pos_;
      } else {
        break;
      }
    }
    std::string_view text = s_.substr(start, pos_ - start);
    if (integral) {
      std::int64_t i = 0;
      auto r = std::from_chars(text.data(), text.data() + text.size(), i);
      if (r.ec == std::errc() && r.ptr == text.data() + text.size()) return Value(i);
    }
    double d = 0;
    auto r = std::from_chars(text.data(), text.data() + text.size(), d);
    if (r.ec != std::errc() || r.ptr != text.data() + text.size()) fail("malformed number");
    return Value(d);
  }

  unsigned parse_hex4() {
    if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; ++i) {
      char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<unsigned>(c - 'A' + 10);
      else fail("bad hex digit in \\u escape");
    }
    return v;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  std::string parse_string() {
    expect('"');
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      char c = s_[pos_++];
      if (c == '"') break;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated escape");
      char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = parse_hex4();
          if (cp >= 0xd800 && cp < 0xdc00) {  // high surrogate: a low one must follow
            if (!consume_literal("\\u")) fail("lone high surrogate");
            unsigned lo = parse_hex4();
            if (lo < 0xdc00 || lo >= 0xe000) fail("bad low surrogate");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          } else if (cp >= 0xdc00 && cp < 0xe000) {
            fail("lone low surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("unknown escape");
      }
    }
    return out;
  }

  std::string_view s_;
  std::string_view what_;
  std::size_t pos_ = 0;
};
}  // namespace detail

// Parses one JSON document; errors name `what` (a file or a header) and the byte position.
inline Value parse(std::string_view text, std::string_view what = "JSON text") {
  return detail::Parser(text, what).parse_document();
}

}  // namespace trellis::io::json
