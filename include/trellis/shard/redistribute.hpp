// redistribute<NewPlacements...>(x): the compile-time plan (shard/plan.hpp) unrolled into calls of
// the collectives it needs, on the mesh axis of each step; distribute() (full tensor at a root ->
// shards) and full_tensor() (shards -> full tensor on every rank).
//
// Uneven shards: equal-count collectives (all_gather, reduce_scatter) are run on blocks padded to
// the largest part (chunk 0 of the balanced rule), then unpadded; all_to_all uses all_to_allv with
// exact counts. When the split dimension is the outermost non-unit one and the parts are equal,
// the collective runs straight on the tensors' memory (no packing), so redistribute costs what
// the bare collective costs.
//
// CUDA seam: every communication goes through Collectives<Space>, every local copy through
// LocalOps<Space>. The host versions call the communicator directly. A CUDA build adds
// specialisations for Cuda that take the tensor's stream (the NCCL communicator's stream argument)
// and launch the packing kernels on it; the plan and the steps do not change.
#pragma once

#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

#include "trellis/core/buffer.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/shard/collectives.hpp"
#include "trellis/shard/layout.hpp"
#include "trellis/shard/local_ops.hpp"
#include "trellis/shard/placement.hpp"
#include "trellis/shard/plan.hpp"
#include "trellis/shard/sharded.hpp"

namespace trellis::shard {

namespace detail {

template <int R>
index_t product_before(const std::array<index_t, R>& shape, int dim) {
  index_t p = 1;
  for (int d = 0; d < dim; ++d) p *= shape[d];
  return p;
}
template <int R>
index_t product(const std::array<index_t, R>& shape) {
  return product_before<R>(shape, R);
}

// A contiguous rank-R view over `data` with `shape`.
template <class T, int R, class Space>
View<T, R, Space> dense(T* data, const std::array<index_t, R>& shape) {
  return {data, dextents<R>(shape)};
}

// ---- the steps; each takes the current local tensor and returns the new one ----------------
// `parent`: the extent of the touched dimension before this axis splits it (after the earlier
// axes have): the gathered result along it, or what is being split.

// S(d) -> R: all_gather along d, padded to the largest part when parts differ.
template <class T, int R, class Space, class C>
Tensor<T, R, Space> gather_dim(C& c, int n, int me, const Tensor<T, R, Space>& in, int d, index_t parent) {
  using Ops = LocalOps<Space>;
  using Coll = Collectives<Space>;
  std::array<index_t, R> out_shape = in.shape();
  out_shape[d] = parent;
  Tensor<T, R, Space> out(out_shape);
  const index_t padded = max_chunk(parent, n);
  std::array<index_t, R> block_shape = in.shape();
  block_shape[d] = padded;
  const std::size_t count = static_cast<std::size_t>(product<R>(block_shape));
  if (count == 0) return out;
  if (chunks_even(parent, n) && product_before<R>(in.shape(), d) == 1) {
    Coll::all_gather(c, in.data(), out.data(), count);  // parts are contiguous in `out`
    return out;
  }
  const bool mine_full = in.extent(d) == padded;
  auto send = Ops::template scratch<T>(mine_full ? 0 : count, false);
  if (!mine_full) Ops::copy(in.view(), dense<T, R, Space>(send.data(), block_shape).slice(d, 0, in.extent(d)));
  auto recv = Ops::template scratch<T>(count * static_cast<std::size_t>(n), false);
  Coll::all_gather(c, mine_full ? in.data() : send.data(), recv.data(), count);
  for (int i = 0; i < n; ++i) {
    const Chunk part = chunk(parent, n, i);
    auto block = dense<T, R, Space>(recv.data() + count * static_cast<std::size_t>(i), block_shape);
    View<const T, R, Space> src = block.slice(d, 0, part.size);
    Ops::copy(src, out.view().slice(d, part.offset, part.offset + part.size));
  }
  (void)me;
  return out;
}

// P -> S(e): reduce_scatter along e (the local extent of e is the whole parent), padded.
template <class T, int R, class Space, class C>
Tensor<T, R, Space> reduce_scatter_dim(C& c, int n, int me, const Tensor<T, R, Space>& in, int e, ReduceOp op) {
  using Ops = LocalOps<Space>;
  using Coll = Collectives<Space>;
  const index_t parent = in.extent(e);
  const Chunk mine = chunk(parent, n, me);
  std::array<index_t, R> out_shape = in.shape();
  out_shape[e] = mine.size;
  Tensor<T, R, Space> out(out_shape);
  const index_t padded = max_chunk(parent, n);
  std::array<index_t, R> block_shape = in.shape();
  block_shape[e] = padded;
  const std::size_t count = static_cast<std::size_t>(product<R>(block_shape));
  if (count == 0) return out;
  if (chunks_even(parent, n) && product_before<R>(in.shape(), e) == 1) {
    Coll::reduce_scatter(c, in.data(), out.data(), count, op);
    return out;
  }
  auto send = Ops::template scratch<T>(count * static_cast<std::size_t>(n), true);  // zero padding, dropped after
  for (int i = 0; i < n; ++i) {
    const Chunk part = chunk(parent, n, i);
    auto block = dense<T, R, Space>(send.data() + count * static_cast<std::size_t>(i), block_shape);
    Ops::copy(in.view().slice(e, part.offset, part.offset + part.size), block.slice(e, 0, part.size));
  }
  const bool mine_full = mine.size == padded;
  auto recv = Ops::template scratch<T>(mine_full ? 0 : count, false);
  Coll::reduce_scatter(c, send.data(), mine_full ? out.data() : recv.data(), count, op);
  if (!mine_full) {
    View<const T, R, Space> src = dense<T, R, Space>(recv.data(), block_shape).slice(e, 0, mine.size);
    Ops::copy(src, out.view().dynamic_view());
  }
  return out;
}

// S(d) -> S(e): all_to_allv; block j of dimension e goes to rank j, which places it at part j of d.
template <class T, int R, class Space, class C>
Tensor<T, R, Space> all_to_all_dims(C& c, int n, int me, const Tensor<T, R, Space>& in, int d, int e,
                                    index_t parent_d) {
  using Ops = LocalOps<Space>;
  using Coll = Collectives<Space>;
  const index_t parent_e = in.extent(e);
  const Chunk mine_e = chunk(parent_e, n, me);
  std::array<index_t, R> out_shape = in.shape();
  out_shape[d] = parent_d;
  out_shape[e] = mine_e.size;
  Tensor<T, R, Space> out(out_shape);
  std::vector<std::size_t> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
  std::size_t send_total = 0, recv_total = 0;
  for (int j = 0; j < n; ++j) {
    std::array<index_t, R> s = in.shape(), r = in.shape();
    s[e] = chunk(parent_e, n, j).size;
    r[d] = chunk(parent_d, n, j).size;
    r[e] = mine_e.size;
    send_counts[j] = static_cast<std::size_t>(product<R>(s));
    recv_counts[j] = static_cast<std::size_t>(product<R>(r));
    send_displs[j] = send_total;
    recv_displs[j] = recv_total;
    send_total += send_counts[j];
    recv_total += recv_counts[j];
  }
  auto send = Ops::template scratch<T>(send_total, false);
  auto recv = Ops::template scratch<T>(recv_total, false);
  for (int j = 0; j < n; ++j) {
    const Chunk part = chunk(parent_e, n, j);
    std::array<index_t, R> s = in.shape();
    s[e] = part.size;
    Ops::copy(in.view().slice(e, part.offset, part.offset + part.size),
              dense<T, R, Space>(send.data() + send_displs[j], s));
  }
  Coll::all_to_allv(c, send.data(), send_counts, send_displs, recv.data(), recv_counts, recv_displs);
  for (int j = 0; j < n; ++j) {
    const Chunk part = chunk(parent_d, n, j);
    std::array<index_t, R> r = out_shape;
    r[d] = part.size;
    View<const T, R, Space> src = dense<T, R, Space>(recv.data() + recv_displs[j], r);
    Ops::copy(src, out.view().slice(d, part.offset, part.offset + part.size));
  }
  return out;
}

// R -> S(e): keep part `me` of dimension e; no communication.
template <class T, int R, class Space>
Tensor<T, R, Space> slice_dim(int n, int me, const Tensor<T, R, Space>& in, int e) {
  const Chunk part = chunk(in.extent(e), n, me);
  std::array<index_t, R> out_shape = in.shape();
  out_shape[e] = part.size;
  Tensor<T, R, Space> out(out_shape);
  LocalOps<Space>::copy(in.view().slice(e, part.offset, part.offset + part.size), out.view().dynamic_view());
  return out;
}

// P -> R: all_reduce.
template <class T, int R, class Space, class C>
Tensor<T, R, Space> reduce_all(C& c, const Tensor<T, R, Space>& in, ReduceOp op) {
  Tensor<T, R, Space> out(in.shape());
  if (in.size() > 0) Collectives<Space>::all_reduce(c, in.data(), out.data(), static_cast<std::size_t>(in.size()), op);
  return out;
}

// R -> P(op): sum keeps the values on coordinate 0 and zeros elsewhere (exact: no division);
// avg, max and min keep them everywhere (the average, max, min of equal terms is the term).
template <class T, int R, class Space>
Tensor<T, R, Space> make_partial(int me, const Tensor<T, R, Space>& in, ReduceOp op) {
  Tensor<T, R, Space> out(in.shape());  // zero-filled
  if (op != ReduceOp::sum || me == 0) LocalOps<Space>::copy(in.view(), out.view());
  return out;
}

template <Step S, auto State, class Mesh, class T, int R, class Space>
Tensor<T, R, Space> run_step(Mesh& mesh, const std::array<index_t, R>& global_shape, const Tensor<T, R, Space>& in) {
  auto& c = axis_comm<S.axis>(mesh);
  const int n = c.size();
  const int me = c.rank();
  if constexpr (S.kind == StepKind::all_gather || S.kind == StepKind::all_to_all) {
    // The gathered dimension's extent at this axis' level: nesting over the earlier axes only.
    const index_t parent =
        dim_range(global_shape[S.from_dim], S.from_dim, State, mesh_sizes(mesh), mesh_coords(mesh), S.axis).size;
    if constexpr (S.kind == StepKind::all_gather) {
      return gather_dim<T, R, Space>(c, n, me, in, S.from_dim, parent);
    } else {
      return all_to_all_dims<T, R, Space>(c, n, me, in, S.from_dim, S.to_dim, parent);
    }
  } else if constexpr (S.kind == StepKind::reduce_scatter) {
    return reduce_scatter_dim<T, R, Space>(c, n, me, in, S.to_dim, S.op);
  } else if constexpr (S.kind == StepKind::all_reduce) {
    return reduce_all<T, R, Space>(c, in, S.op);
  } else if constexpr (S.kind == StepKind::slice) {
    return slice_dim<T, R, Space>(n, me, in, S.to_dim);
  } else {
    return make_partial<T, R, Space>(me, in, S.op);
  }
}

template <class T, int R, class Space>
Tensor<T, R, Space> clone(const Tensor<T, R, Space>& in) {
  Tensor<T, R, Space> out(in.shape());
  LocalOps<Space>::copy(in.view(), out.view());
  return out;
}

// Runs the plan from From to To on `local`; returns the new local tensor.
template <class From, class To, class Mesh, class T, int R, class Space>
Tensor<T, R, Space> run_plan(Mesh& mesh, const std::type_identity_t<std::array<index_t, R>>& global_shape,
                             const Tensor<T, R, Space>& local) {
  static constexpr auto plan = plan_v<From, To>;
  static_assert(plan.ok, "trellis::shard: no redistribution plan (planner bug)");
  Tensor<T, R, Space> cur;
  const Tensor<T, R, Space>* src = &local;
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    ((cur = run_step<plan.steps[I], plan.states[I], Mesh, T, R, Space>(mesh, global_shape, *src), src = &cur), ...);
  }(std::make_index_sequence<static_cast<std::size_t>(plan.count)>{});
  return cur;
}

}  // namespace detail

// The type of x after redistribute<New...>(x).
template <class X, class NewLayout>
using redistributed_t = Sharded<typename X::element_type, X::rank, typename X::mesh_type, NewLayout, typename X::space>;

// x laid out as Placements<New...>. Collective over the mesh axes whose placement changes (every
// rank calls it). Identical placements: no collective, no packing (a copy of the local shard for
// an lvalue, nothing at all for an rvalue).
template <Placement... New, class T, int R, class Mesh, class L, class Space>
  requires(LayoutFor<Placements<New...>, R, L::size>)
Sharded<T, R, Mesh, Placements<New...>, Space> redistribute(const Sharded<T, R, Mesh, L, Space>& x) {
  using To = Placements<New...>;
  if constexpr (plan_v<L, To>.count == 0) {
    return {x.mesh(), x.global_shape(), detail::clone(x.local()), unchecked};
  } else {
    return {x.mesh(), x.global_shape(), detail::run_plan<L, To>(x.mesh(), x.global_shape(), x.local()), unchecked};
  }
}

template <Placement... New, class T, int R, class Mesh, class L, class Space>
  requires(LayoutFor<Placements<New...>, R, L::size>)
Sharded<T, R, Mesh, Placements<New...>, Space> redistribute(Sharded<T, R, Mesh, L, Space>&& x) {
  using To = Placements<New...>;
  if constexpr (plan_v<L, To>.count == 0) {
    return {x.mesh(), x.global_shape(), std::move(x.local()), unchecked};
  } else {
    return {x.mesh(), x.global_shape(), detail::run_plan<L, To>(x.mesh(), x.global_shape(), x.local()), unchecked};
  }
}

// The whole tensor on every rank (all_gather / all_reduce over every axis that needs it).
template <class T, int R, class Mesh, class L, class Space>
Tensor<T, R, Space> full_tensor(const Sharded<T, R, Mesh, L, Space>& x) {
  using To = AllReplicate<L::size>;
  if constexpr (plan_v<L, To>.count == 0) {
    return detail::clone(x.local());
  } else {
    return detail::run_plan<L, To>(x.mesh(), x.global_shape(), x.local());
  }
}

// Shards of `full`, which only the rank at mesh coordinates `root` has to provide (others pass an
// empty view). The global shape and data are broadcast from the root axis by axis; then each
// rank keeps its part (Partial sum: the root-coordinate-0 ranks hold the values, others zeros).
// Collective over the whole mesh.
template <Placement... P, class Mesh, class T, class E, class Space>
  requires(LayoutFor<Placements<P...>, E::rank, mesh_axis_count<Mesh>>)
Sharded<std::remove_const_t<T>, E::rank, Mesh, Placements<P...>, Space> distribute(
    Mesh& mesh, const TensorView<T, E, Space>& full,
    const std::array<int, static_cast<std::size_t>(mesh_axis_count<Mesh>)>& root = {}) {
  using U = std::remove_const_t<T>;
  constexpr int R = E::rank;
  using L = Placements<P...>;
  constexpr std::size_t N = static_cast<std::size_t>(mesh_axis_count<Mesh>);
  const auto sizes = mesh_sizes(mesh);
  const auto coords = mesh_coords(mesh);
  for (std::size_t a = 0; a < N; ++a)
    TRELLIS_CHECK(root[a] >= 0 && root[a] < sizes[a], "distribute: root coordinate ", root[a], " on mesh axis ", a,
                  " of size ", sizes[a]);
  const bool is_root = coords == root;
  std::array<index_t, R> shape{};
  if (is_root)
    for (int d = 0; d < R; ++d) shape[d] = full.extent(d);
  std::array<index_t, R> global{};
  Tensor<U, R, Space> all;
  // Axis by axis: after axis a, every rank that agrees with the root on axes > a has the data.
  auto agrees_after = [&](std::size_t a) {
    for (std::size_t b = a + 1; b < N; ++b)
      if (coords[b] != root[b]) return false;
    return true;
  };
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          if (agrees_after(I))
            Collectives<Space>::host_broadcast(axis_comm<static_cast<int>(I)>(mesh), shape.data(), R, root[I]);
        }(),
        ...);
    for (int d = 0; d < R; ++d) global[d] = shape[d];
    all = Tensor<U, R, Space>(global);
    if (is_root) LocalOps<Space>::copy(full, all.view());
    (
        [&] {
          if (agrees_after(I) && all.size() > 0)
            Collectives<Space>::broadcast(axis_comm<static_cast<int>(I)>(mesh), all.data(),
                                          static_cast<std::size_t>(all.size()), root[I]);
        }(),
        ...);
  }(std::make_index_sequence<N>{});
  const auto box = local_box<R>(global, L::codes, sizes, coords);
  std::array<index_t, R> local_shape{};
  for (int d = 0; d < R; ++d) local_shape[d] = box[d].size;
  Tensor<U, R, Space> local(local_shape);
  bool zero = false;
  for (std::size_t a = 0; a < N; ++a)
    if (L::codes[a].is_partial() && L::codes[a].op == ReduceOp::sum && coords[a] != 0) zero = true;
  if (!zero) {
    View<const U, R, Space> src = all.view();
    for (int d = 0; d < R; ++d) src = src.slice(d, box[d].offset, box[d].offset + box[d].size);
    LocalOps<Space>::copy(src, local.view());
  }
  return {mesh, global, std::move(local), unchecked};
}

// The same, with the layout named as one type: distribute<Placements<Shard<0>, Replicate>>(...),
// redistribute<Placements<...>>(x) (handy where layouts are computed by type functions).
template <class L, class Mesh, class T, class E, class Space>
  requires(is_placements<L>::value && LayoutFor<L, E::rank, mesh_axis_count<Mesh>>)
Sharded<std::remove_const_t<T>, E::rank, Mesh, L, Space> distribute(
    Mesh& mesh, const TensorView<T, E, Space>& full,
    const std::array<int, static_cast<std::size_t>(mesh_axis_count<Mesh>)>& root = {}) {
  return [&]<class... P>(Placements<P...>*) { return distribute<P...>(mesh, full, root); }(static_cast<L*>(nullptr));
}

template <class L, class X>
  requires(is_placements<L>::value && is_sharded<std::remove_cvref_t<X>>::value &&
           LayoutFor<L, std::remove_cvref_t<X>::rank, std::remove_cvref_t<X>::axes>)
redistributed_t<std::remove_cvref_t<X>, L> redistribute(X&& x) {
  return [&]<class... P>(Placements<P...>*) {
    return redistribute<P...>(std::forward<X>(x));
  }(static_cast<L*>(nullptr));
}

}  // namespace trellis::shard
