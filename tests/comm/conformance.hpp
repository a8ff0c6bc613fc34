// Conformance suite for any trellis::comm::Communicator: every operation, every dtype and reduce
// op, in place and out of place, sizes 0, 1, primes and several MiB, checked against a serial
// reference computed here (independently of any backend).
//
// Usage (called on every rank with that rank's communicator; no Catch2 macros inside, because
// Catch2 assertions are not thread-safe and thread ranks run concurrently):
//
//   trellis::comm::conformance::Options options;   // options.fixed_order = false for MPI/NCCL
//   trellis::comm::conformance::Report report;
//   trellis::comm::conformance::run_all(comm, options, report);
//   // then, on the main thread: REQUIRE(report.failures.empty()) (print report.summary())
//
// Data: "exact" inputs are small integers, so every reduction is exact whatever the order and
// every backend must match bit for bit; "fractional" inputs round at every step, so they are
// compared bit for bit only when options.fixed_order (the thread backend's guarantee: rank 0, 1,
// ..., n-1 for every element), else within a relative tolerance. 16-bit types are compared with
// the reference computed in float and rounded once.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/dtype.hpp"

namespace trellis::comm::conformance {

struct Options {
  // Counts (elements) exercised for every dtype and op.
  std::vector<std::size_t> small_counts{0, 1, 7, 31, 1009};
  // One large count for float/bfloat16 (several MiB per rank).
  std::size_t large_count = (std::size_t{1} << 20) + 3;
  // Results equal a serial reduction in rank order, bit for bit (thread backend).
  bool fixed_order = true;
  // Relative tolerance for fractional data when !fixed_order (scaled for 16-bit types).
  double tolerance = 1e-5;
  // Point-to-point sizes: one below and one above typical eager limits.
  std::vector<std::size_t> p2p_counts{0, 5, 70000};
};

struct Report {
  int rank = -1;
  std::vector<std::string> failures;
  std::size_t checks = 0;

  void fail(const std::string& what) {
    if (failures.size() < 50) failures.push_back("rank " + std::to_string(rank) + ": " + what);
  }
  void check(bool ok, const std::string& what) {
    ++checks;
    if (!ok) fail(what);
  }
  std::string summary() const {
    std::ostringstream out;
    out << failures.size() << " failures in " << checks << " checks";
    for (const auto& f : failures) out << "\n  " << f;
    return out.str();
  }
};

// ---- value generation and the serial reference -------------------------------------------------

template <class T>
inline constexpr bool is_float_like = std::is_floating_point_v<T> || std::is_same_v<T, half> ||
                                      std::is_same_v<T, bfloat16>;

// Deterministic input of `rank` at element i. `exact`: small integers (order-independent sums).
template <class T>
T input_value(int rank, std::size_t i, int salt, bool exact, ReduceOp op = ReduceOp::sum) {
  const std::uint64_t h = (static_cast<std::uint64_t>(i) * 2654435761u + static_cast<std::uint64_t>(rank) * 40503u +
                           static_cast<std::uint64_t>(salt) * 977u) % 1000003u;
  if (op == ReduceOp::prod) {  // products stay small: factors in {1, 2} (and -1 for signed)
    const int choices = std::is_unsigned_v<T> ? 2 : 3;
    const int v = static_cast<int>(h % static_cast<std::uint64_t>(choices));
    return static_cast<T>(static_cast<float>(v == 0 ? 1 : v == 1 ? 2 : -1));
  }
  if (exact || !is_float_like<T>) {
    const int v = static_cast<int>(h % 9u);
    if constexpr (std::is_unsigned_v<T>) return static_cast<T>(v);
    else return static_cast<T>(static_cast<float>(v - 4));
  } else {
    const double v = (static_cast<double>(h % 2001u) - 1000.0) / 997.0;  // rounds in every type
    if constexpr (std::is_same_v<T, double>) return v;
    else return static_cast<T>(static_cast<float>(v));
  }
}

// The reduction of `values` (index = rank), in rank order, in the accumulate type; integers wrap.
template <class T>
T reference_reduce(const std::vector<T>& values, ReduceOp op) {
  const int n = static_cast<int>(values.size());
  if constexpr (is_float_like<T>) {
    using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
    A acc = static_cast<A>(values[0]);
    for (int k = 1; k < n; ++k) {
      const A v = static_cast<A>(values[k]);
      switch (op) {
        case ReduceOp::sum: case ReduceOp::avg: acc = acc + v; break;
        case ReduceOp::prod: acc = acc * v; break;
        case ReduceOp::min: acc = std::min(acc, v); break;
        case ReduceOp::max: acc = std::max(acc, v); break;
      }
    }
    if (op == ReduceOp::avg) acc = acc / static_cast<A>(n);
    return static_cast<T>(acc);
  } else {
    // In 64 bits with modular sums/products, then reduced modulo 2^bits by the conversion.
    using W = std::conditional_t<std::is_signed_v<T>, std::int64_t, std::uint64_t>;
    W acc = static_cast<W>(values[0]);
    for (int k = 1; k < n; ++k) {
      const W v = static_cast<W>(values[k]);
      switch (op) {
        case ReduceOp::sum: case ReduceOp::avg: acc = static_cast<W>(static_cast<std::uint64_t>(acc) + static_cast<std::uint64_t>(v)); break;
        case ReduceOp::prod: acc = static_cast<W>(static_cast<std::uint64_t>(acc) * static_cast<std::uint64_t>(v)); break;
        case ReduceOp::min: acc = std::min(acc, v); break;
        case ReduceOp::max: acc = std::max(acc, v); break;
      }
    }
    T wrapped = static_cast<T>(static_cast<std::uint64_t>(acc));
    if (op == ReduceOp::avg) wrapped = static_cast<T>(wrapped / static_cast<T>(n));
    return wrapped;
  }
}

template <class T>
std::string show(T v) {
  std::ostringstream out;
  if constexpr (is_float_like<T>) out << static_cast<double>(static_cast<float>(v));
  else out << static_cast<long long>(v);
  if constexpr (std::is_same_v<T, double>) {
    out.str("");
    out.precision(17);
    out << v;
  }
  return out.str();
}

template <class T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <class T>
bool close_enough(T got, T expected, double tolerance) {
  if (same_bits(got, expected)) return true;
  if constexpr (is_float_like<T>) {
    double tol = tolerance;
    if constexpr (std::is_same_v<T, half>) tol = std::max(tol, 2e-3);
    if constexpr (std::is_same_v<T, bfloat16>) tol = std::max(tol, 1.6e-2);
    const double g = static_cast<float>(got), e = static_cast<float>(expected);
    if constexpr (std::is_same_v<T, double>) return std::fabs(static_cast<double>(got) - static_cast<double>(expected)) <= tol * std::max(1.0, std::fabs(static_cast<double>(expected)));
    return std::fabs(g - e) <= tol * std::max(1.0, std::fabs(e));
  }
  return false;
}

// Compares got[0..n) with expected; reports the first difference and the number of differences.
template <class T>
void compare(Report& report, const T* got, const T* expected, std::size_t n, bool bitwise, double tolerance,
             const std::string& what) {
  std::size_t wrong = 0, first = n;
  for (std::size_t i = 0; i < n; ++i) {
    const bool ok = bitwise ? same_bits(got[i], expected[i]) : close_enough(got[i], expected[i], tolerance);
    if (!ok) {
      if (first == n) first = i;
      ++wrong;
    }
  }
  ++report.checks;
  if (wrong) {
    report.fail(what + ": " + std::to_string(wrong) + " of " + std::to_string(n) + " elements wrong, first at " +
                std::to_string(first) + ": got " + show(got[first]) + ", expected " + show(expected[first]));
  }
}

template <class T>
const char* type_name() {
  return dtype_name(dtype_v<T>);
}

template <class F>
void for_each_dtype(F&& f) {
  f(float{});
  f(double{});
  f(half{});
  f(bfloat16{});
  f(std::int8_t{});
  f(std::uint8_t{});
  f(std::int32_t{});
  f(std::uint32_t{});
  f(std::int64_t{});
  f(std::uint64_t{});
}

inline constexpr ReduceOp all_reduce_ops[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::min, ReduceOp::max,
                                              ReduceOp::prod};

inline std::string context(const char* op, const char* type, std::size_t count, const std::string& extra) {
  std::ostringstream out;
  out << op << '<' << type << "> count=" << count << (extra.empty() ? "" : " ") << extra;
  return out.str();
}

// ---- collectives -------------------------------------------------------------------------------

// all_reduce out of place and in place; exact and (floats) fractional data.
template <class T, Communicator C>
void check_all_reduce(C& comm, const Options& opt, Report& report, std::size_t count, ReduceOp op) {
  const int n = comm.size(), r = comm.rank();
  for (int exact = 1; exact >= (is_float_like<T> ? 0 : 1); --exact) {
    std::vector<T> in(count), out(count), expected(count), column(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < count; ++i) {
      for (int k = 0; k < n; ++k) column[k] = input_value<T>(k, i, 1, exact, op);
      in[i] = column[r];
      expected[i] = reference_reduce(column, op);
    }
    const bool bitwise = exact || opt.fixed_order;
    const std::string extra = std::string("op=") + reduce_op_name(op) + (exact ? " exact" : " fractional");
    comm.all_reduce(in.data(), out.data(), count, op);
    compare(report, out.data(), expected.data(), count, bitwise, opt.tolerance,
            context("all_reduce", type_name<T>(), count, extra));
    std::vector<T> again(count);
    for (std::size_t i = 0; i < count; ++i) again[i] = input_value<T>(r, i, 1, exact, op);
    compare(report, in.data(), again.data(), count, true, 0,
            context("all_reduce", type_name<T>(), count, extra + " input modified"));
    comm.all_reduce(in.data(), in.data(), count, op);  // in place
    compare(report, in.data(), expected.data(), count, bitwise, opt.tolerance,
            context("all_reduce", type_name<T>(), count, extra + " in place"));
  }
}

// reduce to every root (out of place; in place at the root).
template <class T, Communicator C>
void check_reduce(C& comm, const Options& opt, Report& report, std::size_t count, ReduceOp op) {
  const int n = comm.size(), r = comm.rank();
  std::vector<T> in(count), expected(count), column(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < count; ++i) {
    for (int k = 0; k < n; ++k) column[k] = input_value<T>(k, i, 2, true, op);
    in[i] = column[r];
    expected[i] = reference_reduce(column, op);
  }
  for (int root = 0; root < n; ++root) {
    const std::string extra = std::string("op=") + reduce_op_name(op) + " root=" + std::to_string(root);
    std::vector<T> out(count, static_cast<T>(0.0f));
    const std::vector<T> untouched = out;
    comm.reduce(in.data(), out.data(), count, op, root);
    compare(report, out.data(), (r == root ? expected : untouched).data(), count, true, 0,
            context("reduce", type_name<T>(), count, extra + (r == root ? "" : " (non-root output changed)")));
    std::vector<T> inplace = in;
    comm.reduce(inplace.data(), inplace.data(), count, op, root);
    if (r == root)
      compare(report, inplace.data(), expected.data(), count, true, 0,
              context("reduce", type_name<T>(), count, extra + " in place"));
  }
}

template <class T, Communicator C>
void check_broadcast(C& comm, const Options&, Report& report, std::size_t count) {
  const int n = comm.size(), r = comm.rank();
  for (int root = 0; root < n; ++root) {
    std::vector<T> buf(count), expected(count);
    for (std::size_t i = 0; i < count; ++i) {
      expected[i] = input_value<T>(root, i, 3, false);
      buf[i] = input_value<T>(r, i, 3, false);
    }
    comm.broadcast(buf.data(), count, root);
    compare(report, buf.data(), expected.data(), count, true, 0,
            context("broadcast", type_name<T>(), count, "root=" + std::to_string(root)));
  }
}

template <class T, Communicator C>
void check_all_gather(C& comm, const Options&, Report& report, std::size_t count) {
  const int n = comm.size(), r = comm.rank();
  const std::size_t total = count * static_cast<std::size_t>(n);
  std::vector<T> in(count), out(total), expected(total);
  for (int k = 0; k < n; ++k)
    for (std::size_t i = 0; i < count; ++i) expected[k * count + i] = input_value<T>(k, i, 4, false);
  for (std::size_t i = 0; i < count; ++i) in[i] = input_value<T>(r, i, 4, false);
  comm.all_gather(in.data(), out.data(), count);
  compare(report, out.data(), expected.data(), total, true, 0, context("all_gather", type_name<T>(), count, ""));
  std::vector<T> inplace(total);
  std::copy(in.begin(), in.end(), inplace.begin() + static_cast<std::ptrdiff_t>(r * count));
  comm.all_gather(inplace.data() + r * count, inplace.data(), count);
  compare(report, inplace.data(), expected.data(), total, true, 0,
          context("all_gather", type_name<T>(), count, "in place"));
}

template <class T, Communicator C>
void check_reduce_scatter(C& comm, const Options& opt, Report& report, std::size_t count, ReduceOp op) {
  const int n = comm.size(), r = comm.rank();
  const std::size_t total = count * static_cast<std::size_t>(n);
  for (int exact = 1; exact >= (is_float_like<T> ? 0 : 1); --exact) {
    std::vector<T> in(total), out(count), expected(count), column(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < total; ++i) {
      for (int k = 0; k < n; ++k) column[k] = input_value<T>(k, i, 5, exact, op);
      in[i] = column[r];
      if (i / count == static_cast<std::size_t>(r)) expected[i - r * count] = reference_reduce(column, op);
    }
    const bool bitwise = exact || opt.fixed_order;
    const std::string extra = std::string("op=") + reduce_op_name(op) + (exact ? " exact" : " fractional");
    comm.reduce_scatter(in.data(), out.data(), count, op);
    compare(report, out.data(), expected.data(), count, bitwise, opt.tolerance,
            context("reduce_scatter", type_name<T>(), count, extra));
    comm.reduce_scatter(in.data(), in.data() + r * count, count, op);  // in place: block r
    compare(report, in.data() + r * count, expected.data(), count, bitwise, opt.tolerance,
            context("reduce_scatter", type_name<T>(), count, extra + " in place"));
  }
}

template <class T, Communicator C>
void check_all_to_all(C& comm, const Options&, Report& report, std::size_t count) {
  const int n = comm.size(), r = comm.rank();
  const std::size_t total = count * static_cast<std::size_t>(n);
  // Block j of rank k's input is value(k, j*count + i); rank r receives block r of every rank.
  std::vector<T> in(total), out(total), expected(total);
  for (std::size_t i = 0; i < total; ++i) in[i] = input_value<T>(r, i, 6, false);
  for (int k = 0; k < n; ++k)
    for (std::size_t i = 0; i < count; ++i) expected[k * count + i] = input_value<T>(k, r * count + i, 6, false);
  comm.all_to_all(in.data(), out.data(), count);
  compare(report, out.data(), expected.data(), total, true, 0, context("all_to_all", type_name<T>(), count, ""));
  comm.all_to_all(in.data(), in.data(), count);
  compare(report, in.data(), expected.data(), total, true, 0,
          context("all_to_all", type_name<T>(), count, "in place"));
}

// Uneven: rank s sends (s + 2d + scale) % 5 * scale elements to rank d (some zero), with gaps
// between blocks in both buffers.
template <class T, Communicator C>
void check_all_to_allv(C& comm, const Options&, Report& report, std::size_t scale) {
  const int n = comm.size(), r = comm.rank();
  auto amount = [&](int s, int d) { return static_cast<std::size_t>((s + 2 * d + static_cast<int>(scale % 3)) % 5) * scale; };
  std::vector<std::size_t> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
  std::size_t send_total = 0, recv_total = 0;
  for (int j = 0; j < n; ++j) {
    send_counts[j] = amount(r, j);
    send_displs[j] = send_total + 1;  // a gap of one element before each block
    send_total += send_counts[j] + 1;
    recv_counts[j] = amount(j, r);
    recv_displs[j] = recv_total + 2;
    recv_total += recv_counts[j] + 2;
  }
  std::vector<T> in(send_total), out(recv_total, static_cast<T>(7.0f)), expected(recv_total, static_cast<T>(7.0f));
  for (int j = 0; j < n; ++j)
    for (std::size_t i = 0; i < send_counts[j]; ++i) in[send_displs[j] + i] = input_value<T>(r, j * 1000 + i, 7, false);
  for (int j = 0; j < n; ++j)
    for (std::size_t i = 0; i < recv_counts[j]; ++i) expected[recv_displs[j] + i] = input_value<T>(j, r * 1000 + i, 7, false);
  comm.all_to_allv(in.data(), std::span<const std::size_t>(send_counts), std::span<const std::size_t>(send_displs),
                   out.data(), std::span<const std::size_t>(recv_counts), std::span<const std::size_t>(recv_displs));
  compare(report, out.data(), expected.data(), recv_total, true, 0,
          context("all_to_allv", type_name<T>(), scale, "scale (gaps must stay untouched)"));
}

// ---- point to point ----------------------------------------------------------------------------

template <class T, Communicator C>
void check_point_to_point(C& comm, const Options&, Report& report, std::size_t count) {
  const int n = comm.size(), r = comm.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  auto expected_from = [&](int source, int salt) {
    std::vector<T> v(count);
    for (std::size_t i = 0; i < count; ++i) v[i] = input_value<T>(source, i, salt, false);
    return v;
  };
  const std::vector<T> mine8 = [&] {
    std::vector<T> v(count);
    for (std::size_t i = 0; i < count; ++i) v[i] = input_value<T>(r, i, 8, false);
    return v;
  }();
  // Ring with nonblocking operations.
  {
    std::vector<T> got(count);
    auto rq = comm.irecv(got.data(), count, prev, 3);
    auto sq = comm.isend(mine8.data(), count, next, 3);
    sq.wait();
    rq.wait();
    compare(report, got.data(), expected_from(prev, 8).data(), count, true, 0,
            context("isend/irecv ring", type_name<T>(), count, ""));
  }
  // Blocking pairs: even ranks send first, odd ranks receive first.
  if (n > 1) {
    const int partner = (r % 2 == 0) ? r + 1 : r - 1;
    if (partner < n) {
      std::vector<T> got(count);
      if (r % 2 == 0) {
        comm.send(mine8.data(), count, partner, 5);
        comm.recv(got.data(), count, partner, 5);
      } else {
        comm.recv(got.data(), count, partner, 5);
        comm.send(mine8.data(), count, partner, 5);
      }
      compare(report, got.data(), expected_from(partner, 8).data(), count, true, 0,
              context("send/recv pair", type_name<T>(), count, ""));
    }
  }
  // Two tags, received in the opposite order of sending (matching by tag), plus self-send.
  {
    std::vector<T> mine9(count);
    for (std::size_t i = 0; i < count; ++i) mine9[i] = input_value<T>(r, i, 9, false);
    auto s1 = comm.isend(mine8.data(), count, next, 11);
    auto s2 = comm.isend(mine9.data(), count, next, 12);
    std::vector<T> got12(count), got11(count);
    comm.recv(got12.data(), count, prev, 12);
    comm.recv(got11.data(), count, prev, 11);
    s1.wait();
    s2.wait();
    compare(report, got11.data(), expected_from(prev, 8).data(), count, true, 0,
            context("send/recv by tag", type_name<T>(), count, "tag 11"));
    compare(report, got12.data(), expected_from(prev, 9).data(), count, true, 0,
            context("send/recv by tag", type_name<T>(), count, "tag 12"));
  }
  // batch: exchange with every rank (including self) at once.
  {
    std::vector<std::vector<T>> got(static_cast<std::size_t>(n), std::vector<T>(count));
    std::vector<P2POp> ops;
    for (int k = 0; k < n; ++k) {
      ops.push_back(P2POp{P2POp::Kind::recv, got[k].data(), count, dtype_v<T>, k, 21});
      ops.push_back(P2POp{P2POp::Kind::send, const_cast<T*>(mine8.data()), count, dtype_v<T>, k, 21});
    }
    auto request = comm.batch(std::span<const P2POp>(ops));
    request.wait();
    for (int k = 0; k < n; ++k)
      compare(report, got[k].data(), expected_from(k, 8).data(), count, true, 0,
              context("batch", type_name<T>(), count, "from rank " + std::to_string(k)));
  }
  // FIFO for the same (peer, tag): three messages arrive in order.
  if (n > 1 && count > 0) {
    std::vector<T> a(count, static_cast<T>(1.0f)), b(count, static_cast<T>(2.0f)), c(count, static_cast<T>(3.0f));
    auto q1 = comm.isend(a.data(), count, next, 30);
    auto q2 = comm.isend(b.data(), count, next, 30);
    auto q3 = comm.isend(c.data(), count, next, 30);
    std::vector<T> x(count), y(count), z(count);
    comm.recv(x.data(), count, prev, 30);
    comm.recv(y.data(), count, prev, 30);
    comm.recv(z.data(), count, prev, 30);
    q1.wait();
    q2.wait();
    q3.wait();
    report.check(same_bits(x[0], a[0]) && same_bits(y[0], b[0]) && same_bits(z[count - 1], c[0]),
                 context("send/recv order", type_name<T>(), count, "messages overtook each other"));
  }
}

// ---- async collectives ---------------------------------------------------------------------------

template <Communicator C>
void check_async(C& comm, const Options& opt, Report& report, std::size_t count) {
  const int n = comm.size(), r = comm.rank();
  std::vector<float> a(count), b(count * n), c(count * n), a_out(count), b_out(count * n), c_out(count);
  std::vector<float> a_ref(count), b_ref(count * n), c_ref(count), column(n);
  for (std::size_t i = 0; i < count; ++i) {
    for (int k = 0; k < n; ++k) column[k] = input_value<float>(k, i, 10, false);
    a[i] = column[r];
    a_ref[i] = reference_reduce(column, ReduceOp::sum);
  }
  for (int k = 0; k < n; ++k)
    for (std::size_t i = 0; i < count; ++i) b_ref[k * count + i] = input_value<float>(k, i, 11, false);
  std::copy(b_ref.begin() + r * count, b_ref.begin() + (r + 1) * count, b.begin());
  for (std::size_t i = 0; i < count * n; ++i) {
    for (int k = 0; k < n; ++k) column[k] = input_value<float>(k, i, 12, false);
    c[i] = column[r];
    if (i / count == static_cast<std::size_t>(r)) c_ref[i - r * count] = reference_reduce(column, ReduceOp::max);
  }
  auto qa = comm.all_reduce_async(a.data(), a_out.data(), count, ReduceOp::sum);
  auto qb = comm.all_gather_async(b.data(), b_out.data(), count);
  auto qc = comm.reduce_scatter_async(c.data(), c_out.data(), count, ReduceOp::max);
  // Wait in reverse order; poll the first with test().
  qc.wait();
  qb.wait();
  while (!qa.test()) {
  }
  compare(report, a_out.data(), a_ref.data(), count, opt.fixed_order, opt.tolerance,
          context("all_reduce_async", "float", count, ""));
  compare(report, b_out.data(), b_ref.data(), count * n, true, 0, context("all_gather_async", "float", count, ""));
  compare(report, c_out.data(), c_ref.data(), count, true, 0, context("reduce_scatter_async", "float", count, "op=max"));
  // An async collective followed by a blocking one keeps the order on every rank.
  std::vector<float> d(count, 1.0f), d_out(count), e(1, static_cast<float>(r)), e_out(1);
  auto qd = comm.all_reduce_async(d.data(), d_out.data(), count, ReduceOp::sum);
  comm.all_reduce(e.data(), e_out.data(), 1, ReduceOp::max);
  qd.wait();
  std::vector<float> d_ref(count, static_cast<float>(n));
  compare(report, d_out.data(), d_ref.data(), count, true, 0, context("all_reduce_async then blocking", "float", count, ""));
  report.check(e_out[0] == static_cast<float>(n - 1), "blocking all_reduce after an async one: wrong max");
}

// ---- split -------------------------------------------------------------------------------------

template <Communicator C>
void check_split(C& comm, const Options&, Report& report) {
  const int n = comm.size(), r = comm.rank();
  // color = parity; key reverses the order.
  auto sub = comm.split(r % 2, -r);
  std::vector<int> members;
  for (int k = 0; k < n; ++k)
    if (k % 2 == r % 2) members.push_back(k);
  std::reverse(members.begin(), members.end());
  const int expected_rank = static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin());
  report.check(sub.size() == static_cast<int>(members.size()),
               "split: size " + std::to_string(sub.size()) + ", expected " + std::to_string(members.size()));
  report.check(sub.rank() == expected_rank,
               "split: rank " + std::to_string(sub.rank()) + ", expected " + std::to_string(expected_rank));
  // The sum of the members' parent ranks, and a gather that shows the order.
  std::int64_t mine = r, total = 0;
  sub.all_reduce(&mine, &total, 1, ReduceOp::sum);
  std::int64_t expected_total = 0;
  for (int m : members) expected_total += m;
  report.check(total == expected_total, "split: all_reduce over the sub-communicator gave " + std::to_string(total) +
                                            ", expected " + std::to_string(expected_total));
  std::vector<std::int32_t> order(members.size());
  std::int32_t me32 = r;
  sub.all_gather(&me32, order.data(), 1);
  report.check(std::equal(order.begin(), order.end(), members.begin()), "split: members gathered in the wrong order");
  // A split of a split, and the parent still works afterwards.
  auto single = sub.split(sub.rank(), 0);
  report.check(single.size() == 1 && single.rank() == 0, "split of split into singletons");
  float one = 1.0f, count_ranks = 0.0f;
  comm.all_reduce(&one, &count_ranks, 1, ReduceOp::sum);
  report.check(count_ranks == static_cast<float>(n), "parent communicator after split");
}

// split_or_none (backends that have it): a negative color (MPI_UNDEFINED) takes part in the
// split but joins nothing. Every third rank opts out (colors -1 and -7); the rest split by
// parity, ordered by rank.
template <Communicator C>
void check_split_or_none(C& comm, const Options&, Report& report) {
  if constexpr (requires { comm.split_or_none(0, 0); }) {
    const int n = comm.size(), r = comm.rank();
    auto opts_out = [](int k) { return k % 3 == 1; };
    const int color = opts_out(r) ? (r % 2 == 0 ? -1 : -7) : r % 2;
    auto sub = comm.split_or_none(color, r);
    std::vector<int> members;
    for (int k = 0; k < n; ++k)
      if (!opts_out(k) && k % 2 == r % 2) members.push_back(k);
    if (opts_out(r)) {
      report.check(!sub.has_value(), "split_or_none: a negative color got a communicator");
    } else if (!sub.has_value()) {
      report.check(false, "split_or_none: color " + std::to_string(color) + " got no communicator");
    } else {
      const int expected_rank = static_cast<int>(std::find(members.begin(), members.end(), r) - members.begin());
      report.check(sub->size() == static_cast<int>(members.size()) && sub->rank() == expected_rank,
                   "split_or_none: size " + std::to_string(sub->size()) + " rank " + std::to_string(sub->rank()) +
                       ", expected " + std::to_string(members.size()) + " and " + std::to_string(expected_rank));
      std::vector<std::int32_t> order(members.size());
      std::int32_t me32 = r;
      sub->all_gather(&me32, order.data(), 1);
      report.check(std::equal(order.begin(), order.end(), members.begin()),
                   "split_or_none: members gathered in the wrong order");
    }
    // The parent still works, for opted-out ranks too.
    std::int64_t one = 1, count_ranks = 0;
    comm.all_reduce(&one, &count_ranks, 1, ReduceOp::sum);
    report.check(count_ranks == n, "parent communicator after split_or_none");
  }
}

// ---- everything --------------------------------------------------------------------------------

template <Communicator C>
void run_all(C& comm, const Options& opt, Report& report) {
  report.rank = comm.rank();
  for_each_dtype([&](auto tag) {
    using T = decltype(tag);
    for (std::size_t count : opt.small_counts) {
      for (ReduceOp op : all_reduce_ops) {
        check_all_reduce<T>(comm, opt, report, count, op);
        check_reduce_scatter<T>(comm, opt, report, count, op);
      }
      check_broadcast<T>(comm, opt, report, count);
      check_all_gather<T>(comm, opt, report, count);
      check_all_to_all<T>(comm, opt, report, count);
    }
    for (ReduceOp op : all_reduce_ops) check_reduce<T>(comm, opt, report, 31, op);
    check_all_to_allv<T>(comm, opt, report, 3);
    check_point_to_point<T>(comm, opt, report, 5);
  });
  // Large messages (several MiB per rank).
  const std::size_t big = opt.large_count;
  const std::size_t per_rank = big / static_cast<std::size_t>(comm.size()) + 1;
  check_all_reduce<float>(comm, opt, report, big, ReduceOp::sum);
  check_all_reduce<bfloat16>(comm, opt, report, big / 2 + 1, ReduceOp::max);
  check_reduce_scatter<float>(comm, opt, report, per_rank, ReduceOp::sum);
  check_all_gather<float>(comm, opt, report, per_rank);
  check_broadcast<std::uint8_t>(comm, opt, report, big + 5);
  check_all_to_all<float>(comm, opt, report, per_rank / static_cast<std::size_t>(comm.size()) + 1);
  check_all_to_allv<double>(comm, opt, report, 4099);
  check_reduce<float>(comm, opt, report, per_rank, ReduceOp::sum);
  for (std::size_t count : opt.p2p_counts) check_point_to_point<float>(comm, opt, report, count);
  check_async(comm, opt, report, 0);
  check_async(comm, opt, report, 1009);
  check_async(comm, opt, report, big / 4);
  check_split(comm, opt, report);
  check_split_or_none(comm, opt, report);
  comm.barrier();
}

}  // namespace trellis::comm::conformance
