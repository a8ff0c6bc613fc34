// Extents, views, slicing and owning tensors, against index arithmetic written out by hand.
#include <catch2/catch.hpp>

#include "trellis/core/tensor.hpp"

using namespace trellis;

TEST_CASE("static and dynamic extents", "[tensor]") {
  using E = Extents<dynamic, 4>;
  STATIC_REQUIRE(E::rank == 2);
  STATIC_REQUIRE(E::rank_dynamic == 1);
  STATIC_REQUIRE(E::static_extent(1) == 4);
  E e(3, 4);
  REQUIRE(e.extent(0) == 3);
  REQUIRE(e.extent(1) == 4);
  REQUIRE(e.size() == 12);
  REQUIRE_THROWS_AS(E::checked({3, 5}), Error);
  REQUIRE_THROWS_AS(E::checked({-1, 4}), Error);
  constexpr Extents<2, 3> fixed;
  STATIC_REQUIRE(fixed.size() == 6);
}

TEST_CASE("row-major view indexing, slicing, select, transpose", "[tensor]") {
  Tensor<float, 3> t({2, 3, 4});
  for (index_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<float>(i);
  auto v = t.view();
  REQUIRE(v.is_contiguous());
  REQUIRE(v(1, 2, 3) == 1 * 12 + 2 * 4 + 3);

  auto s = v.slice(1, 1, 3);  // (2, 2, 4)
  REQUIRE(s.extent(1) == 2);
  REQUIRE(s(0, 0, 0) == 4.0f);
  REQUIRE(s(1, 1, 2) == 12 + 8 + 2);
  REQUIRE_FALSE(s.is_contiguous());

  auto row = v.select(0, 1);  // (3, 4)
  REQUIRE(row.rank == 2);
  REQUIRE(row(2, 1) == 12 + 8 + 1);

  auto tr = v.transpose(0, 2);  // (4, 3, 2)
  REQUIRE(tr.extent(0) == 4);
  REQUIRE(tr(3, 1, 1) == v(1, 1, 3));

  REQUIRE_THROWS_AS(v.slice(1, 2, 4), Error);
  REQUIRE_THROWS_AS(v.select(3, 0), Error);
  REQUIRE_THROWS_AS((Tensor<float, 2>{1, 2, 3}), Error);
}

TEST_CASE("static-extent views over caller memory", "[tensor]") {
  float data[6] = {0, 1, 2, 3, 4, 5};
  TensorView<float, Extents<2, 3>> v(data, Extents<2, 3>{});
  REQUIRE(v(1, 0) == 3.0f);
  TensorView<const float, Extents<2, 3>> c = v;
  REQUIRE(c(1, 2) == 5.0f);
  auto d = v.dynamic_view();
  REQUIRE(d.extent(1) == 3);
}

TEST_CASE("host buffers are aligned, zeroed and movable", "[tensor]") {
  Buffer<double> b(1000);
  REQUIRE(reinterpret_cast<std::uintptr_t>(b.data()) % TRELLIS_HOST_ALIGNMENT == 0);
  for (double x : b) REQUIRE(x == 0.0);
  b[3] = 7;
  Buffer<double> moved = std::move(b);
  REQUIRE(moved[3] == 7);
  REQUIRE(b.size() == 0);
  REQUIRE(b.data() == nullptr);
}
