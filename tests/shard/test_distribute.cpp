// distribute (full tensor at a root -> shards) and full_tensor (shards -> full tensor) on thread
// ranks, against the independent index model; and bad input across ranks (global shapes or meshes
// that differ) as a trellis::Error on every rank instead of a hang.
#include <catch2/catch.hpp>

#include "redistribute_properties.hpp"
#include "trellis/comm/threads.hpp"

using namespace shard_test;
using trellis::Error;
using trellis::comm::ThreadWorld;

namespace {
template <class L, class Mesh>
void distribute_and_back(Mesh& mesh, const std::array<index_t, 2>& global, std::array<int, 2> root, Failures& f) {
  // Only the root fills the full tensor; the others pass an empty view.
  const bool is_root = mesh_coords(mesh) == root;
  Tensor<float, 2> full(is_root ? global : std::array<index_t, 2>{0, 0});
  for (index_t i = 0; i < full.size(); ++i) full.data()[i] = static_cast<float>(global_value(i, 1));
  auto x = distribute<L>(mesh, full.view(), root);
  // The shard must be G over the model box (Partial: reduced with the communicator directly).
  Tensor<float, 2> reduced(x.local().shape());
  LocalOps<trellis::Host>::copy(x.local().view(), reduced.view());
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (
        [&] {
          if constexpr (L::codes[I].kind == PlacementKind::partial)
            if (reduced.size() > 0)
              axis_comm<static_cast<int>(I)>(mesh).all_reduce(reduced.data(), reduced.data(),
                                                              static_cast<std::size_t>(reduced.size()), L::codes[I].op);
        }(),
        ...);
  }(std::make_index_sequence<2>{});
  std::string why;
  if (!equals_model<float, 2>(mesh, reduced, global, L::codes, 1, true, why)) f.add(layout_name(L::codes) + " shard: " + why);
  auto back = full_tensor(x);
  if (!equals_model<float, 2>(mesh, back, global, std::array<PlacementCode, 2>{}, 1, true, why))
    f.add(layout_name(L::codes) + " full: " + why);
  if (x.local_offsets() != [&] {
        std::array<index_t, 2> o{}, s{};
        model_box<2, 2>(global, L::codes, mesh_sizes(mesh), mesh_coords(mesh), o, s);
        return o;
      }())
    f.add(layout_name(L::codes) + " local_offsets");
}
}  // namespace

TEST_CASE("distribute from a root, then gather back", "[shard][distribute]") {
  Failures failures;
  ThreadWorld(6).run([&](auto& world) {
    auto mesh = trellis::make_mesh<trellis::dp, trellis::tp>(world, {2, 3});
    for (auto shape : {std::array<index_t, 2>{6, 9}, std::array<index_t, 2>{7, 4}, std::array<index_t, 2>{1, 2}}) {
      for (auto root : {std::array<int, 2>{0, 0}, std::array<int, 2>{1, 2}}) {
        distribute_and_back<Placements<Shard<0>, Shard<1>>>(mesh, shape, root, failures);
        distribute_and_back<Placements<Shard<1>, Shard<1>>>(mesh, shape, root, failures);
        distribute_and_back<Placements<Replicate, Shard<0>>>(mesh, shape, root, failures);
        distribute_and_back<Placements<Partial<>, Shard<0>>>(mesh, shape, root, failures);
        distribute_and_back<Placements<Partial<ReduceOp::max>, Partial<ReduceOp::max>>>(mesh, shape, root, failures);
      }
    }
  });
  INFO((failures.first.empty() ? std::string() : failures.first.front()));
  REQUIRE(failures.count == 0);
}

TEST_CASE("global shapes that differ across ranks are a trellis::Error", "[shard][errors]") {
  auto run = [] {
    ThreadWorld(4).run([&](auto& world) {
      auto mesh = trellis::make_mesh<trellis::dp, trellis::tp>(world, {2, 2});
      const std::array<index_t, 2> global{8, world.rank() == 3 ? 5 : 4};
      using X = Sharded<float, 2, std::remove_cvref_t<decltype(mesh)>, Placements<Shard<0>, Replicate>>;
      auto shape = local_shape<2>(global, X::placements, mesh_sizes(mesh), mesh_coords(mesh));
      X::from_local(mesh, Tensor<float, 2>(shape), global);
    });
  };
  REQUIRE_THROWS_AS(run(), Error);
  REQUIRE_THROWS_WITH(run(), Catch::Contains("global shape differs across ranks"));
}

TEST_CASE("meshes that differ across ranks are a trellis::Error", "[shard][errors]") {
  auto run = [] {
    ThreadWorld(4).run([&](auto& world) {
      // Rank 0 believes in a 4 x 1 mesh, the others in 2 x 2.
      const std::array<int, 2> sizes = world.rank() == 0 ? std::array<int, 2>{4, 1} : std::array<int, 2>{2, 2};
      auto mesh = trellis::make_mesh<trellis::dp, trellis::tp>(world, sizes);
      using X = Sharded<float, 1, std::remove_cvref_t<decltype(mesh)>, Placements<Replicate, Replicate>>;
      X::from_local(mesh, Tensor<float, 1>({4}), {4});
    });
  };
  REQUIRE_THROWS_WITH(run(), Catch::Contains("mesh differs across ranks"));
}

TEST_CASE("distribute checks the root coordinate", "[shard][errors]") {
  auto run = [] {
    ThreadWorld(2).run([&](auto& world) {
      auto mesh = trellis::make_mesh<trellis::dp>(world, {2});
      Tensor<float, 1> full({4});
      distribute<Placements<Shard<0>>>(mesh, full.view(), {2});
    });
  };
  REQUIRE_THROWS_WITH(run(), Catch::Contains("root coordinate 2"));
}
