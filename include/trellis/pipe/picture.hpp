// Pictures of schedules and runs:
//  - to_svg: one row per rank, F / B / W boxes in three colours (later chunks lighter), the
//    microbatch number in each box, idle time left as grey background so bubbles show;
//  - to_chrome_trace: a timeline as Chrome trace-event JSON (open in https://ui.perfetto.dev or
//    chrome://tracing), one track per rank.
#pragma once

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "trellis/core/error.hpp"
#include "trellis/pipe/schedule.hpp"
#include "trellis/pipe/simulate.hpp"
#include "trellis/pipe/timeline.hpp"

namespace trellis::pipe {

namespace detail {

inline std::string svg_escape(const std::string& in) {
  std::string out;
  for (char c : in) {
    if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '&')
      out += "&amp;";
    else if (c == '"')
      out += "&quot;";
    else
      out += c;
  }
  return out;
}

// F blue, B green, W orange; chunk > 0 in lighter tones.
inline const char* action_colour(ActionKind kind, int chunk) {
  const bool light = chunk > 0;
  switch (kind) {
    case ActionKind::forward:
      return light ? "#a0c4e8" : "#4e79a7";
    case ActionKind::backward_input:
      return light ? "#a8d99c" : "#59a14f";
    case ActionKind::backward_weight:
      return light ? "#f8c58f" : "#f28e2b";
    default:
      return "#999999";
  }
}

inline std::string fixed(double x, int digits = 2) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

}  // namespace detail

// Draws a timeline (simulated or measured). `title` goes above the rows with the bubble fraction.
inline std::string to_svg(const Timeline& t, const std::string& title = "") {
  const int p = std::max(t.stages, 1);
  double t0 = std::numeric_limits<double>::infinity(), t1 = -t0;
  for (const auto& e : t.events)
    if (e.action.is_compute()) {
      t0 = std::min(t0, e.start);
      t1 = std::max(t1, e.end);
    }
  if (!(t1 > t0)) {
    t0 = 0;
    t1 = 1;
  }
  const double left = 70, top = 40, row = 30, width = 1000;
  const double scale = width / (t1 - t0);
  const double height = top + row * p + 40;
  const auto stats = timeline_stats(t);
  std::ostringstream out;
  out << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << left + width + 20 << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"11\">\n";
  out << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  out << "<text x=\"" << left << "\" y=\"20\" font-size=\"14\">" << detail::svg_escape(title)
      << (title.empty() ? "" : "  ") << "bubble " << detail::fixed(100 * stats.bubble_fraction, 1)
      << "%</text>\n";
  for (int r = 0; r < p; ++r) {
    const double y = top + r * row;
    out << "<text x=\"8\" y=\"" << y + row * 0.65 << "\">rank " << r << "</text>\n";
    out << "<rect class=\"idle\" x=\"" << left << "\" y=\"" << y + 2 << "\" width=\"" << width
        << "\" height=\"" << row - 4 << "\" fill=\"#e8e8e8\"/>\n";
  }
  for (const auto& e : t.events) {
    if (!e.action.is_compute()) continue;
    const double x = left + (e.start - t0) * scale, w = std::max((e.end - e.start) * scale, 0.5);
    const double y = top + e.rank * row;
    out << "<rect class=\"" << action_token(e.action, false).substr(0, 1) << "\" x=\"" << detail::fixed(x)
        << "\" y=\"" << y + 2 << "\" width=\"" << detail::fixed(w) << "\" height=\"" << row - 4
        << "\" fill=\"" << detail::action_colour(e.action.kind, e.action.chunk)
        << "\" stroke=\"white\" stroke-width=\"0.5\">"
        << "<title>rank " << e.rank << ": " << detail::svg_escape(describe(e.action)) << "</title></rect>\n";
    if (w >= 9)
      out << "<text x=\"" << detail::fixed(x + w / 2) << "\" y=\"" << y + row * 0.65
          << "\" text-anchor=\"middle\" fill=\"black\">" << e.action.microbatch << "</text>\n";
  }
  const double ly = top + row * p + 20;
  const char* names[] = {"F (forward)", "B (backward input)", "W (backward weight)"};
  const ActionKind kinds[] = {ActionKind::forward, ActionKind::backward_input, ActionKind::backward_weight};
  for (int i = 0; i < 3; ++i) {
    const double lx = left + i * 170;
    out << "<rect x=\"" << lx << "\" y=\"" << ly - 10 << "\" width=\"12\" height=\"12\" fill=\""
        << detail::action_colour(kinds[i], 0) << "\"/><text x=\"" << lx + 16 << "\" y=\"" << ly << "\">"
        << names[i] << "</text>\n";
  }
  out << "<text x=\"" << left + 3 * 170 << "\" y=\"" << ly << "\">lighter: chunk &gt; 0; grey: idle</text>\n";
  out << "</svg>\n";
  return out.str();
}

// Draws a schedule as the simulator runs it with the given costs.
inline std::string to_svg(const Schedule& s, const Costs& costs = {}) {
  auto sim = simulate(s, costs);
  return to_svg(sim.timeline, s.name + " (p=" + std::to_string(s.stages) + ", m=" +
                                  std::to_string(s.microbatches) + ", v=" + std::to_string(s.chunks) + ")");
}

// Chrome trace-event JSON: complete events ("ph":"X") in microseconds, pid 0, one tid per rank.
// Timeline times are taken as seconds.
inline std::string to_chrome_trace(const Timeline& t) {
  std::ostringstream out;
  out << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  bool first = true;
  for (int r = 0; r < t.stages; ++r) {
    out << (first ? "" : ",\n") << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": 0, \"tid\": " << r
        << ", \"args\": {\"name\": \"rank " << r << "\"}}";
    first = false;
  }
  for (const auto& e : t.events) {
    const char* cat = e.action.kind == ActionKind::forward           ? "F"
                      : e.action.kind == ActionKind::backward_input  ? "B"
                      : e.action.kind == ActionKind::backward_weight ? "W"
                      : e.action.kind == ActionKind::send            ? "send"
                                                                     : "recv";
    out << (first ? "" : ",\n") << "{\"name\": \"" << action_token(e.action) << "\", \"cat\": \"" << cat
        << "\", \"ph\": \"X\", \"pid\": 0, \"tid\": " << e.rank
        << ", \"ts\": " << detail::fixed(e.start * 1e6, 3)
        << ", \"dur\": " << detail::fixed((e.end - e.start) * 1e6, 3)
        << ", \"args\": {\"microbatch\": " << e.action.microbatch << ", \"chunk\": " << e.action.chunk
        << "}}";
    first = false;
  }
  out << "\n]}\n";
  return out.str();
}

inline void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  if (!out) TRELLIS_THROW("pipe: cannot open '", path, "' for writing");
  out << text;
  if (!out) TRELLIS_THROW("pipe: writing '", path, "' failed");
}

}  // namespace trellis::pipe
