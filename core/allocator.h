// Caching allocators, one per device, with statistics and an optional hard budget.
//
// The algorithm, the same on every device (so that the meta device's peak is the real peak):
// - A request is rounded up to a multiple of kBlockRound (512 bytes); zero-byte requests take nothing.
// - A freed block goes to the device's cache. A request takes the smallest cached block that fits
//   and wastes at most a quarter of the request (best fit, ties broken by address order of caching).
// - Otherwise a new block is taken from the system. Before that, if the budget is set and the new
//   block would take reserved bytes past it, the whole cache is released; if it still does not
//   fit, OutOfMemoryError is thrown before any system allocation, and no statistic but the
//   out-of-memory count changes.
// - In pool-bypass mode every free returns the block to the system at once (for sanitizers).
//
// Statistics (current and peak): allocated = bytes of live requests (rounded), active = bytes of
// blocks in use (a reused cached block may be larger than the request), reserved = bytes held from
// the system (in use + cached).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "core/device.h"

namespace microbatch {

inline constexpr std::size_t kBlockRound = 512;

/// A byte count with its current value and its high-water mark since the last reset_peak.
struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  void add(std::int64_t n) {
    current += n;
    if (current > peak) peak = current;
  }
  void sub(std::int64_t n) { current -= n; }
};

struct MemoryStats {
  Stat allocated;
  Stat reserved;
  Stat active;
  std::int64_t num_allocs = 0;         // requests served
  std::int64_t num_frees = 0;          // blocks released by tensors
  std::int64_t cache_hits = 0;         // requests served from the cache
  std::int64_t num_system_allocs = 0;  // blocks taken from the system
  std::int64_t num_ooms = 0;           // requests refused
};

enum class CachePolicy { Cache, Bypass };

/// Where a device's blocks come from: the system (malloc, cudaMalloc) or, for meta, nowhere.
class MemoryBackend {
 public:
  virtual ~MemoryBackend() = default;
  /// Returns nullptr when the system has no memory left.
  virtual void* system_alloc(std::size_t bytes) = 0;
  virtual void system_free(void* ptr, std::size_t bytes) noexcept = 0;
};

class Allocator {
 public:
  Allocator(Device device, std::unique_ptr<MemoryBackend> backend);
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  /// A block of at least `bytes` bytes; throws OutOfMemoryError past the budget. nullptr for 0.
  void* allocate(std::size_t bytes);
  /// Returns a block to the cache (or to the system in bypass mode).
  void free(void* ptr) noexcept;

  MemoryStats stats() const;
  /// Sets every peak to its current value.
  void reset_peak();
  /// Hard limit on reserved bytes; nullopt removes it.
  void set_budget(std::optional<std::size_t> bytes);
  std::optional<std::size_t> budget() const;
  /// Releases every cached block to the system.
  void empty_cache();
  void set_cache_policy(CachePolicy policy);
  Device device() const { return device_; }

 private:
  void release_cache_locked() noexcept;

  Device device_;
  std::unique_ptr<MemoryBackend> backend_;
  mutable std::mutex mutex_;
  MemoryStats stats_;
  std::optional<std::size_t> budget_;
  CachePolicy policy_ = CachePolicy::Cache;
  struct Block {
    std::size_t size;       // block bytes (reserved)
    std::size_t requested;  // rounded request (allocated)
  };
  std::unordered_map<void*, Block> live_;
  std::multimap<std::size_t, void*> cache_;  // block size -> block
};

/// The allocator of a device (created on first use).
Allocator& allocator(Device device);

MemoryStats memory_stats(Device device);
void reset_peak_memory_stats(Device device);
/// Hard budget on a device's reserved bytes: a request past it frees the cache, then throws.
void set_memory_budget(Device device, std::size_t bytes);
void clear_memory_budget(Device device);
void empty_cache(Device device);

/// "1.50 MiB"-style text for a byte count.
std::string format_bytes(std::int64_t bytes);

}  // namespace microbatch
