// trellis::Error and the TRELLIS_CHECK macros. Library code throws; only examples and tests print
// and exit. The rank of the calling thread is attached when a communicator has set it.
#pragma once

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace trellis {

namespace detail {
// Set by communicator backends on every rank's thread so that errors raised anywhere below can
// name the rank. -1 means "unknown" (outside any rank).
inline int& current_rank_slot() {
  thread_local int rank = -1;
  return rank;
}
}  // namespace detail

inline int current_rank() { return detail::current_rank_slot(); }

// Sets the calling thread's rank for error messages and restores the previous one on scope exit.
class RankScope {
 public:
  explicit RankScope(int rank) : previous_(detail::current_rank_slot()) {
    detail::current_rank_slot() = rank;
  }
  ~RankScope() { detail::current_rank_slot() = previous_; }
  RankScope(const RankScope&) = delete;
  RankScope& operator=(const RankScope&) = delete;

 private:
  int previous_;
};

class Error : public std::runtime_error {
 public:
  Error(std::string message, const char* file = "", int line = 0, int rank = current_rank())
      : std::runtime_error(format(message, file, line, rank)),
        message_(std::move(message)),
        file_(file),
        line_(line),
        rank_(rank) {}

  // The bare message, without location or rank.
  const std::string& message() const noexcept { return message_; }
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }
  // The rank that raised the error, or -1 when it was raised outside any rank.
  int rank() const noexcept { return rank_; }

 private:
  static std::string format(const std::string& message, const char* file, int line, int rank) {
    std::ostringstream out;
    out << "trellis: ";
    if (rank >= 0) out << "[rank " << rank << "] ";
    out << message;
    if (file && *file) out << " (" << file << ":" << line << ")";
    return out.str();
  }

  std::string message_;
  const char* file_;
  int line_;
  int rank_;
};

namespace detail {
// Streams any number of values into one string; used by the check macros for their messages.
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

[[noreturn]] inline void throw_error(const std::string& message, const char* file, int line) {
  throw Error(message, file, line);
}
}  // namespace detail

}  // namespace trellis

// Throws trellis::Error carrying the streamed message, file:line and the current rank.
#define TRELLIS_THROW(...) \
  ::trellis::detail::throw_error(::trellis::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

// Checks a condition that protects data (never compiled out, unlike assert).
#define TRELLIS_CHECK(cond, ...)                                                            \
  do {                                                                                      \
    if (!(cond)) [[unlikely]] {                                                             \
      ::trellis::detail::throw_error(                                                       \
          ::trellis::detail::concat("check failed: " #cond " -- " __VA_OPT__(, ) __VA_ARGS__), \
          __FILE__, __LINE__);                                                              \
    }                                                                                       \
  } while (0)

// Comparison checks that report both values.
#define TRELLIS_CHECK_OP_(a, b, op, ...)                                                          \
  do {                                                                                            \
    const auto& trellis_a_ = (a);                                                                 \
    const auto& trellis_b_ = (b);                                                                 \
    if (!(trellis_a_ op trellis_b_)) [[unlikely]] {                                               \
      ::trellis::detail::throw_error(                                                             \
          ::trellis::detail::concat("check failed: " #a " " #op " " #b " (", trellis_a_, " vs ", \
                                    trellis_b_, ") " __VA_OPT__(, ) __VA_ARGS__),                 \
          __FILE__, __LINE__);                                                                    \
    }                                                                                             \
  } while (0)

#define TRELLIS_CHECK_EQ(a, b, ...) TRELLIS_CHECK_OP_(a, b, ==, __VA_ARGS__)
#define TRELLIS_CHECK_NE(a, b, ...) TRELLIS_CHECK_OP_(a, b, !=, __VA_ARGS__)
#define TRELLIS_CHECK_LT(a, b, ...) TRELLIS_CHECK_OP_(a, b, <, __VA_ARGS__)
#define TRELLIS_CHECK_LE(a, b, ...) TRELLIS_CHECK_OP_(a, b, <=, __VA_ARGS__)
#define TRELLIS_CHECK_GT(a, b, ...) TRELLIS_CHECK_OP_(a, b, >, __VA_ARGS__)
#define TRELLIS_CHECK_GE(a, b, ...) TRELLIS_CHECK_OP_(a, b, >=, __VA_ARGS__)
