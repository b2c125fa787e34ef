// What the benchmarks share: timing on a device (cudaEvents on the current stream for CUDA, the
// steady clock for the CPU), medians, comparison against a reference, and a small argument reader.
// The CPU path exists so that a machine without a GPU can run a benchmark's logic end to end
// (with small sizes); its figures say nothing about the GPU targets.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/allocator.h"  // format_bytes
#include "core/tensor.h"
#include "kernels/cuda/runtime.h"  // current_stream(); host declarations only
#include "kernels/device.h"

#if defined(__GLIBC__)
#include <malloc.h>  // malloc_trim
#endif

namespace microbatch::bench {

struct Timing {
  double median_ms = 0.0;
  double min_ms = 0.0;
  double max_ms = 0.0;
  int reps = 0;
};

inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline Timing summarize(const std::vector<double>& ms) {
  Timing t;
  t.reps = static_cast<int>(ms.size());
  if (ms.empty()) return t;
  t.median_ms = median(ms);
  t.min_ms = *std::min_element(ms.begin(), ms.end());
  t.max_ms = *std::max_element(ms.begin(), ms.end());
  return t;
}

/// Waits for all work queued on the device (nothing to wait for on the CPU).
inline void device_sync(Device device) {
  if (device.is_cuda()) kernels::cuda::synchronize(device.index);
}

/// Per-repetition times of `f` on `device`. On CUDA, an event is recorded on the current stream
/// before and after each repetition, so a repetition's time is what the stream spent on it,
/// launch gaps included (a host synchronisation inside `f` shows up as such a gap).
class RepTimer {
 public:
  explicit RepTimer(Device device) : device_(device) {}
  RepTimer(const RepTimer&) = delete;
  RepTimer& operator=(const RepTimer&) = delete;
  ~RepTimer() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }

  /// Marks a point in the stream (or in host time on the CPU); marks are numbered from 0.
  int mark() {
    if (device_.is_cuda()) {
      cudaEvent_t e = nullptr;
      MB_CUDA_CHECK(cudaEventCreate(&e));
      MB_CUDA_CHECK(cudaEventRecord(e, kernels::cuda::current_stream()));
      events_.push_back(e);
      return static_cast<int>(events_.size()) - 1;
    }
    host_.push_back(std::chrono::steady_clock::now());
    return static_cast<int>(host_.size()) - 1;
  }
  /// Milliseconds between two marks; waits for the later one.
  double ms(int from, int to) {
    if (device_.is_cuda()) {
      MB_CUDA_CHECK(cudaEventSynchronize(events_[to]));
      float out = 0.0f;
      MB_CUDA_CHECK(cudaEventElapsedTime(&out, events_[from], events_[to]));
      return out;
    }
    return std::chrono::duration<double, std::milli>(host_[to] - host_[from]).count();
  }

 private:
  Device device_;
  std::vector<cudaEvent_t> events_;
  std::vector<std::chrono::steady_clock::time_point> host_;
};

/// Runs f `warmup` times, then `reps` times, each repetition timed alone.
template <class F>
Timing time_reps(Device device, int warmup, int reps, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  device_sync(device);
  RepTimer timer(device);
  std::vector<std::pair<int, int>> marks;
  for (int i = 0; i < reps; ++i) {
    const int a = timer.mark();
    f();
    marks.emplace_back(a, timer.mark());
  }
  std::vector<double> ms;
  for (auto [a, b] : marks) ms.push_back(timer.ms(a, b));
  return summarize(ms);
}

/// GB/s (10^9 bytes per second) for `bytes` moved in `ms` milliseconds.
inline double gb_per_s(double bytes, double ms) { return ms > 0 ? bytes / (ms * 1e-3) / 1e9 : 0.0; }

/// |got - want| <= atol + rtol * |want| for every element (NaN only matches NaN); prints the first
/// few failures under `what` and returns whether all passed.
inline bool check_close(const std::string& what, const std::vector<double>& got,
                        const std::vector<double>& want, double rtol, double atol) {
  if (got.size() != want.size()) {
    std::printf("  CHECK FAILED %s: %zu values, expected %zu\n", what.c_str(), got.size(), want.size());
    return false;
  }
  std::size_t bad = 0;
  double worst = 0.0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    const bool ok = (std::isnan(g) && std::isnan(w)) || (g == w) || std::abs(g - w) <= atol + rtol * std::abs(w);
    if (!ok) {
      if (bad < 5) std::printf("  CHECK FAILED %s[%zu]: got %.9g, expected %.9g\n", what.c_str(), i, g, w);
      ++bad;
    }
    if (std::isfinite(g) && std::isfinite(w)) worst = std::max(worst, std::abs(g - w));
  }
  if (bad > 0) {
    std::printf("  CHECK FAILED %s: %zu of %zu values outside rtol %.1e, atol %.1e\n", what.c_str(), bad,
                got.size(), rtol, atol);
    return false;
  }
  std::printf("  check %-40s ok (%zu values, max |diff| %.2e)\n", what.c_str(), got.size(), worst);
  return true;
}

/// The largest |value| of a vector (an absolute tolerance is often a fraction of it).
inline double max_abs(const std::vector<double>& v) {
  double m = 0.0;
  for (double x : v)
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  return m;
}

/// Reads "--name value" and "--flag" arguments; anything else is an error.
class Args {
 public:
  Args(int argc, char** argv) : args_(argv + 1, argv + argc) {}
  std::string get(const std::string& name, const std::string& fallback) {
    for (std::size_t i = 0; i + 1 < args_.size(); ++i) {
      if (args_[i] == name) {
        used_.push_back(i);
        used_.push_back(i + 1);
        return args_[i + 1];
      }
    }
    return fallback;
  }
  long long get_int(const std::string& name, long long fallback) {
    const std::string s = get(name, "");
    return s.empty() ? fallback : std::stoll(s);
  }
  bool flag(const std::string& name) {
    for (std::size_t i = 0; i < args_.size(); ++i) {
      if (args_[i] == name) {
        used_.push_back(i);
        return true;
      }
    }
    return false;
  }
  /// The first argument not read so far, or empty.
  std::string unknown() const {
    for (std::size_t i = 0; i < args_.size(); ++i)
      if (std::find(used_.begin(), used_.end(), i) == used_.end()) return args_[i];
    return {};
  }

 private:
  std::vector<std::string> args_;
  std::vector<std::size_t> used_;
};

/// The sizes of a "--batch 8,16" list; throws naming `program` unless each is a whole number >= 1
/// (std::stoll's std::logic_error for text that is no number).
inline std::vector<std::int64_t> parse_sizes(const std::string& text, const char* program) {
  std::vector<std::int64_t> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    out.push_back(std::stoll(text.substr(start, comma - start)));
    start = comma + 1;
  }
  for (std::int64_t b : out) MB_CHECK(b >= 1, "[{}] --batch {}: sizes are >= 1", program, b);
  return out;
}

/// The device's name ("NVIDIA H200", or "cpu").
inline std::string device_name(Device device) {
  if (!device.is_cuda()) return "cpu";
  cudaDeviceProp prop{};
  MB_CUDA_CHECK(cudaGetDeviceProperties(&prop, device.index));
  return prop.name;
}

/// The process's resident memory in bytes, as Linux's /proc/self/status gives it: VmRSS now and its
/// high-water mark VmHWM; -1 each where that file or the line is missing. The CPU runs' memory
/// figure, which benchmarks/torch_gpt2.py takes the same way for PyTorch (whose CPU allocator keeps
/// no statistics): resident bytes, so a caching allocator's cache and malloc's kept pages count.
struct ResidentMemory {
  std::int64_t current = -1;
  std::int64_t peak = -1;
};

inline ResidentMemory resident_memory() {
  ResidentMemory m;
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    for (auto [key, field] : {std::pair{"VmRSS:", &m.current}, std::pair{"VmHWM:", &m.peak}}) {
      if (line.rfind(key, 0) != 0) continue;
      long long kib = 0;
      if (std::sscanf(line.c_str() + std::strlen(key), "%lld", &kib) == 1) *field = kib * 1024;
    }
  }
  return m;
}

/// A CPU run's memory figure: the resident size before its model was built and the peak since the
/// peak was reset (reset_resident_peak); -1 each where it was not measured (on a GPU, or where
/// Linux gives no such figures).
struct ResidentGrowth {
  std::int64_t before = -1;
  std::int64_t peak = -1;
  bool measured() const { return peak >= 0; }
  /// The growth as text for a table, "-" where not measured.
  std::string text() const { return measured() ? format_bytes(peak - before) : "-"; }
  /// Adds host_rss_before_bytes, host_peak_rss_bytes and host_rss_growth_bytes where measured.
  void add_to(nlohmann::json& j) const {
    if (!measured()) return;
    j["host_rss_before_bytes"] = before;
    j["host_peak_rss_bytes"] = peak;
    j["host_rss_growth_bytes"] = peak - before;
  }
};

/// Hands the C heap's free pages back to the system (glibc's malloc_trim), so that a run's baseline
/// is not raised by what an earlier run freed and malloc kept; torch_gpt2.py does the same.
inline void release_free_heap() {
#if defined(__GLIBC__)
  malloc_trim(0);
#endif
}

/// Sets the high-water mark to the current resident size (writing "5" to /proc/self/clear_refs,
/// Linux 4.0 and later), so that a later resident_memory().peak is the peak since now. False
/// where the kernel refuses it; the peak then counts from the process's start.
inline bool reset_resident_peak() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return out.good();
}

/// The growth since `before` up to now, where the peak was reset after it (peak_reset) and both
/// figures exist; else not measured.
inline ResidentGrowth resident_growth(const ResidentMemory& before, bool peak_reset) {
  if (!peak_reset) return {};
  const ResidentMemory after = resident_memory();
  if (before.current < 0 || after.peak < 0) return {};
  return {.before = before.current, .peak = after.peak};
}

inline void write_json(const std::string& path, const nlohmann::json& j) {
  if (path.empty()) return;
  std::ofstream out(path);
  MB_CHECK(out.good(), "[bench] cannot write {}", path);
  out << j.dump(2) << "\n";
  std::printf("wrote %s\n", path.c_str());
}

}  // namespace microbatch::bench
