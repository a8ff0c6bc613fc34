// Shared helpers for benchmark programs: wall-clock timing, nccl-tests-style tables and a small
// JSON writer for --json FILE. Kept outside include/ on purpose: it is not library API.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace trellis::bench {

inline double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

// Runs fn `warmup` times, then `iters` times; returns the mean seconds per call.
template <class Fn>
double time_mean(Fn&& fn, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  double t0 = now_seconds();
  for (int i = 0; i < iters; ++i) fn();
  return (now_seconds() - t0) / iters;
}

// Runs fn `warmup` times then `iters` timed repetitions; returns the minimum (least noisy on a
// shared machine) and the median.
template <class Fn>
std::pair<double, double> time_min_median(Fn&& fn, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    double t0 = now_seconds();
    fn();
    t.push_back(now_seconds() - t0);
  }
  std::sort(t.begin(), t.end());
  return {t.front(), t[t.size() / 2]};
}

// Runs every function `warmup` times, then `iters` rounds of one call each, in turn (round robin),
// so a change of machine load between rounds touches every side alike; returns each function's
// minimum and median seconds.
template <class Fn>
std::vector<std::pair<double, double>> time_round_robin(std::vector<Fn>& fns, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i)
    for (auto& fn : fns) fn();
  std::vector<std::vector<double>> t(fns.size());
  for (int i = 0; i < iters; ++i)
    for (std::size_t k = 0; k < fns.size(); ++k) {
      const double t0 = now_seconds();
      fns[k]();
      t[k].push_back(now_seconds() - t0);
    }
  std::vector<std::pair<double, double>> out;
  for (auto& v : t) {
    std::sort(v.begin(), v.end());
    out.emplace_back(v.front(), v[v.size() / 2]);
  }
  return out;
}

// One row of results: ordered key -> value (numbers or strings), printed and written as JSON.
struct Row {
  std::vector<std::pair<std::string, std::string>> fields;
  Row& add(const std::string& key, double value, const char* fmt = "%.3f") {
    char buf[64];
    std::snprintf(buf, sizeof buf, fmt, value);
    fields.emplace_back(key, buf);
    return *this;
  }
  Row& add(const std::string& key, long long value) { return add(key, static_cast<double>(value), "%.0f"); }
  Row& add_text(const std::string& key, const std::string& value) {
    fields.emplace_back(key, "\"" + value + "\"");
    return *this;
  }
};

// Collects rows and writes them as a JSON array of objects: {"bench": name, "rows": [...]}.
class JsonReport {
 public:
  explicit JsonReport(std::string name) : name_(std::move(name)) {}
  void add(const Row& row) { rows_.push_back(row); }
  void write(const std::string& path) const {
    if (path.empty()) return;
    std::ofstream out(path);
    out << "{\"bench\": \"" << name_ << "\", \"rows\": [\n";
    for (std::size_t i = 0; i < rows_.size(); ++i) {
      out << "  {";
      for (std::size_t j = 0; j < rows_[i].fields.size(); ++j) {
        const auto& [k, v] = rows_[i].fields[j];
        out << (j ? ", " : "") << "\"" << k << "\": " << v;
      }
      out << "}" << (i + 1 < rows_.size() ? ",\n" : "\n");
    }
    out << "]}\n";
  }

 private:
  std::string name_;
  std::vector<Row> rows_;
};

// The value after `flag` in argv ("--iters 5"), or `fallback`.
inline std::string flag_value(int argc, char** argv, const char* flag, const std::string& fallback = {}) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], flag) == 0) return argv[i + 1];
  return fallback;
}
inline long long int_flag(int argc, char** argv, const char* flag, long long fallback) {
  const std::string v = flag_value(argc, argv, flag);
  return v.empty() ? fallback : std::atoll(v.c_str());
}
inline double double_flag(int argc, char** argv, const char* flag, double fallback) {
  const std::string v = flag_value(argc, argv, flag);
  return v.empty() ? fallback : std::atof(v.c_str());
}

// Returns the value after `--json` in argv, or "".
inline std::string json_path(int argc, char** argv) { return flag_value(argc, argv, "--json"); }

inline bool has_flag(int argc, char** argv, const char* flag) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], flag) == 0) return true;
  return false;
}

}  // namespace trellis::bench
