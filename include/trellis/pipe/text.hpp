// The schedule text format (grammar in docs/pipe.md): one line per rank, in rank order, e.g.
//
//   # 1F1B, 2 ranks, 3 microbatches
//   @ name=mine placement=loop backward=full
//   F0 F1 B0 W0 F2 B1 W1 B2 W2
//   F0 B0 W0 F1 B1 W1 F2 B2 W2
//
// Tokens: F|B|W <mb>[.<chunk>] for compute; Sa|Sg <mb>[.<chunk>]><peer> to send an activation /
// gradient; Ra|Rg <mb>[.<chunk>]<<peer> to receive one. When no line holds a send/recv the
// communication is inserted automatically (insert_communication). '#' starts a comment.
// to_text() writes a schedule so that parse_schedule(to_text(s)) == s; load_schedule/save_schedule
// do the same with files.
#pragma once

#include <cctype>
#include <cstddef>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/pipe/schedule.hpp"

namespace trellis::pipe {

namespace detail {

[[noreturn]] inline void text_error(int line, std::size_t column, const std::string& msg) {
  TRELLIS_THROW("schedule text, line ", line, ", column ", column + 1, ": ", msg);
}

// Reads a non-negative integer at text[pos]; advances pos.
inline int read_int(std::string_view text, std::size_t& pos, int line, const char* what) {
  const std::size_t start = pos;
  long long value = 0;
  while (pos < text.size() && std::isdigit(static_cast<unsigned char>(text[pos]))) {
    value = value * 10 + (text[pos] - '0');
    if (value > 1'000'000'000) text_error(line, start, std::string(what) + " is too large");
    ++pos;
  }
  if (pos == start) {
    std::string got = pos < text.size() ? std::string("'") + text[pos] + "'" : "the end of the line";
    text_error(line, start, std::string("expected ") + what + ", got " + got);
  }
  return static_cast<int>(value);
}

inline bool parse_flag(std::string_view value, std::string_view yes, std::string_view no, int line,
                       std::size_t col, std::string_view key) {
  if (value == yes) return true;
  if (value == no) return false;
  text_error(line, col,
             std::string(key) + " must be '" + std::string(yes) + "' or '" + std::string(no) + "', got '" +
                 std::string(value) + "'");
}

}  // namespace detail

inline Schedule parse_schedule(std::string_view text) {
  Schedule s;
  s.name = "text";
  int header_stages = -1, header_microbatches = -1, header_chunks = -1;
  int header_line = 0;
  std::vector<int> rank_lines;  // source line of each rank
  bool any_comm = false;
  int max_mb = -1, max_chunk = -1;

  int line_no = 0;
  std::size_t begin = 0;
  while (begin <= text.size()) {
    std::size_t end = text.find('\n', begin);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(begin, end - begin);
    ++line_no;
    if (auto hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    std::size_t pos = 0;
    auto skip_space = [&] {
      while (pos < line.size() && std::isspace(static_cast<unsigned char>(line[pos]))) ++pos;
    };
    skip_space();
    if (pos < line.size() && line[pos] == '@') {
      if (!s.ranks.empty())
        detail::text_error(line_no, pos, "the '@' header must come before the rank lines");
      header_line = line_no;
      ++pos;
      for (skip_space(); pos < line.size(); skip_space()) {
        const std::size_t key_at = pos;
        while (pos < line.size() && line[pos] != '=' && !std::isspace(static_cast<unsigned char>(line[pos])))
          ++pos;
        std::string_view key = line.substr(key_at, pos - key_at);
        if (pos >= line.size() || line[pos] != '=')
          detail::text_error(line_no, pos, "expected '=' after header key '" + std::string(key) + "'");
        ++pos;
        const std::size_t value_at = pos;
        while (pos < line.size() && !std::isspace(static_cast<unsigned char>(line[pos]))) ++pos;
        std::string_view value = line.substr(value_at, pos - value_at);
        if (value.empty())
          detail::text_error(line_no, value_at, "empty value for '" + std::string(key) + "'");
        if (key == "name") {
          s.name = std::string(value);
        } else if (key == "stages" || key == "microbatches" || key == "chunks") {
          std::size_t q = 0;
          int n = detail::read_int(value, q, line_no, "a number");
          if (q != value.size())
            detail::text_error(line_no, value_at + q, "trailing characters after the number");
          (key == "stages" ? header_stages : key == "microbatches" ? header_microbatches : header_chunks) = n;
        } else if (key == "placement") {
          s.placement = detail::parse_flag(value, "vee", "loop", line_no, value_at, key) ? Placement::vee
                                                                                         : Placement::loop;
        } else if (key == "loss") {
          s.local_learning = detail::parse_flag(value, "local", "last", line_no, value_at, key);
        } else if (key == "backward") {
          s.full_backward = detail::parse_flag(value, "full", "split", line_no, value_at, key);
        } else {
          detail::text_error(line_no, key_at,
                             "unknown header key '" + std::string(key) +
                                 "' (known: name, stages, microbatches, chunks, placement, loss, backward)");
        }
      }
    } else if (pos < line.size()) {
      std::vector<Action> actions;
      for (; pos < line.size(); skip_space()) {
        const std::size_t at = pos;
        Action a;
        const char c0 = line[pos];
        if (c0 == 'F' || c0 == 'B' || c0 == 'W') {
          a.kind = c0 == 'F'   ? ActionKind::forward
                   : c0 == 'B' ? ActionKind::backward_input
                               : ActionKind::backward_weight;
          ++pos;
        } else if ((c0 == 'S' || c0 == 'R') && pos + 1 < line.size() &&
                   (line[pos + 1] == 'a' || line[pos + 1] == 'g')) {
          a.kind = c0 == 'S' ? ActionKind::send : ActionKind::recv;
          a.direction = line[pos + 1] == 'a' ? Direction::activation : Direction::gradient;
          pos += 2;
          any_comm = true;
        } else {
          std::size_t e = pos;
          while (e < line.size() && !std::isspace(static_cast<unsigned char>(line[e]))) ++e;
          detail::text_error(line_no, at,
                             "unknown action '" + std::string(line.substr(at, e - at)) +
                                 "' (expected F, B, W, Sa, Sg, Ra or Rg followed by a microbatch)");
        }
        a.microbatch = detail::read_int(line, pos, line_no, "a microbatch number");
        if (pos < line.size() && line[pos] == '.') {
          ++pos;
          a.chunk = detail::read_int(line, pos, line_no, "a chunk number");
        }
        if (a.is_comm()) {
          const char arrow = a.kind == ActionKind::send ? '>' : '<';
          if (pos >= line.size() || line[pos] != arrow)
            detail::text_error(line_no, pos,
                               std::string("expected '") + arrow + "' and the peer rank after " +
                                   (a.kind == ActionKind::send ? "a send" : "a recv"));
          ++pos;
          a.peer = detail::read_int(line, pos, line_no, "a peer rank");
        }
        if (pos < line.size() && !std::isspace(static_cast<unsigned char>(line[pos])))
          detail::text_error(line_no, pos,
                             std::string("unexpected '") + line[pos] + "' after action '" +
                                 std::string(line.substr(at, pos - at)) + "'");
        max_mb = std::max(max_mb, a.microbatch);
        max_chunk = std::max(max_chunk, a.chunk);
        actions.push_back(a);
      }
      s.ranks.push_back(std::move(actions));
      rank_lines.push_back(line_no);
    }
    if (end == text.size()) break;
    begin = end + 1;
  }

  if (s.ranks.empty()) detail::text_error(line_no, 0, "no rank lines (one line of actions per rank)");
  s.stages = static_cast<int>(s.ranks.size());
  if (header_stages >= 0 && header_stages != s.stages)
    detail::text_error(header_line, 0,
                       "the header says stages=" + std::to_string(header_stages) + " but there are " +
                           std::to_string(s.stages) + " rank lines");
  s.microbatches = header_microbatches >= 0 ? header_microbatches : max_mb + 1;
  s.chunks = header_chunks >= 0 ? header_chunks : (s.placement == Placement::vee ? 2 : max_chunk + 1);
  if (!any_comm && s.chunks >= 1 && s.microbatches >= 1 && (s.placement != Placement::vee || s.chunks == 2))
    s = insert_communication(std::move(s));
  return s;
}

struct TextOptions {
  bool with_communication = true;  // false: compute actions only (parse re-inserts them)
};

inline std::string to_text(const Schedule& s, const TextOptions& options = {}) {
  std::ostringstream out;
  out << "# " << s.name << ": " << s.stages << " ranks, " << s.microbatches << " microbatches, " << s.chunks
      << " chunk(s) per rank\n";
  out << "@ name=" << (s.name.empty() ? "unnamed" : s.name) << " stages=" << s.stages
      << " microbatches=" << s.microbatches << " chunks=" << s.chunks
      << " placement=" << (s.placement == Placement::vee ? "vee" : "loop")
      << " loss=" << (s.local_learning ? "local" : "last")
      << " backward=" << (s.full_backward ? "full" : "split") << "\n";
  for (const auto& list : s.ranks) {
    bool first = true;
    for (const auto& a : list) {
      if (!options.with_communication && a.is_comm()) continue;
      out << (first ? "" : " ") << action_token(a, s.chunks > 1);
      first = false;
    }
    out << "\n";
  }
  return out.str();
}

// Reads a schedule file in the text format (errors name the file, line and column).
inline Schedule load_schedule(const std::string& path) {
  std::ifstream in(path);
  if (!in) TRELLIS_THROW("load_schedule: cannot open '", path, "'");
  std::stringstream text;
  text << in.rdbuf();
  try {
    Schedule s = parse_schedule(text.str());
    return s;
  } catch (const Error& e) {
    TRELLIS_THROW("load_schedule '", path, "': ", e.message());
  }
}

inline void save_schedule(const std::string& path, const Schedule& s, const TextOptions& options = {}) {
  std::ofstream out(path);
  if (!out) TRELLIS_THROW("save_schedule: cannot open '", path, "' for writing");
  out << to_text(s, options);
  if (!out) TRELLIS_THROW("save_schedule: writing '", path, "' failed");
}

inline bool same_schedule(const Schedule& a, const Schedule& b) {
  return a.name == b.name && a.stages == b.stages && a.microbatches == b.microbatches &&
         a.chunks == b.chunks && a.placement == b.placement && a.local_learning == b.local_learning &&
         a.full_backward == b.full_backward && a.ranks == b.ranks;
}

}  // namespace trellis::pipe
