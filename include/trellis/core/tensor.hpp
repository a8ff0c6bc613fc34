// Extents, TensorView (non-owning, strided) and Tensor (owning) in any memory space.
// Extents mix static sizes (template arguments, known to the compiler) and dynamic ones (values),
// as in CuTe and std::mdspan: Extents<dynamic, 64> is "rows at run time, 64 columns always".
// The index math is TRELLIS_HD so kernels use the same code that the host tests check.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <type_traits>
#include <utility>

#include "trellis/core/buffer.hpp"
#include "trellis/core/config.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/space.hpp"

namespace trellis {

using index_t = std::int64_t;
inline constexpr index_t dynamic = -1;

template <index_t... Static>
class Extents {
 public:
  static constexpr int rank = static_cast<int>(sizeof...(Static));
  static constexpr std::array<index_t, sizeof...(Static)> static_extents{Static...};
  static constexpr int rank_dynamic = static_cast<int>(((Static == dynamic) + ... + 0));

  // The compile-time size of dimension i, or `dynamic`.
  static constexpr index_t static_extent(int i) { return static_extents[static_cast<std::size_t>(i)]; }
  // The same from the template arguments directly: device code cannot index the host array
  // static_extents at run time (nvcc instantiates these TRELLIS_HD members for the device too).
  TRELLIS_HD static constexpr index_t static_at(int i) {
    index_t s = dynamic;
    int k = 0;
    ((s = (k++ == i ? Static : s)), ...);
    return s;
  }

  TRELLIS_HD constexpr Extents() {
    for (int i = 0; i < rank; ++i) values_[i] = static_at(i) == dynamic ? 0 : static_at(i);
  }
  // All `rank` sizes; static ones must agree with the template arguments.
  TRELLIS_HD constexpr Extents(const std::array<index_t, sizeof...(Static)>& sizes) {
    for (int i = 0; i < rank; ++i) values_[i] = sizes[i];
  }
  template <class... I>
    requires(sizeof...(I) == sizeof...(Static) && (std::is_integral_v<I> && ...))
  TRELLIS_HD constexpr explicit Extents(I... sizes)
      : Extents(std::array<index_t, sizeof...(Static)>{static_cast<index_t>(sizes)...}) {}

  // Checked construction: throws if a static extent disagrees with the given size.
  static Extents checked(const std::array<index_t, sizeof...(Static)>& sizes) {
    for (int i = 0; i < rank; ++i) {
      TRELLIS_CHECK(sizes[i] >= 0, "negative extent ", sizes[i], " in dimension ", i);
      TRELLIS_CHECK(static_extents[i] == dynamic || static_extents[i] == sizes[i],
                    "dimension ", i, " is static ", static_extents[i], " but ", sizes[i], " was given");
    }
    return Extents(sizes);
  }

  TRELLIS_HD constexpr index_t extent(int i) const {
    return static_at(i) == dynamic ? values_[i] : static_at(i);
  }
  TRELLIS_HD constexpr index_t size() const {
    index_t n = 1;
    for (int i = 0; i < rank; ++i) n *= extent(i);
    return n;
  }
  constexpr std::array<index_t, sizeof...(Static)> array() const {
    std::array<index_t, sizeof...(Static)> out{};
    for (int i = 0; i < rank; ++i) out[i] = extent(i);
    return out;
  }

 private:
  index_t values_[sizeof...(Static) > 0 ? sizeof...(Static) : 1]{};
};

namespace detail {
template <int R, class Seq = std::make_integer_sequence<int, R>> struct dextents_impl;
template <int R, int... I> struct dextents_impl<R, std::integer_sequence<int, I...>> {
  using type = Extents<((void)I, dynamic)...>;
};
}  // namespace detail

// R dynamic dimensions.
template <int R>
using dextents = typename detail::dextents_impl<R>::type;

template <class E> struct is_extents : std::false_type {};
template <index_t... S> struct is_extents<Extents<S...>> : std::true_type {};

// Row-major (C order) strides for the given extents.
template <class E>
constexpr std::array<index_t, E::rank> row_major_strides(const E& extents) {
  std::array<index_t, E::rank> strides{};
  index_t s = 1;
  for (int i = E::rank - 1; i >= 0; --i) {
    strides[i] = s;
    s *= extents.extent(i);
  }
  return strides;
}

// A non-owning view of T elements in memory space Space, with extents E and element strides.
template <class T, class E, class Space = Host>
class TensorView {
  static_assert(is_extents<E>::value, "E must be trellis::Extents<...>");

 public:
  using element_type = T;
  using extents_type = E;
  using space = Space;
  static constexpr int rank = E::rank;
  using strides_type = std::array<index_t, E::rank>;

  TensorView() = default;
  // Contiguous row-major view.
  TRELLIS_HD constexpr TensorView(T* data, const E& extents)
      : data_(data), extents_(extents), strides_(row_major_strides(extents)) {}
  TRELLIS_HD constexpr TensorView(T* data, const E& extents, const strides_type& strides)
      : data_(data), extents_(extents), strides_(strides) {}

  // A view of const elements converts from a view of mutable ones.
  template <class U>
    requires(std::is_same_v<const U, T> && !std::is_same_v<U, T>)
  TRELLIS_HD constexpr TensorView(const TensorView<U, E, Space>& other)
      : data_(other.data()), extents_(other.extents()), strides_(other.strides()) {}

  TRELLIS_HD constexpr T* data() const { return data_; }
  TRELLIS_HD constexpr const E& extents() const { return extents_; }
  TRELLIS_HD constexpr const strides_type& strides() const { return strides_; }
  TRELLIS_HD constexpr index_t extent(int i) const { return extents_.extent(i); }
  TRELLIS_HD constexpr index_t stride(int i) const { return strides_[i]; }
  TRELLIS_HD constexpr index_t size() const { return extents_.size(); }
  TRELLIS_HD constexpr bool empty() const { return size() == 0; }

  // Offset (in elements) of a multi-index.
  template <class... I>
    requires(sizeof...(I) == E::rank)
  TRELLIS_HD constexpr index_t offset(I... idx) const {
    index_t o = 0;
    int d = 0;
    ((o += static_cast<index_t>(idx) * strides_[d++]), ...);
    return o;
  }
  template <class... I>
    requires(sizeof...(I) == E::rank)
  TRELLIS_HD constexpr T& operator()(I... idx) const {
    return data_[offset(idx...)];
  }

  // True when elements are dense in row-major order (the layout the kernels want).
  constexpr bool is_contiguous() const { return strides_ == row_major_strides(extents_); }

  // Elements [begin, end) along dimension `dim`; the result has dynamic extents.
  TensorView<T, dextents<E::rank>, Space> slice(int dim, index_t begin, index_t end) const {
    TRELLIS_CHECK(dim >= 0 && dim < rank, "slice: dimension ", dim, " of a rank-", rank, " tensor");
    TRELLIS_CHECK(0 <= begin && begin <= end && end <= extent(dim), "slice: [", begin, ", ", end,
                  ") out of range 0..", extent(dim), " in dimension ", dim);
    auto sizes = extents_.array();
    sizes[dim] = end - begin;
    return {data_ + begin * strides_[dim], dextents<E::rank>(sizes), strides_};
  }

  // Fixes dimension `dim` at `index`: a view of rank - 1.
  TensorView<T, dextents<(E::rank > 0 ? E::rank - 1 : 0)>, Space> select(int dim, index_t index) const
    requires(E::rank > 0)
  {
    TRELLIS_CHECK(dim >= 0 && dim < rank, "select: dimension ", dim, " of a rank-", rank, " tensor");
    TRELLIS_CHECK(0 <= index && index < extent(dim), "select: index ", index, " out of range 0..",
                  extent(dim), " in dimension ", dim);
    std::array<index_t, E::rank - 1> sizes{}, strides{};
    for (int i = 0, j = 0; i < rank; ++i) {
      if (i == dim) continue;
      sizes[j] = extent(i);
      strides[j] = strides_[i];
      ++j;
    }
    return {data_ + index * strides_[dim], dextents<E::rank - 1>(sizes), strides};
  }

  // Swaps two dimensions (no data moves; strides swap).
  TensorView<T, dextents<E::rank>, Space> transpose(int a, int b) const {
    TRELLIS_CHECK(a >= 0 && a < rank && b >= 0 && b < rank, "transpose: dimensions ", a, ", ", b,
                  " of a rank-", rank, " tensor");
    auto sizes = extents_.array();
    auto strides = strides_;
    std::swap(sizes[a], sizes[b]);
    std::swap(strides[a], strides[b]);
    return {data_, dextents<E::rank>(sizes), strides};
  }

  // Same elements with dynamic extents (for passing to code written for dextents).
  TensorView<T, dextents<E::rank>, Space> dynamic_view() const {
    return {data_, dextents<E::rank>(extents_.array()), strides_};
  }

 private:
  T* data_ = nullptr;
  E extents_{};
  strides_type strides_{};
};

// Convenience aliases: rank-R views with dynamic extents.
template <class T, int R, class Space = Host>
using View = TensorView<T, dextents<R>, Space>;

// An owning, contiguous, row-major tensor. Host tensors are zero-initialised.
template <class T, int R, class Space = Host>
class Tensor {
 public:
  using element_type = T;
  using extents_type = dextents<R>;
  static constexpr int rank = R;

  Tensor() = default;
  explicit Tensor(const std::array<index_t, R>& shape)
      : extents_(extents_type::checked(shape)), buffer_(static_cast<std::size_t>(extents_.size())) {}
  Tensor(std::initializer_list<index_t> shape) : Tensor(to_array(shape)) {}

  View<T, R, Space> view() { return {buffer_.data(), extents_}; }
  View<const T, R, Space> view() const { return {buffer_.data(), extents_}; }
  T* data() { return buffer_.data(); }
  const T* data() const { return buffer_.data(); }
  index_t size() const { return extents_.size(); }
  index_t extent(int i) const { return extents_.extent(i); }
  std::array<index_t, R> shape() const { return extents_.array(); }
  Buffer<T, Space>& buffer() { return buffer_; }

  template <class... I>
    requires(sizeof...(I) == R)
  T& operator()(I... idx) { return view()(idx...); }
  template <class... I>
    requires(sizeof...(I) == R)
  const T& operator()(I... idx) const { return view()(idx...); }

 private:
  static std::array<index_t, R> to_array(std::initializer_list<index_t> shape) {
    TRELLIS_CHECK_EQ(static_cast<int>(shape.size()), R, "Tensor shape has the wrong rank");
    std::array<index_t, R> out{};
    int i = 0;
    for (index_t s : shape) out[i++] = s;
    return out;
  }

  extents_type extents_{};
  Buffer<T, Space> buffer_;
};

template <class E>
std::ostream& print_extents(std::ostream& out, const E& e) {
  out << "(";
  for (int i = 0; i < E::rank; ++i) out << (i ? ", " : "") << e.extent(i);
  return out << ")";
}

}  // namespace trellis
