// N-dimensional device meshes whose axes are named by tag types.
//
//   auto mesh = make_mesh<pp, dp, tp>(comm, {2, 2, 2});  // 8 ranks, tp varies fastest
//   mesh.coord<tp>();        // this rank's index along tp
//   mesh.size<dp>();         // 2
//   mesh.comm<tp>();         // the ranks that differ only in tp (ordered by tp)
//   mesh.comm<dp, tp>();     // the ranks that differ only in dp and tp (ordered row-major: dp, tp)
//
// Axis tags are empty structs: the predefined trellis::dp, tp, pp, cp, ep (data, tensor,
// pipeline, context, expert parallel) live in namespace trellis; users declare their own
// (`struct replica {};`, optionally with `static constexpr const char* name = "replica";` for
// error messages). Ranks map to coordinates row-major (last axis fastest), so with
// <pp, dp, tp> and {2, 2, 2}, rank = (pp * 2 + dp) * 2 + tp.
//
// Sub-communicators are made with the backend's split(): every single-axis communicator is built
// when the mesh is made (a collective over the whole communicator); a multi-axis one on its first
// use, which is then also a collective: every rank must ask for it, in the same order.
// The Mesh keeps a reference to the communicator it was made from, which must outlive it.
#pragma once

#include <array>
#include <cstddef>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/error.hpp"

namespace trellis {

// Predefined mesh axes.
struct dp { static constexpr const char* name = "dp"; };  // data parallel
struct tp { static constexpr const char* name = "tp"; };  // tensor parallel
struct pp { static constexpr const char* name = "pp"; };  // pipeline parallel
struct cp { static constexpr const char* name = "cp"; };  // context (sequence) parallel
struct ep { static constexpr const char* name = "ep"; };  // expert parallel

}  // namespace trellis

namespace trellis::comm {

namespace detail {
template <class Axis>
constexpr const char* axis_name_or(const char* fallback) {
  if constexpr (requires { Axis::name; }) return Axis::name;
  else return fallback;
}

template <class T, class... Ts>
constexpr std::size_t index_of() {
  constexpr bool matches[] = {std::is_same_v<T, Ts>...};
  for (std::size_t i = 0; i < sizeof...(Ts); ++i)
    if (matches[i]) return i;
  return sizeof...(Ts);
}

template <class... Ts>
constexpr bool all_distinct() {
  constexpr std::size_t idx[] = {index_of<Ts, Ts...>()...};
  for (std::size_t i = 0; i < sizeof...(Ts); ++i)
    if (idx[i] != i) return false;
  return true;
}
}  // namespace detail

template <class C, class... Axes>
class Mesh {
 public:
  static constexpr std::size_t ndim = sizeof...(Axes);
  static_assert(ndim >= 1, "a mesh needs at least one axis");
  static_assert(detail::all_distinct<Axes...>(), "mesh axes must be distinct tag types");
  using Coords = std::array<int, ndim>;

  Mesh(C& comm, const Coords& shape) : world_(&comm), shape_(shape) {
    long long product = 1;
    for (std::size_t i = 0; i < ndim; ++i) {
      TRELLIS_CHECK(shape_[i] >= 1, "make_mesh<", axis_names(), ">: axis ", names_[i], " has size ",
                    shape_[i], " (must be >= 1)");
      product *= shape_[i];
    }
    if (product != comm.size()) {
      std::ostringstream sizes;
      for (std::size_t i = 0; i < ndim; ++i) sizes << (i ? " x " : "") << shape_[i];
      TRELLIS_THROW("make_mesh<", axis_names(), ">: sizes ", sizes.str(), " = ", product,
                    " but the communicator has ", comm.size(), " ranks");
    }
    coords_ = coords_of(comm.rank());
    for (std::size_t i = 0; i < ndim; ++i) sub_comm(std::vector<std::size_t>{i});
  }

  Mesh(Mesh&&) noexcept = default;
  Mesh& operator=(Mesh&&) noexcept = default;

  int rank() const { return world_->rank(); }
  int size() const { return world_->size(); }
  const Coords& shape() const { return shape_; }
  const Coords& coords() const { return coords_; }
  C& world() const { return *world_; }

  template <class Axis>
  static constexpr std::size_t axis_index() {
    constexpr std::size_t i = detail::index_of<Axis, Axes...>();
    static_assert(i < ndim, "this axis is not part of the mesh");
    return i;
  }

  template <class Axis>
  int coord() const { return coords_[axis_index<Axis>()]; }
  template <class Axis>
  int size() const { return shape_[axis_index<Axis>()]; }

  // Row-major: the last axis varies fastest.
  int rank_of(const Coords& c) const {
    int r = 0;
    for (std::size_t i = 0; i < ndim; ++i) {
      TRELLIS_CHECK(c[i] >= 0 && c[i] < shape_[i], "mesh coordinate ", c[i], " out of range for axis ",
                    names_[i], " of size ", shape_[i]);
      r = r * shape_[i] + c[i];
    }
    return r;
  }
  Coords coords_of(int rank) const {
    TRELLIS_CHECK(rank >= 0 && rank < size(), "rank ", rank, " outside the mesh of ", size(), " ranks");
    Coords c{};
    for (std::size_t i = ndim; i-- > 0;) {
      c[i] = rank % shape_[i];
      rank /= shape_[i];
    }
    return c;
  }

  // The communicator of the ranks that share this rank's coordinates on every other axis; its
  // ranks are ordered row-major over SubAxes in the order given.
  template <class... SubAxes>
  C& comm() {
    static_assert(sizeof...(SubAxes) >= 1, "name at least one axis");
    static_assert(detail::all_distinct<SubAxes...>(), "axes must be distinct");
    return sub_comm(std::vector<std::size_t>{axis_index<SubAxes>()...});
  }

  // "pp, dp, tp"
  static std::string axis_names() {
    std::string out;
    for (std::size_t i = 0; i < ndim; ++i) out += (i ? ", " : "") + std::string(names_[i]);
    return out;
  }

 private:
  C& sub_comm(const std::vector<std::size_t>& axes) {
    auto it = subs_.find(axes);
    if (it != subs_.end()) return *it->second;
    // color: row-major index over the axes not chosen; key: row-major index over the chosen ones.
    int color = 0, key = 0;
    std::vector<bool> chosen(ndim, false);
    for (std::size_t a : axes) chosen[a] = true;
    for (std::size_t i = 0; i < ndim; ++i)
      if (!chosen[i]) color = color * shape_[i] + coords_[i];
    for (std::size_t a : axes) key = key * shape_[a] + coords_[a];
    auto sub = std::make_unique<C>(world_->split(color, key));
    C& ref = *sub;
    subs_.emplace(axes, std::move(sub));
    return ref;
  }

  static constexpr const char* names_[ndim] = {
      detail::axis_name_or<Axes>("axis")...};

  C* world_;
  Coords shape_;
  Coords coords_{};
  std::map<std::vector<std::size_t>, std::unique_ptr<C>> subs_;
};

// make_mesh<pp, dp, tp>(comm, {2, 2, 2}); a collective over comm (it builds one sub-communicator
// per axis). Throws when the product of the sizes differs from comm.size().
template <class... Axes, class C>
  requires Communicator<C>
Mesh<C, Axes...> make_mesh(C& comm, const std::array<int, sizeof...(Axes)>& shape) {
  return Mesh<C, Axes...>(comm, shape);
}

}  // namespace trellis::comm

namespace trellis {
using comm::make_mesh;
using comm::Mesh;
}  // namespace trellis
