#include "core/device.h"

#include <charconv>
#include <cmath>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/device.h"

namespace microbatch {

std::string Device::str() const {
  switch (type) {
    case DeviceType::cpu: return "cpu";
    case DeviceType::meta: return "meta";
    case DeviceType::cuda: return fmt::format("cuda:{}", index);
  }
  return "?";
}

Device parse_device(const std::string& s) {
  if (s == "cpu") return kCPU;
  if (s == "meta") return kMeta;
  if (s == "cuda") return cuda_device(0);
  if (s.rfind("cuda:", 0) == 0) {
    int index = -1;
    const char* first = s.data() + 5;
    const char* last = s.data() + s.size();
    auto [ptr, ec] = std::from_chars(first, last, index);
    MB_CHECK(ec == std::errc() && ptr == last && index >= 0, "[device] bad CUDA device '{}'", s);
    return cuda_device(index);
  }
  MB_CHECK(false, "[device] unknown device '{}': expected cpu, meta, cuda or cuda:N", s);
  return kCPU;
}

int cuda_device_count() { return kernels::cuda::device_count(); }

std::size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::f32: case DType::i32: return 4;
    case DType::f64: case DType::i64: return 8;
    case DType::f16: case DType::bf16: return 2;
    case DType::u8: case DType::boolean: return 1;
  }
  return 0;
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::boolean: return "bool";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  if (name == "f32" || name == "float32" || name == "float") return DType::f32;
  if (name == "f64" || name == "float64" || name == "double") return DType::f64;
  if (name == "f16" || name == "float16" || name == "half" || name == "fp16") return DType::f16;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  if (name == "i32" || name == "int32") return DType::i32;
  if (name == "i64" || name == "int64") return DType::i64;
  if (name == "u8" || name == "uint8") return DType::u8;
  if (name == "bool") return DType::boolean;
  MB_CHECK(false, "[dtype] unknown dtype '{}'", name);
  return DType::f32;
}

bool is_floating(DType dt) {
  return dt == DType::f32 || dt == DType::f64 || dt == DType::f16 || dt == DType::bf16;
}

bool is_integer(DType dt) { return !is_floating(dt) && dt != DType::boolean; }

bool holds_value(DType dt, double v) {
  switch (dt) {
    case DType::boolean:
      return v == 0.0 || v == 1.0;
    case DType::u8:
      return v == std::floor(v) && v >= 0.0 && v <= 255.0;
    case DType::i32:
      return v == std::floor(v) && v >= -2147483648.0 && v <= 2147483647.0;
    case DType::i64:
      return v == std::floor(v) && v >= -9223372036854775808.0 && v < 9223372036854775808.0;
    default:
      return true;  // floating
  }
}

bool is_16bit_float(DType dt) { return dt == DType::f16 || dt == DType::bf16; }

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  auto rank = [](DType d) {
    switch (d) {
      case DType::boolean: return 0;
      case DType::u8: return 1;
      case DType::i32: return 2;
      case DType::i64: return 3;
      case DType::f16: return 4;
      case DType::bf16: return 4;
      case DType::f32: return 5;
      case DType::f64: return 6;
    }
    return 0;
  };
  // f16 with bf16 promotes to f32, as in PyTorch.
  if (is_16bit_float(a) && is_16bit_float(b)) return DType::f32;
  return rank(a) >= rank(b) ? a : b;
}

}  // namespace microbatch
