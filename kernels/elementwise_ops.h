// Element-wise math, written once: MB_HOST_DEVICE functors on the compute type (f32 for 16-bit
// storage), used by the CPU loops in kernels/cpu/elementwise.cpp and the generic CUDA kernel.
#pragma once

#include <cmath>
#include <type_traits>

#include "core/half.h"

namespace microbatch::kernels::ops {

inline constexpr double kSqrt2OverPi = 0.7978845608028654;   // sqrt(2 / pi)
inline constexpr double kInvSqrt2 = 0.7071067811865476;      // 1 / sqrt(2)
inline constexpr double kInvSqrt2Pi = 0.3989422804014327;    // 1 / sqrt(2 pi)
inline constexpr double kGeluCoeff = 0.044715;

struct Neg { template <class T> MB_HOST_DEVICE T operator()(T x) const { return -x; } };
struct Exp { template <class T> MB_HOST_DEVICE T operator()(T x) const { return std::exp(x); } };
struct Log { template <class T> MB_HOST_DEVICE T operator()(T x) const { return std::log(x); } };
struct Sqrt { template <class T> MB_HOST_DEVICE T operator()(T x) const { return std::sqrt(x); } };
struct Rsqrt {
  template <class T> MB_HOST_DEVICE T operator()(T x) const { return T(1) / std::sqrt(x); }
};
struct Abs {  // -0 gives +0, as torch.abs (the sign bit is cleared, not tested)
  template <class T> MB_HOST_DEVICE T operator()(T x) const {
    if constexpr (std::is_floating_point_v<T>) {
      return std::fabs(x);
    } else {
      return x < T(0) ? -x : x;
    }
  }
};
struct Tanh { template <class T> MB_HOST_DEVICE T operator()(T x) const { return std::tanh(x); } };
struct Sigmoid {
  // Stable on both sides: never exponentiates a large positive number.
  template <class T> MB_HOST_DEVICE T operator()(T x) const {
    if (x >= T(0)) return T(1) / (T(1) + std::exp(-x));
    T e = std::exp(x);
    return e / (T(1) + e);
  }
};
struct Relu {  // NaN propagates, as torch.relu: NaN < 0 is false
  template <class T> MB_HOST_DEVICE T operator()(T x) const {
    if constexpr (std::is_unsigned_v<T>) return x;  // u8 and bool are never below 0
    else return x < T(0) ? T(0) : x;
  }
};
struct GeluErf {
  template <class T> MB_HOST_DEVICE T operator()(T x) const {
    return T(0.5) * x * (T(1) + std::erf(x * T(kInvSqrt2)));
  }
};
// 0.5 x (1 + tanh(u)) = x * sigmoid(2u): one exp instead of a tanh (several times cheaper on a
// CPU), and no cancellation in 1 + tanh(u) for large negative u.
struct GeluTanh {
  template <class T> MB_HOST_DEVICE T operator()(T x) const {
    T u = T(kSqrt2OverPi) * (x + T(kGeluCoeff) * x * x * x);
    return x * Sigmoid{}(T(2) * u);
  }
};
struct Silu {
  template <class T> MB_HOST_DEVICE T operator()(T x) const { return x * Sigmoid{}(x); }
};

struct Add { template <class T> MB_HOST_DEVICE T operator()(T a, T b) const { return a + b; } };
struct Sub { template <class T> MB_HOST_DEVICE T operator()(T a, T b) const { return a - b; } };
struct Mul {
  template <class T> MB_HOST_DEVICE T operator()(T a, T b) const {
    if constexpr (std::is_same_v<T, bool>) return a && b;  // as torch.mul on bool
    else return a * b;
  }
};
// True division on floating types only: the op casts integer and bool operands to f32 first, as
// torch.div (integer division would truncate, and traps on the CPU when dividing by zero).
struct Div { template <class T> MB_HOST_DEVICE T operator()(T a, T b) const { return a / b; } };
struct Pow {
  template <class T> MB_HOST_DEVICE T operator()(T a, T b) const { return static_cast<T>(std::pow(a, b)); }
};
struct Maximum {
  // NaN propagates, as torch.maximum.
  template <class T> MB_HOST_DEVICE T operator()(T a, T b) const { return (a != a || a > b) ? a : b; }
};
struct Minimum {
  template <class T> MB_HOST_DEVICE T operator()(T a, T b) const { return (a != a || a < b) ? a : b; }
};
struct Eq { template <class T> MB_HOST_DEVICE bool operator()(T a, T b) const { return a == b; } };
struct Ne { template <class T> MB_HOST_DEVICE bool operator()(T a, T b) const { return a != b; } };
struct Lt { template <class T> MB_HOST_DEVICE bool operator()(T a, T b) const { return a < b; } };
struct Le { template <class T> MB_HOST_DEVICE bool operator()(T a, T b) const { return a <= b; } };
struct Gt { template <class T> MB_HOST_DEVICE bool operator()(T a, T b) const { return a > b; } };
struct Ge { template <class T> MB_HOST_DEVICE bool operator()(T a, T b) const { return a >= b; } };

// Backward helpers: (x or y, dy) -> dx. They overwrite (activation gradients).
// (y, dy): 0 where y <= 0, else dy; as torch's threshold_backward, dy passes where y is NaN.
struct ReluBackward {
  template <class T> MB_HOST_DEVICE T operator()(T y, T dy) const { return y <= T(0) ? T(0) : dy; }
};
struct GeluErfBackward {  // (x, dy)
  template <class T> MB_HOST_DEVICE T operator()(T x, T dy) const {
    T cdf = T(0.5) * (T(1) + std::erf(x * T(kInvSqrt2)));
    T pdf = T(kInvSqrt2Pi) * std::exp(T(-0.5) * x * x);
    return dy * (cdf + x * pdf);
  }
};
struct GeluTanhBackward {  // (x, dy); with s = sigmoid(2u): 0.5 (1 + tanh u) = s, 1 - tanh^2 u = 4 s (1 - s)
  template <class T> MB_HOST_DEVICE T operator()(T x, T dy) const {
    T x2 = x * x;
    T u = T(kSqrt2OverPi) * (x + T(kGeluCoeff) * x2 * x);
    T s = Sigmoid{}(T(2) * u);
    T du = T(kSqrt2OverPi) * (T(1) + T(3.0 * kGeluCoeff) * x2);
    return dy * (s + T(2) * x * s * (T(1) - s) * du);
  }
};
struct SiluBackward {  // (x, dy)
  template <class T> MB_HOST_DEVICE T operator()(T x, T dy) const {
    T s = Sigmoid{}(x);
    return dy * s * (T(1) + x * (T(1) - s));
  }
};
struct SigmoidBackward {  // (y, dy)
  template <class T> MB_HOST_DEVICE T operator()(T y, T dy) const { return dy * y * (T(1) - y); }
};
struct TanhBackward {  // (y, dy)
  template <class T> MB_HOST_DEVICE T operator()(T y, T dy) const { return dy * (T(1) - y * y); }
};

}  // namespace microbatch::kernels::ops
