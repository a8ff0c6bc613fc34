// A progress display for training loops. On a terminal: one line redrawn in place
//   [##########----------]  120/500  loss 2.3456  12.3k tok/s  MFU 31.2%  ETA 1:23
// Not a terminal (a log file, CI): plain lines, every `plain_every` steps and at the last step
//   step 120/500 | loss 2.3456 | 12.3k tok/s | MFU 31.2% | elapsed 9.8s | ETA 1:23
// (with ProgressInfo::mfu_blas set, "MFU 31.2% (45.0% of sgemm)": MFU against a measured GEMM rate too)
// The line's text is produced by pure functions (tested); only update() writes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <optional>
#include <ostream>
#include <string>

#include <unistd.h>

#include "trellis/core/error.hpp"

namespace trellis::report {

struct ProgressInfo {
  std::int64_t step = 0;   // steps done so far (1 after the first step)
  std::int64_t total = 0;  // steps in the run
  double loss = 0.0;
  double tokens_per_s = 0.0;
  double mfu = 0.0;        // fraction of peak
  double mfu_blas = 0.0;   // fraction of a measured GEMM rate (shown as "(x% of sgemm)" when > 0)
  double elapsed_s = 0.0;  // since the run (or the resume) started
  std::int64_t first_step = 0;  // step the timing started from (for the ETA after a resume)
  std::optional<double> aux_loss{};  // Mixture-of-Experts models: the load-balancing (+ z) loss
};

// "59s", "1:23" (m:ss), "2:03:04" (h:mm:ss); "?" when unknown.
inline std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<std::int64_t>(std::llround(seconds));
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(s));
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%lld:%02lld", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  else
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  return buf;
}

// "950", "12.3k", "4.56M" (three significant figures).
inline std::string format_rate(double x) {
  char buf[32];
  if (!std::isfinite(x)) return "?";
  if (x < 1e3) std::snprintf(buf, sizeof buf, "%.0f", x);
  else if (x < 1e6) std::snprintf(buf, sizeof buf, x < 1e4 ? "%.2fk" : x < 1e5 ? "%.1fk" : "%.0fk", x / 1e3);
  else std::snprintf(buf, sizeof buf, x < 1e7 ? "%.2fM" : x < 1e8 ? "%.1fM" : "%.0fM", x / 1e6);
  return buf;
}

// Remaining time from the average step time since first_step.
inline double eta_seconds(const ProgressInfo& p) {
  const std::int64_t done = p.step - p.first_step;
  if (done <= 0) return NAN;
  return p.elapsed_s / static_cast<double>(done) * static_cast<double>(p.total - p.step);
}

inline std::string progress_fields(const ProgressInfo& p, const char* sep) {
  char buf[224];
  int n = std::snprintf(buf, sizeof buf, "loss %.4f%s", p.loss, sep);
  if (p.aux_loss && n > 0 && n < static_cast<int>(sizeof buf))
    n += std::snprintf(buf + n, sizeof buf - static_cast<std::size_t>(n), "aux %.4f%s", *p.aux_loss, sep);
  if (n > 0 && n < static_cast<int>(sizeof buf))
    n += std::snprintf(buf + n, sizeof buf - static_cast<std::size_t>(n), "%s tok/s%sMFU %.1f%%",
                       format_rate(p.tokens_per_s).c_str(), sep, 100.0 * p.mfu);
  if (p.mfu_blas > 0 && n > 0 && n < static_cast<int>(sizeof buf))
    std::snprintf(buf + n, sizeof buf - static_cast<std::size_t>(n), " (%.1f%% of sgemm)", 100.0 * p.mfu_blas);
  return buf;
}

// The in-place terminal line (without control characters).
inline std::string progress_bar_line(const ProgressInfo& p, int bar_width = 20) {
  const double frac = p.total > 0 ? std::clamp(static_cast<double>(p.step) / static_cast<double>(p.total), 0.0, 1.0) : 0.0;
  const int filled = static_cast<int>(frac * bar_width);
  std::string bar = "[" + std::string(static_cast<std::size_t>(filled), '#') +
                    std::string(static_cast<std::size_t>(bar_width - filled), '-') + "]";
  const int digits = static_cast<int>(std::to_string(p.total).size());
  char head[64];
  std::snprintf(head, sizeof head, " %*lld/%lld  ", digits, static_cast<long long>(p.step), static_cast<long long>(p.total));
  return bar + head + progress_fields(p, "  ") + "  ETA " + format_duration(eta_seconds(p));
}

// The plain line for logs.
inline std::string progress_plain_line(const ProgressInfo& p) {
  return "step " + std::to_string(p.step) + "/" + std::to_string(p.total) + " | " + progress_fields(p, " | ") +
         " | elapsed " + format_duration(p.elapsed_s) + " | ETA " + format_duration(eta_seconds(p));
}

class ProgressBar {
 public:
  // `terminal` unset: detected with isatty() when `out` is std::cout or std::cerr.
  explicit ProgressBar(std::ostream& out = std::cout, std::optional<bool> terminal = std::nullopt, int plain_every = 10)
      : out_(out), plain_every_(plain_every) {
    TRELLIS_CHECK(plain_every > 0, "ProgressBar: plain_every must be positive, got ", plain_every);
    if (terminal) terminal_ = *terminal;
    else if (&out == &std::cout) terminal_ = ::isatty(STDOUT_FILENO) == 1;
    else if (&out == &std::cerr) terminal_ = ::isatty(STDERR_FILENO) == 1;
    else terminal_ = false;
  }
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  ~ProgressBar() {
    if (drawn_) out_ << '\n' << std::flush;
  }

  bool is_terminal() const { return terminal_; }

  void update(const ProgressInfo& p) {
    if (terminal_) {
      out_ << "\r\x1b[2K" << progress_bar_line(p) << std::flush;  // back to column 0, clear, redraw
      drawn_ = true;
    } else if (p.step % plain_every_ == 0 || p.step == p.total || p.step == p.first_step + 1) {
      out_ << progress_plain_line(p) << '\n' << std::flush;
    }
  }
  // A message above the bar (e.g. a validation result), then the bar again on the next update.
  void message(const std::string& text) {
    if (terminal_ && drawn_) out_ << "\r\x1b[2K";
    out_ << text << '\n' << std::flush;
    drawn_ = false;
  }
  // Ends the in-place line (also done by the destructor).
  void finish() {
    if (drawn_) out_ << '\n' << std::flush;
    drawn_ = false;
  }

 private:
  std::ostream& out_;
  int plain_every_;
  bool terminal_ = false;
  bool drawn_ = false;
};

}  // namespace trellis::report
