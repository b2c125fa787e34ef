// Devices: cpu, cuda:N, and meta (shapes and simulated allocations, no data, no kernels).
#pragma once

#include <string>

namespace microbatch {

enum class DeviceType { cpu, cuda, meta };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;

  bool is_cpu() const { return type == DeviceType::cpu; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool is_meta() const { return type == DeviceType::meta; }
  bool operator==(const Device&) const = default;
  /// "cpu", "cuda:0", "meta".
  std::string str() const;
};

inline constexpr Device kCPU{DeviceType::cpu, 0};
inline constexpr Device kMeta{DeviceType::meta, 0};
inline Device cuda_device(int index = 0) { return Device{DeviceType::cuda, index}; }

/// Parses "cpu", "meta", "cuda" (= cuda:0) or "cuda:N".
Device parse_device(const std::string& s);

/// Number of CUDA devices usable now (0 in a build without CUDA or on a machine without a GPU).
int cuda_device_count();
inline bool cuda_available() { return cuda_device_count() > 0; }

}  // namespace microbatch
