// The redistribute property test body, a template over the communicator (thread ranks here; the
// MPI tests reuse it): for every pair of layouts (From, To) in a list, every rank builds its
// From-shard of a known global tensor G with an independent index model (nested balanced chunks
// written out again here), redistributes to To, and checks
//   (a) the local shard equals G over the box the model gives (for Partial axes: after reducing
//       the local shards with the communicator directly, not with shard/), and
//   (b) full_tensor(result) equals G.
// Values are small integers, exact in fp32 and bf16, so every reduction but avg is exact.
// Failures are collected per rank (Catch is not thread-safe) and returned as text.
#pragma once

#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "trellis/comm/mesh.hpp"
#include "trellis/shard.hpp"

namespace shard_test {

using trellis::index_t;
using trellis::Tensor;
using namespace trellis::shard;

// ---- type lists: all layouts over a set of options, for N mesh axes ---------------------------
template <class... L> struct list {};
template <class... Ls> struct concat;
template <> struct concat<> { using type = list<>; };
template <class... A> struct concat<list<A...>> { using type = list<A...>; };
template <class... A, class... B, class... Rest>
struct concat<list<A...>, list<B...>, Rest...> : concat<list<A..., B...>, Rest...> {};

template <class O, class P> struct prepend;
template <class O, class... X> struct prepend<O, Placements<X...>> { using type = Placements<O, X...>; };
template <class O, class L> struct prepend_all;
template <class O, class... P> struct prepend_all<O, list<P...>> { using type = list<typename prepend<O, P>::type...>; };

template <int N, class Opts> struct layouts;
template <class... O> struct layouts<0, list<O...>> { using type = list<Placements<>>; };
template <int N, class... O>
  requires(N > 0)
struct layouts<N, list<O...>> {
  using rest = typename layouts<N - 1, list<O...>>::type;
  using type = typename concat<typename prepend_all<O, rest>::type...>::type;
};
template <int N, class... O> using all_layouts = typename layouts<N, list<O...>>::type;

template <class L> struct list_size;
template <class... L> struct list_size<list<L...>> { static constexpr int value = sizeof...(L); };

// ---- the independent index model ----------------------------------------------------------------
// Part `i` of `extent` split `n` ways: sizes differ by one, larger parts first (docs/shard.md).
inline void model_part(index_t extent, int n, int i, index_t& offset, index_t& size) {
  index_t base = extent / n, extra = extent % n;
  size = base + (i < extra ? 1 : 0);
  offset = 0;
  for (int k = 0; k < i; ++k) offset += base + (k < extra ? 1 : 0);
}

template <int R, std::size_t N>
void model_box(const std::array<index_t, R>& global, const std::array<PlacementCode, N>& codes,
               const std::array<int, N>& sizes, const std::array<int, N>& coords, std::array<index_t, R>& offset,
               std::array<index_t, R>& shape) {
  for (int d = 0; d < R; ++d) {
    offset[d] = 0;
    shape[d] = global[d];
    // Axes sharding d, outermost first: by level, then by mesh axis (a stable sort by level).
    std::vector<std::size_t> nest;
    for (int level = 0; level < 4; ++level)
      for (std::size_t a = 0; a < N; ++a)
        if (codes[a].kind == PlacementKind::shard && codes[a].dim == d && codes[a].order == level) nest.push_back(a);
    for (std::size_t a : nest) {
      index_t o, s;
      model_part(shape[d], sizes[a], coords[a], o, s);
      offset[d] += o;
      shape[d] = s;
    }
  }
}

template <int R>
index_t linear(const std::array<index_t, R>& idx, const std::array<index_t, R>& shape) {
  index_t l = 0;
  for (int d = 0; d < R; ++d) l = l * shape[d] + idx[d];
  return l;
}
template <int R>
std::array<index_t, R> unlinear(index_t l, const std::array<index_t, R>& shape) {
  std::array<index_t, R> idx{};
  for (int d = R - 1; d >= 0; --d) {
    idx[d] = shape[d] ? l % shape[d] : 0;
    l = shape[d] ? l / shape[d] : 0;
  }
  return idx;
}

// The global tensor: integers in [-11, 11].
inline double global_value(index_t l, int seed) { return static_cast<double>((l * 7 + seed * 3) % 23 - 11); }
// Partial terms: term p of P for the element with linear global index l; reduced over p with `op`
// they give global_value (sum, max, min) or its P-fold (avg: sum / P = G).
inline double partial_term(double g, index_t l, int p, int P, ReduceOp op) {
  auto h = [&](int q) { return static_cast<double>((l * 5 + q * 3) % 7 - 3); };
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: {
      if (p > 0) return h(p);
      double rest = 0;
      for (int q = 1; q < P; ++q) rest += h(q);
      return (op == ReduceOp::avg ? g * P : g) - rest;
    }
    case ReduceOp::max: return p == static_cast<int>(l % P) ? g : g - std::abs(h(p)) - 1;
    case ReduceOp::min: return p == static_cast<int>(l % P) ? g : g + std::abs(h(p)) + 1;
    default: return g;
  }
}

struct Failures {
  std::mutex mutex;
  std::atomic<int> count{0};
  std::vector<std::string> first;
  void add(const std::string& what) {
    ++count;
    std::lock_guard<std::mutex> lock(mutex);
    if (first.size() < 8) first.push_back(what);
  }
};

template <std::size_t N>
std::string layout_name(const std::array<PlacementCode, N>& codes) {
  std::ostringstream out;
  out << "[";
  for (std::size_t a = 0; a < N; ++a) {
    if (a) out << ",";
    const auto& c = codes[a];
    if (c.is_shard()) out << "S" << c.dim << (c.order ? "'" : "");
    else if (c.is_replicate()) out << "R";
    else out << "P(" << trellis::comm::reduce_op_name(c.op) << ")";
  }
  return out.str() + "]";
}

// The local shard of G under `codes` for this rank.
template <class T, int R, class Mesh, std::size_t N>
Tensor<T, R> model_local(Mesh& mesh, const std::array<index_t, R>& global, const std::array<PlacementCode, N>& codes,
                         int seed) {
  const auto sizes = mesh_sizes(mesh);
  const auto coords = mesh_coords(mesh);
  std::array<index_t, R> offset{}, shape{};
  model_box<R, N>(global, codes, sizes, coords, offset, shape);
  Tensor<T, R> local(shape);
  int P = 1, p = 0;
  ReduceOp op = ReduceOp::sum;
  for (std::size_t a = 0; a < N; ++a) {
    if (codes[a].kind != PlacementKind::partial) continue;
    p = p * sizes[a] + coords[a];
    P *= sizes[a];
    op = codes[a].op;
  }
  for (index_t i = 0; i < local.size(); ++i) {
    auto idx = unlinear<R>(i, shape);
    for (int d = 0; d < R; ++d) idx[d] += offset[d];
    const index_t l = linear<R>(idx, global);
    const double g = global_value(l, seed);
    local.data()[i] = static_cast<T>(static_cast<float>(P > 1 ? partial_term(g, l, p, P, op) : g));
  }
  return local;
}

template <class T>
bool close(double got, double want, bool exact) {
  if (exact) return got == want;
  const double tol = std::is_same_v<T, float> ? 1e-5 : 2e-2;
  return std::abs(got - want) <= tol * (1 + std::abs(want));
}

// Compares `t` with G over the box of `codes` (Partial axes are treated as Replicate: the caller
// reduces first).
template <class T, int R, class Mesh, std::size_t N>
bool equals_model(Mesh& mesh, const Tensor<T, R>& t, const std::array<index_t, R>& global,
                  const std::array<PlacementCode, N>& codes, int seed, bool exact, std::string& why) {
  std::array<index_t, R> offset{}, shape{};
  model_box<R, N>(global, codes, mesh_sizes(mesh), mesh_coords(mesh), offset, shape);
  if (t.shape() != shape) {
    why = "local shape " + trellis::shard::detail::array_string(t.shape()) + ", expected " +
          trellis::shard::detail::array_string(shape);
    return false;
  }
  for (index_t i = 0; i < t.size(); ++i) {
    auto idx = unlinear<R>(i, shape);
    for (int d = 0; d < R; ++d) idx[d] += offset[d];
    const double want = global_value(linear<R>(idx, global), seed);
    const double got = static_cast<float>(t.data()[i]);
    if (!close<T>(got, want, exact)) {
      why = "element " + trellis::shard::detail::array_string(idx) + " is " + std::to_string(got) + ", expected " +
            std::to_string(want);
      return false;
    }
  }
  return true;
}

template <class T, int R, class Mesh, class From, class To>
void check_pair(Mesh& mesh, const std::array<index_t, R>& global, int seed, Failures& failures) {
  constexpr std::size_t N = static_cast<std::size_t>(From::size);
  using X = Sharded<T, R, Mesh, From>;
  auto x = X::from_local(mesh, model_local<T, R>(mesh, global, From::codes, seed), global);
  auto y = [&]<class... P>(Placements<P...>*) { return redistribute<P...>(x); }(static_cast<To*>(nullptr));
  static_assert(std::is_same_v<typename decltype(y)::layout, To>);
  bool exact = true;
  for (const auto& c : From::codes) exact = exact && !(c.is_partial() && c.op == ReduceOp::avg);
  for (const auto& c : To::codes) exact = exact && !(c.is_partial() && c.op == ReduceOp::avg);
  std::string where = std::string(trellis::dtype_name(trellis::dtype_v<T>)) + " global " +
                      trellis::shard::detail::array_string(global) + " " + layout_name(From::codes) + " -> " +
                      layout_name(To::codes) + " rank " + std::to_string(trellis::current_rank()) + ": ";
  // (a) the local shard, Partial axes reduced with the communicator itself.
  Tensor<T, R> reduced(y.local().shape());
  LocalOps<trellis::Host>::copy(y.local().view(), reduced.view());
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          constexpr PlacementCode c = To::codes[I];
          if constexpr (c.kind == PlacementKind::partial) {
            if (reduced.size() > 0)
              axis_comm<static_cast<int>(I)>(mesh).all_reduce(reduced.data(), reduced.data(),
                                                              static_cast<std::size_t>(reduced.size()), c.op);
          }
        }(),
        ...);
  }(std::make_index_sequence<N>{});
  std::string why;
  if (!equals_model<T, R>(mesh, reduced, global, To::codes, seed, exact, why)) failures.add(where + "local: " + why);
  // (b) the full tensor.
  Tensor<T, R> full = full_tensor(y);
  std::array<PlacementCode, N> all_replicate{};
  if (!equals_model<T, R>(mesh, full, global, all_replicate, seed, exact, why)) failures.add(where + "full: " + why);
}

template <class T, int R, class Mesh, class From, class ToList>
struct pairs_from;
template <class T, int R, class Mesh, class From, class... To>
struct pairs_from<T, R, Mesh, From, list<To...>> {
  static int run(Mesh& mesh, const std::array<index_t, R>& global, int seed, Failures& failures) {
    (check_pair<T, R, Mesh, From, To>(mesh, global, seed, failures), ...);
    return static_cast<int>(sizeof...(To));
  }
};
template <class T, int R, class Mesh, class FromList, class ToList>
struct pairs;
template <class T, int R, class Mesh, class... From, class ToList>
struct pairs<T, R, Mesh, list<From...>, ToList> {
  static int run(Mesh& mesh, const std::array<index_t, R>& global, int seed, Failures& failures) {
    return (pairs_from<T, R, Mesh, From, ToList>::run(mesh, global, seed, failures) + ... + 0);
  }
};

// Every From in one list against every To in another.
template <class T, int R, class Mesh, class FromList, class ToList>
using pairs_impl = pairs<T, R, Mesh, FromList, ToList>;

// Every pair of layouts in `Layouts` for tensors of each shape in `shapes`; returns the pairs run.
template <class T, int R, class Layouts, class Mesh>
int run_all_pairs(Mesh& mesh, const std::vector<std::array<index_t, R>>& shapes, Failures& failures) {
  int n = 0, seed = 0;
  for (const auto& shape : shapes) n += pairs<T, R, Mesh, Layouts, Layouts>::run(mesh, shape, ++seed, failures);
  return n;
}

}  // namespace shard_test
