// MPI datatypes and reduction operators for trellis' dtypes: the 2-byte user types and min/max
// user operators for half and bfloat16, the widening of their sum/avg/prod to float, avg's
// division, and the int count limit (part of comm/mpi.hpp).
// Needs MPI (under comm/mpi/: built only with trellis::mpi).
#pragma once

#include <mpi.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/check_mpi.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"

namespace trellis::comm {

namespace detail {

// ---- datatypes and reduction operators ---------------------------------------------------------

// MPI user function: inout[i] = min/max(in[i], inout[i]) for a 16-bit float type, compared in float.
template <class T, bool IsMax>
void mpi_min_max_16(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = static_cast<float>(a[i]);
    const float y = static_cast<float>(b[i]);
    if (IsMax ? (x > y) : (x < y)) b[i] = a[i];
  }
}

// The user datatypes and operators for half / bfloat16, created on first use (after MPI_Init)
// and left to MPI_Finalize.
struct MpiTypes16 {
  MPI_Datatype half = MPI_DATATYPE_NULL;
  MPI_Datatype bf16 = MPI_DATATYPE_NULL;
  MPI_Op half_min = MPI_OP_NULL, half_max = MPI_OP_NULL;
  MPI_Op bf16_min = MPI_OP_NULL, bf16_max = MPI_OP_NULL;
};

inline const MpiTypes16& mpi_types_16() {
  static const MpiTypes16 types = [] {
    MpiTypes16 t;
    TRELLIS_CHECK_MPI(MPI_Type_contiguous(2, MPI_BYTE, &t.half));
    TRELLIS_CHECK_MPI(MPI_Type_set_name(t.half, "trellis_half"));
    TRELLIS_CHECK_MPI(MPI_Type_commit(&t.half));
    TRELLIS_CHECK_MPI(MPI_Type_contiguous(2, MPI_BYTE, &t.bf16));
    TRELLIS_CHECK_MPI(MPI_Type_set_name(t.bf16, "trellis_bfloat16"));
    TRELLIS_CHECK_MPI(MPI_Type_commit(&t.bf16));
    TRELLIS_CHECK_MPI(MPI_Op_create(&mpi_min_max_16<half, false>, 1, &t.half_min));
    TRELLIS_CHECK_MPI(MPI_Op_create(&mpi_min_max_16<half, true>, 1, &t.half_max));
    TRELLIS_CHECK_MPI(MPI_Op_create(&mpi_min_max_16<bfloat16, false>, 1, &t.bf16_min));
    TRELLIS_CHECK_MPI(MPI_Op_create(&mpi_min_max_16<bfloat16, true>, 1, &t.bf16_max));
    return t;
  }();
  return types;
}

constexpr bool mpi_is_float16(DType t) { return t == DType::f16 || t == DType::bf16; }

// sum/avg/prod of 16-bit floats go through a float staging buffer (one rounding at the end).
constexpr bool mpi_widens(DType t, ReduceOp op) {
  return mpi_is_float16(t) && (op == ReduceOp::sum || op == ReduceOp::avg || op == ReduceOp::prod);
}

inline MPI_Datatype mpi_datatype(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::f16: return mpi_types_16().half;
    case DType::bf16: return mpi_types_16().bf16;
    case DType::i8: return MPI_INT8_T;
    case DType::u8: return MPI_UINT8_T;
    case DType::i32: return MPI_INT32_T;
    case DType::u32: return MPI_UINT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::u64: return MPI_UINT64_T;
  }
  TRELLIS_THROW("no MPI datatype for dtype ", static_cast<int>(t));
}

// The MPI operator for `op` on data of type `t` as it is handed to MPI (after widening).
inline MPI_Op mpi_reduce_op(ReduceOp op, DType t) {
  if (mpi_is_float16(t)) {
    const MpiTypes16& types = mpi_types_16();
    if (op == ReduceOp::min) return t == DType::f16 ? types.half_min : types.bf16_min;
    if (op == ReduceOp::max) return t == DType::f16 ? types.half_max : types.bf16_max;
    TRELLIS_THROW("internal: 16-bit ", reduce_op_name(op), " must be widened to float first");
  }
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return MPI_SUM;
    case ReduceOp::prod: return MPI_PROD;
    case ReduceOp::min: return MPI_MIN;
    case ReduceOp::max: return MPI_MAX;
  }
  TRELLIS_THROW("unknown reduce op ", static_cast<int>(op));
}

inline void mpi_widen_16(const void* src, float* dst, std::size_t n, DType t) {
  if (t == DType::f16) {
    const half* s = static_cast<const half*>(src);
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
  } else {
    const bfloat16* s = static_cast<const bfloat16*>(src);
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
  }
}

// Rounds once to the 16-bit type; divides by `divisor` first (in float) when it is not 1.
inline void mpi_narrow_16(const float* src, void* dst, std::size_t n, DType t, int divisor) {
  const float d = static_cast<float>(divisor);
  if (t == DType::f16) {
    half* o = static_cast<half*>(dst);
    for (std::size_t i = 0; i < n; ++i) o[i] = half(divisor == 1 ? src[i] : src[i] / d);
  } else {
    bfloat16* o = static_cast<bfloat16*>(dst);
    for (std::size_t i = 0; i < n; ++i) o[i] = bfloat16(divisor == 1 ? src[i] : src[i] / d);
  }
}

template <class T>
void mpi_divide_typed(void* data, std::size_t n, int divisor) {
  T* p = static_cast<T*>(data);
  const T d = static_cast<T>(divisor);
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / d);
}

// avg's second half for types MPI reduced natively: x / size (integers: truncating division).
inline void mpi_divide_in_place(void* data, std::size_t n, DType t, int divisor) {
  switch (t) {
    case DType::f32: return mpi_divide_typed<float>(data, n, divisor);
    case DType::f64: return mpi_divide_typed<double>(data, n, divisor);
    case DType::i8: return mpi_divide_typed<std::int8_t>(data, n, divisor);
    case DType::u8: return mpi_divide_typed<std::uint8_t>(data, n, divisor);
    case DType::i32: return mpi_divide_typed<std::int32_t>(data, n, divisor);
    case DType::u32: return mpi_divide_typed<std::uint32_t>(data, n, divisor);
    case DType::i64: return mpi_divide_typed<std::int64_t>(data, n, divisor);
    case DType::u64: return mpi_divide_typed<std::uint64_t>(data, n, divisor);
    case DType::f16:
    case DType::bf16: break;
  }
  TRELLIS_THROW("internal: 16-bit avg is divided while narrowing");
}

// MPI counts are int: larger operations are refused with a clear message.
inline int mpi_count(std::size_t n, const char* what) {
  if (n > static_cast<std::size_t>(INT_MAX)) [[unlikely]]
    TRELLIS_THROW(what, ": ", n, " elements exceed MPI's int count limit (", INT_MAX, ")");
  return static_cast<int>(n);
}

}  // namespace detail

}  // namespace trellis::comm
