// Element types. f64 exists for gradcheck; f16 and bf16 are storage types whose math runs in f32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "core/half.h"

namespace microbatch {

enum class DType : std::uint8_t { f32, f64, f16, bf16, i32, i64, u8, boolean };

/// Bytes per element.
std::size_t dtype_size(DType dt);
/// "f32", "f64", "f16", "bf16", "i32", "i64", "u8", "bool".
const char* dtype_name(DType dt);
/// Parses a dtype_name (also accepts "float32", "float16", "bfloat16", "float64").
DType parse_dtype(const std::string& name);
bool is_floating(DType dt);
/// i32, i64 and u8 (not bool).
bool is_integer(DType dt);
/// Whether v is exactly one of dt's values: any v for floating dtypes; a whole number in range for
/// integer ones (255 fits u8, -100 does not); 0 or 1 for bool.
bool holds_value(DType dt, double v);
bool is_16bit_float(DType dt);
/// The dtype two operands of one kind (both 0-d or both not) are promoted to: float beats int,
/// wider beats narrower. Binary ops add torch's rule for a 0-d operand (Note [0-d operands in
/// promotion] in core/ops/elementwise.cpp).
DType promote_types(DType a, DType b);

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<f16> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<bf16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<std::int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<std::int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<std::uint8_t> { static constexpr DType value = DType::u8; };
template <> struct dtype_of<bool> { static constexpr DType value = DType::boolean; };

/// The type math is done in for storage type T: f32 for 16-bit floats, T otherwise.
template <class T>
using compute_t = std::conditional_t<std::is_same_v<T, f16> || std::is_same_v<T, bf16>, float, T>;

/// Calls f.template operator()<T>() with T the storage type of dt (any dtype).
template <class F>
decltype(auto) dispatch_all(DType dt, F&& f) {
  switch (dt) {
    case DType::f32: return f.template operator()<float>();
    case DType::f64: return f.template operator()<double>();
    case DType::f16: return f.template operator()<f16>();
    case DType::bf16: return f.template operator()<bf16>();
    case DType::i32: return f.template operator()<std::int32_t>();
    case DType::i64: return f.template operator()<std::int64_t>();
    case DType::u8: return f.template operator()<std::uint8_t>();
    case DType::boolean: return f.template operator()<bool>();
  }
  MB_ASSERT(false, "unknown dtype {}", static_cast<int>(dt));
  return f.template operator()<float>();
}

/// Like dispatch_all but for floating dtypes only; `op` names the caller in the error.
template <class F>
decltype(auto) dispatch_float(DType dt, const char* op, F&& f) {
  switch (dt) {
    case DType::f32: return f.template operator()<float>();
    case DType::f64: return f.template operator()<double>();
    case DType::f16: return f.template operator()<f16>();
    case DType::bf16: return f.template operator()<bf16>();
    default: break;
  }
  MB_CHECK(false, "[{}] expected a floating-point tensor, got {}", op, dtype_name(dt));
  return f.template operator()<float>();
}

/// Calls f.template operator()<I>() with I the index type of dt: std::int64_t or std::int32_t;
/// `op` names the caller in the error for any other dtype.
template <class F>
decltype(auto) dispatch_index(DType dt, const char* op, F&& f) {
  if (dt == DType::i32) return f.template operator()<std::int32_t>();
  MB_CHECK(dt == DType::i64, "[{}] expected an index tensor (i64 or i32), got {}", op,
           dtype_name(dt));
  return f.template operator()<std::int64_t>();
}

}  // namespace microbatch
