// Sharded<T, R, Mesh, Placements<P...>, Space>: this rank's piece of a rank-R tensor laid out over
// a device mesh, one placement per mesh axis. The placements are part of the type, so layouts
// are checked and transitions chosen by the compiler; sizes, coordinates and the global shape are
// values. The local shard is an owning trellis::Tensor in memory space Space (Host today; the
// code that touches data goes through LocalOps<Space>/Collectives<Space>, the CUDA seam).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/space.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/shard/collectives.hpp"
#include "trellis/shard/layout.hpp"
#include "trellis/shard/placement.hpp"

namespace trellis::shard {

// ---- how shard/ reads a mesh -------------------------------------------------------------------
// A mesh type is Mesh<Comm, AxisTags...> (comm/mesh.hpp); shard/ needs its axis tags in order and,
// per tag, mesh.comm<Tag>(), mesh.size<Tag>() and mesh.coord<Tag>().
template <class Mesh>
struct mesh_traits {  // not a mesh: no axes (so overloads taking a mesh drop out quietly)
  using axes = std::tuple<>;
  static constexpr int axis_count = 0;
};

template <template <class, class...> class M, class C, class... Axes>
struct mesh_traits<M<C, Axes...>> {
  using comm_type = C;
  using axes = std::tuple<Axes...>;
  static constexpr int axis_count = static_cast<int>(sizeof...(Axes));
};

template <class Mesh>
inline constexpr int mesh_axis_count = mesh_traits<std::remove_cvref_t<Mesh>>::axis_count;

template <class Mesh, int I>
using mesh_axis_t = std::tuple_element_t<static_cast<std::size_t>(I), typename mesh_traits<std::remove_cvref_t<Mesh>>::axes>;

// Placements<Replicate, ..., Replicate> with one entry per mesh axis.
template <class Seq> struct all_replicate_impl;
// (A struct, not an alias template ignoring its argument: nvcc loses the pack through those.)
template <std::size_t> struct replicate_for { using type = Replicate; };
template <std::size_t... I> struct all_replicate_impl<std::index_sequence<I...>> {
  using type = Placements<typename replicate_for<I>::type...>;
};
template <int Axes>
using AllReplicate = typename all_replicate_impl<std::make_index_sequence<static_cast<std::size_t>(Axes)>>::type;

template <int I, class Mesh>
decltype(auto) axis_comm(Mesh& mesh) {
  return mesh.template comm<mesh_axis_t<Mesh, I>>();
}

// Per-axis sizes and this rank's coordinates, in mesh-axis order.
template <class Mesh>
std::array<int, static_cast<std::size_t>(mesh_axis_count<Mesh>)> mesh_sizes(Mesh& mesh) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<int, sizeof...(I)>{static_cast<int>(mesh.template size<mesh_axis_t<Mesh, static_cast<int>(I)>>())...};
  }(std::make_index_sequence<static_cast<std::size_t>(mesh_axis_count<Mesh>)>{});
}
template <class Mesh>
std::array<int, static_cast<std::size_t>(mesh_axis_count<Mesh>)> mesh_coords(Mesh& mesh) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::array<int, sizeof...(I)>{static_cast<int>(mesh.template coord<mesh_axis_t<Mesh, static_cast<int>(I)>>())...};
  }(std::make_index_sequence<static_cast<std::size_t>(mesh_axis_count<Mesh>)>{});
}

namespace detail {
template <class A>
std::string array_string(const A& a) {
  std::ostringstream out;
  out << "(";
  for (std::size_t i = 0; i < a.size(); ++i) out << (i ? ", " : "") << a[i];
  out << ")";
  return out.str();
}

// Every rank must build a sharded tensor with the same global shape, mesh and layout. The
// fingerprint (global shape, mesh sizes, layout) is all-gathered along each mesh axis in turn
// (agreement along every axis = agreement everywhere) and compared; every rank sees the same
// gathered data, so either all ranks throw or none does (no hang).
template <class Space, class Mesh, int R, std::size_t N>
void check_same_everywhere(Mesh& mesh, const std::array<index_t, R>& global_shape,
                           const std::array<PlacementCode, N>& codes) {
  constexpr std::size_t len = static_cast<std::size_t>(R) + 2 * N;
  std::array<std::int64_t, len> mine{};
  const auto sizes = mesh_sizes(mesh);
  for (int d = 0; d < R; ++d) mine[d] = global_shape[d];
  for (std::size_t a = 0; a < N; ++a) {
    mine[R + a] = sizes[a];
    mine[R + N + a] = ((static_cast<std::int64_t>(codes[a].kind) * 4096 + codes[a].dim) * 16 + static_cast<int>(codes[a].op)) * 4096 +
                      codes[a].order;
  }
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          auto& c = axis_comm<static_cast<int>(I)>(mesh);
          const int n = c.size();
          std::vector<std::int64_t> all(len * static_cast<std::size_t>(n));
          Collectives<Space>::host_all_gather(c, mine.data(), all.data(), len);
          for (int r = 0; r < n; ++r) {
            const std::int64_t* theirs = all.data() + len * static_cast<std::size_t>(r);
            std::array<index_t, R> their_shape{};
            std::array<std::int64_t, N> their_sizes{};
            for (int d = 0; d < R; ++d) their_shape[d] = theirs[d];
            for (std::size_t a = 0; a < N; ++a) their_sizes[a] = theirs[R + a];
            if (their_shape != global_shape)
              TRELLIS_THROW("sharded tensor: global shape differs across ranks: rank ", r, " of mesh axis ", I,
                            " has ", array_string(their_shape), ", this rank ", array_string(global_shape));
            for (std::size_t a = 0; a < N; ++a)
              if (their_sizes[a] != sizes[a])
                TRELLIS_THROW("sharded tensor: mesh differs across ranks: rank ", r, " of mesh axis ", I,
                              " has sizes ", array_string(their_sizes), ", this rank ", array_string(sizes));
            for (std::size_t a = 0; a < N; ++a)
              if (theirs[R + N + a] != mine[R + N + a])
                TRELLIS_THROW("sharded tensor: placements differ across ranks (mesh axis ", a, ", rank ", r,
                              " of mesh axis ", I, ")");
          }
        }(),
        ...);
  }(std::make_index_sequence<N>{});
}
}  // namespace detail

struct unchecked_t {
  explicit unchecked_t() = default;
};
inline constexpr unchecked_t unchecked{};

template <class T, int R, class Mesh, class Layout, class Space = Host>
  requires(Element<T> && MemorySpace<Space> && LayoutFor<Layout, R, mesh_axis_count<Mesh>>)
class Sharded {
 public:
  using element_type = T;
  using mesh_type = Mesh;
  using layout = Layout;
  using space = Space;
  using local_type = Tensor<T, R, Space>;
  static constexpr int rank = R;
  static constexpr int axes = Layout::size;
  static constexpr std::array<PlacementCode, static_cast<std::size_t>(Layout::size)> placements = Layout::codes;

  // Adopts this rank's shard of a tensor of `global_shape`. Collective over the mesh: checks that
  // every rank gives the same global shape, mesh and layout, and that `local` has the shape the
  // uneven-size rule gives this rank; throws trellis::Error naming the difference otherwise.
  static Sharded from_local(Mesh& mesh, local_type local, const std::array<index_t, R>& global_shape) {
    // The collective comparison first: then every rank reaches the same verdict below.
    detail::check_same_everywhere<Space, Mesh, R>(mesh, global_shape, Layout::codes);
    for (int d = 0; d < R; ++d)
      TRELLIS_CHECK(global_shape[d] >= 0, "sharded tensor: negative global extent ", global_shape[d], " in dimension ", d);
    const auto expected = local_shape<R>(global_shape, Layout::codes, mesh_sizes(mesh), mesh_coords(mesh));
    if (local.shape() != expected)
      TRELLIS_THROW("sharded tensor: local shard has shape ", detail::array_string(local.shape()), " but global shape ",
                    detail::array_string(global_shape), " under this layout gives this rank ",
                    detail::array_string(expected));
    return Sharded(mesh, global_shape, std::move(local), unchecked);
  }

  // Internal: the caller guarantees consistency (redistribute, distribute).
  Sharded(Mesh& mesh, const std::array<index_t, R>& global_shape, local_type local, unchecked_t)
      : mesh_(&mesh), global_shape_(global_shape), local_(std::move(local)) {}

  Sharded(Sharded&&) noexcept = default;
  Sharded& operator=(Sharded&&) noexcept = default;

  Mesh& mesh() const { return *mesh_; }
  const std::array<index_t, R>& global_shape() const { return global_shape_; }
  local_type& local() { return local_; }
  const local_type& local() const { return local_; }
  View<T, R, Space> local_view() { return local_.view(); }
  View<const T, R, Space> local_view() const { return local_.view(); }
  // Where this rank's shard starts in the global tensor (for checkpoints and index math).
  std::array<index_t, R> local_offsets() const {
    return shard::local_offsets<R>(global_shape_, Layout::codes, mesh_sizes(*mesh_), mesh_coords(*mesh_));
  }

 private:
  Mesh* mesh_;
  std::array<index_t, R> global_shape_;
  local_type local_;
};

template <class X> struct is_sharded : std::false_type {};
template <class T, int R, class M, class L, class S> struct is_sharded<Sharded<T, R, M, L, S>> : std::true_type {};

}  // namespace trellis::shard
