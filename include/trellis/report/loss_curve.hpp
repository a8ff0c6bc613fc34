// Loss curves as a standalone SVG: train and validation loss against step, with axes, "nice"
// ticks (1/2/5 x 10^k), grid, axis labels, a title and a legend. No dependencies; opens in any
// browser, converts with rsvg-convert or ImageMagick.
//   write_loss_curve_svg("loss.svg", train_points, val_points, {.title = "GPT-2 small, dp=2 tp=2"});
// train::loss_curves_from_metrics() (train/metrics.hpp) reads the points out of a metrics.jsonl.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "trellis/io/atomic_file.hpp"

namespace trellis::report {

struct CurvePoint {
  double step = 0;
  double loss = 0;
};

struct LossCurveOptions {
  std::string title = "Loss";
  std::string x_label = "step";
  std::string y_label = "loss (nats/token)";
  int width = 800;
  int height = 480;
  std::optional<double> baseline;  // a horizontal reference line (e.g. the unigram baseline)
  std::string baseline_label = "unigram baseline";
};

namespace detail {
inline std::string xml_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

// Tick spacing 1, 2 or 5 x 10^k giving about `target` intervals over [lo, hi].
inline double nice_step(double lo, double hi, int target = 5) {
  const double raw = (hi - lo) / target;
  if (!(raw > 0) || !std::isfinite(raw)) return 1.0;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double n = raw / mag;
  return (n < 1.5 ? 1.0 : n < 3.0 ? 2.0 : n < 7.0 ? 5.0 : 10.0) * mag;
}

inline std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}
inline std::string tick_label(double x, double step) {
  if (std::abs(x) < step * 1e-9) x = 0;
  if (step >= 1 && std::abs(x) < 1e7) return fmt("%.0f", x);
  const int decimals = std::clamp(static_cast<int>(-std::floor(std::log10(step))), 0, 8);
  char f[16];
  std::snprintf(f, sizeof f, "%%.%df", decimals);
  return fmt(f, x);
}
}  // namespace detail

inline std::string loss_curve_svg(std::span<const CurvePoint> train, std::span<const CurvePoint> val,
                                  const LossCurveOptions& o = {}) {
  auto finite = [](const CurvePoint& p) { return std::isfinite(p.step) && std::isfinite(p.loss); };
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (auto series : {train, val})
    for (const auto& p : series)
      if (finite(p)) {
        x0 = std::min(x0, p.step);
        x1 = std::max(x1, p.step);
        y0 = std::min(y0, p.loss);
        y1 = std::max(y1, p.loss);
      }
  if (o.baseline && std::isfinite(*o.baseline)) {
    y0 = std::min(y0, *o.baseline);
    y1 = std::max(y1, *o.baseline);
  }
  if (!(x0 <= x1)) x0 = 0, x1 = 1;  // no data: an empty frame
  if (!(y0 <= y1)) y0 = 0, y1 = 1;
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) y0 -= 0.5, y1 += 0.5;
  const double xs = detail::nice_step(x0, x1), ys = detail::nice_step(y0, y1);
  x0 = std::floor(x0 / xs) * xs, x1 = std::ceil(x1 / xs) * xs;
  y0 = std::floor(y0 / ys) * ys, y1 = std::ceil(y1 / ys) * ys;

  const double left = 75, right = 25, top = 45, bottom = 55;
  const double pw = o.width - left - right, ph = o.height - top - bottom;
  auto px = [&](double x) { return left + (x - x0) / (x1 - x0) * pw; };
  auto py = [&](double y) { return top + (y1 - y) / (y1 - y0) * ph; };

  std::string s;
  s += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  s += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + std::to_string(o.width) + "\" height=\"" +
       std::to_string(o.height) + "\" viewBox=\"0 0 " + std::to_string(o.width) + " " + std::to_string(o.height) +
       "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n";
  s += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  s += "<text x=\"" + detail::fmt("%.1f", left + pw / 2) + "\" y=\"26\" text-anchor=\"middle\" font-size=\"16\" font-weight=\"bold\">" +
       detail::xml_escape(o.title) + "</text>\n";
  // Grid and ticks.
  s += "<g class=\"grid\" stroke=\"#dddddd\" stroke-width=\"1\">\n";
  for (double x = x0; x <= x1 + xs * 1e-9; x += xs)
    s += "<line x1=\"" + detail::fmt("%.1f", px(x)) + "\" y1=\"" + detail::fmt("%.1f", top) + "\" x2=\"" +
         detail::fmt("%.1f", px(x)) + "\" y2=\"" + detail::fmt("%.1f", top + ph) + "\"/>\n";
  for (double y = y0; y <= y1 + ys * 1e-9; y += ys)
    s += "<line x1=\"" + detail::fmt("%.1f", left) + "\" y1=\"" + detail::fmt("%.1f", py(y)) + "\" x2=\"" +
         detail::fmt("%.1f", left + pw) + "\" y2=\"" + detail::fmt("%.1f", py(y)) + "\"/>\n";
  s += "</g>\n<g class=\"ticks\" fill=\"#333333\">\n";
  for (double x = x0; x <= x1 + xs * 1e-9; x += xs)
    s += "<text x=\"" + detail::fmt("%.1f", px(x)) + "\" y=\"" + detail::fmt("%.1f", top + ph + 18) +
         "\" text-anchor=\"middle\">" + detail::tick_label(x, xs) + "</text>\n";
  for (double y = y0; y <= y1 + ys * 1e-9; y += ys)
    s += "<text x=\"" + detail::fmt("%.1f", left - 8) + "\" y=\"" + detail::fmt("%.1f", py(y) + 4) +
         "\" text-anchor=\"end\">" + detail::tick_label(y, ys) + "</text>\n";
  s += "</g>\n";
  // Axes and labels.
  s += "<rect class=\"axes\" x=\"" + detail::fmt("%.1f", left) + "\" y=\"" + detail::fmt("%.1f", top) + "\" width=\"" +
       detail::fmt("%.1f", pw) + "\" height=\"" + detail::fmt("%.1f", ph) + "\" fill=\"none\" stroke=\"black\"/>\n";
  s += "<text x=\"" + detail::fmt("%.1f", left + pw / 2) + "\" y=\"" + std::to_string(o.height - 12) +
       "\" text-anchor=\"middle\" font-size=\"13\">" + detail::xml_escape(o.x_label) + "</text>\n";
  s += "<text transform=\"translate(18," + detail::fmt("%.1f", top + ph / 2) +
       ") rotate(-90)\" text-anchor=\"middle\" font-size=\"13\">" + detail::xml_escape(o.y_label) + "</text>\n";
  // Series.
  auto polyline = [&](std::span<const CurvePoint> pts, const char* cls, const char* color, double width) {
    std::string points;
    for (const auto& p : pts)
      if (finite(p)) points += detail::fmt("%.2f", px(p.step)) + "," + detail::fmt("%.2f", py(p.loss)) + " ";
    if (!points.empty())
      s += std::string("<polyline class=\"") + cls + "\" fill=\"none\" stroke=\"" + color + "\" stroke-width=\"" +
           detail::fmt("%.1f", width) + "\" stroke-linejoin=\"round\" points=\"" + points + "\"/>\n";
  };
  if (o.baseline && std::isfinite(*o.baseline))
    s += "<line class=\"baseline\" x1=\"" + detail::fmt("%.1f", left) + "\" x2=\"" + detail::fmt("%.1f", left + pw) +
         "\" y1=\"" + detail::fmt("%.2f", py(*o.baseline)) + "\" y2=\"" + detail::fmt("%.2f", py(*o.baseline)) +
         "\" stroke=\"#777777\" stroke-width=\"1.2\" stroke-dasharray=\"6,4\"/>\n";
  polyline(train, "train", "#1f77b4", 1.5);
  polyline(val, "val", "#ff7f0e", 2.0);
  for (const auto& p : val)
    if (finite(p))
      s += "<circle class=\"val-point\" cx=\"" + detail::fmt("%.2f", px(p.step)) + "\" cy=\"" + detail::fmt("%.2f", py(p.loss)) +
           "\" r=\"3\" fill=\"#ff7f0e\"/>\n";
  // Legend (top right, inside the plot).
  struct Entry {
    std::string label;
    const char* color;
    const char* dash;
  };
  std::vector<Entry> legend;
  if (!train.empty()) legend.push_back({"train", "#1f77b4", ""});
  if (!val.empty()) legend.push_back({"validation", "#ff7f0e", ""});
  if (o.baseline && std::isfinite(*o.baseline)) legend.push_back({o.baseline_label, "#777777", "6,4"});
  if (!legend.empty()) {
    const double lw = 170, lh = 8 + 18.0 * static_cast<double>(legend.size());
    const double lx = left + pw - lw - 10, ly = top + 10;
    s += "<g class=\"legend\">\n<rect x=\"" + detail::fmt("%.1f", lx) + "\" y=\"" + detail::fmt("%.1f", ly) + "\" width=\"" +
         detail::fmt("%.1f", lw) + "\" height=\"" + detail::fmt("%.1f", lh) +
         "\" fill=\"white\" fill-opacity=\"0.9\" stroke=\"#999999\"/>\n";
    for (std::size_t i = 0; i < legend.size(); ++i) {
      const double y = ly + 16 + 18.0 * static_cast<double>(i);
      s += "<line x1=\"" + detail::fmt("%.1f", lx + 8) + "\" x2=\"" + detail::fmt("%.1f", lx + 36) + "\" y1=\"" +
           detail::fmt("%.1f", y - 4) + "\" y2=\"" + detail::fmt("%.1f", y - 4) + "\" stroke=\"" + legend[i].color +
           "\" stroke-width=\"2\"" + (*legend[i].dash ? std::string(" stroke-dasharray=\"") + legend[i].dash + "\"" : "") + "/>\n";
      s += "<text x=\"" + detail::fmt("%.1f", lx + 44) + "\" y=\"" + detail::fmt("%.1f", y) + "\">" +
           detail::xml_escape(legend[i].label) + "</text>\n";
    }
    s += "</g>\n";
  }
  s += "</svg>\n";
  return s;
}

inline void write_loss_curve_svg(const std::filesystem::path& path, std::span<const CurvePoint> train,
                                 std::span<const CurvePoint> val, const LossCurveOptions& o = {}) {
  io::write_file_atomically(path, loss_curve_svg(train, val, o));
}

}  // namespace trellis::report
