// Caching allocators, one per device, with statistics and an optional hard budget. Each follows
// one of two rule sets, a property of the allocator (AllocatorRules); the meta device keeps one
// allocator of each and uses the one of the backend it mirrors (Note [Meta mirrors a backend] in
// core/ops/dispatch.h), so that a predicted peak is the real peak.
//
// Both rule sets:
// - A request is rounded up to a multiple of kBlockRound (512 bytes); zero bytes take nothing. A
//   request above kMaxRequest (about 8 EiB) is refused with OutOfMemoryError before any rounding,
//   and only the out-of-memory count changes.
// - Before taking memory from the system, if the budget is set and the new system block would take
//   reserved bytes past it, every cached (wholly free) system block is released; if it still does
//   not fit, OutOfMemoryError is thrown before any system allocation, and no statistic but the
//   out-of-memory count changes. When the system refuses, the cache is released and the request
//   retried once, then OutOfMemoryError is thrown.
// - In pool-bypass mode every free returns its system block at once (for sanitizers).
//
// BestFit (the CPU):
// - A freed block goes to the cache whole. A request takes the smallest cached block that fits
//   and wastes at most a quarter of the request (best fit, ties broken by order of caching).
// - Otherwise a new block of exactly the rounded request is taken from the system.
//
// Segmented (CUDA devices), after PyTorch's CUDACachingAllocator:
// - Requests up to kSmallRequest (1 MiB) use the small pool, carved from kSmallSegment (2 MiB)
//   segments; larger ones use the large pool, whose new segments are the request rounded up to
//   kLargeSegmentRound (2 MiB) whatever its size (PyTorch shares 20 MiB segments among requests
//   under 10 MiB instead).
// - Free blocks sit in size-ordered bins per (pool, stream). A request takes the smallest free
//   block of its pool and stream that fits (ties: the older segment, then the lower address), else
//   a new segment. Blocks are tagged with the stream current when they were allocated
//   (MemoryBackend::stream_id) and are reused only on that stream; a block used on another
//   stream must have that work ordered before its free (there is no record_stream).
// - A block larger than the request is split when the remainder is at least kBlockRound (small
//   pool) or more than kSmallRequest (large pool); otherwise the whole block is used.
// - A freed block merges with its free neighbours in the same segment. A segment whose blocks are
//   all free is returned to the system on release (empty_cache, budget pressure, a refusal).
// - In pool-bypass mode a request takes a segment of exactly its rounded size, never split.
//
// Statistics (current and peak): allocated = bytes of live requests (rounded), active = bytes of
// blocks in use (a block may be larger than its request), reserved = bytes held from the system
// (in use + cached). num_system_allocs counts system blocks (segments); cache_hits counts requests
// served without one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>

#include "core/device.h"

namespace microbatch {

inline constexpr std::size_t kBlockRound = 512;
// Segmented rules, in bytes: the largest small-pool request, the small-pool segment, and the
// multiple large-pool segments are rounded up to.
inline constexpr std::size_t kSmallRequest = std::size_t{1} << 20;
inline constexpr std::size_t kSmallSegment = std::size_t{2} << 20;
inline constexpr std::size_t kLargeSegmentRound = std::size_t{2} << 20;
/// The largest request served: the largest multiple of kLargeSegmentRound (so of kBlockRound) that
/// the byte statistics (int64) hold, so that rounding a request up never wraps around to 0.
inline constexpr std::size_t kMaxRequest =
    static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()) / kLargeSegmentRound *
    kLargeSegmentRound;
static_assert(kLargeSegmentRound % kBlockRound == 0);

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
  std::int64_t num_system_allocs = 0;  // blocks (segments) taken from the system
  std::int64_t num_ooms = 0;           // requests refused
};

enum class CachePolicy { Cache, Bypass };

/// How an allocator carves and reuses blocks (the top of this file states both).
enum class AllocatorRules { BestFit, Segmented };

/// Where a device's blocks come from: the system (malloc, cudaMalloc) or, for meta, nowhere.
class MemoryBackend {
 public:
  virtual ~MemoryBackend() = default;
  /// Returns nullptr when the system has no memory left.
  virtual void* system_alloc(std::size_t bytes) = 0;
  virtual void system_free(void* ptr, std::size_t bytes) noexcept = 0;
  /// The stream new work is ordered on (0: the default stream, and every device without streams).
  virtual std::uintptr_t stream_id() { return 0; }
};

class Allocator {
 public:
  Allocator(Device device, std::unique_ptr<MemoryBackend> backend,
            AllocatorRules rules = AllocatorRules::BestFit);
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
  /// Releases every cached block (Segmented: every wholly free segment) to the system.
  void empty_cache();
  void set_cache_policy(CachePolicy policy);
  Device device() const { return device_; }
  AllocatorRules rules() const { return rules_; }

 private:
  enum class Pool { Small, Large };
  // A block of a segment (Segmented rules); a segment is the block range of one system allocation.
  struct Span {
    std::size_t size;
    std::size_t requested;  // rounded request while in use; 0 while free
    std::uintptr_t stream;
    Pool pool;
    char* segment;                // the system allocation it lies in
    std::uint64_t segment_order;  // creation order of the segment: bin ties go to the oldest
  };
  // Free-bin key: (stream, size, segment order, address).
  using BinKey = std::tuple<std::uintptr_t, std::size_t, std::uint64_t, char*>;

  /// A system block of `bytes` for a request of `need`, under the budget; throws when refused.
  void* system_alloc_locked(std::size_t need, std::size_t bytes);
  void release_cache_locked() noexcept;
  void* allocate_best_fit_locked(std::size_t need);
  void free_best_fit_locked(void* ptr) noexcept;
  void* allocate_segmented_locked(std::size_t need);
  void free_segmented_locked(void* ptr) noexcept;
  void release_free_segments_locked() noexcept;
  std::set<BinKey>& bin(Pool pool) { return pool == Pool::Small ? small_bin_ : large_bin_; }
  static BinKey bin_key(char* ptr, const Span& span) {
    return {span.stream, span.size, span.segment_order, ptr};
  }

  Device device_;
  std::unique_ptr<MemoryBackend> backend_;
  AllocatorRules rules_;
  mutable std::mutex mutex_;
  MemoryStats stats_;
  std::optional<std::size_t> budget_;
  CachePolicy policy_ = CachePolicy::Cache;

  // BestFit
  struct Block {
    std::size_t size;       // block bytes (reserved)
    std::size_t requested;  // rounded request (allocated)
  };
  std::unordered_map<void*, Block> live_;
  std::multimap<std::size_t, void*> cache_;  // block size -> block

  // Segmented
  std::map<char*, Span> spans_;                      // every block of every segment, by address
  std::unordered_map<char*, std::size_t> segments_;  // segment start -> bytes
  std::set<BinKey> small_bin_, large_bin_;           // free blocks
  std::uint64_t next_segment_order_ = 0;
};

/// The allocator of a device (created on first use): BestFit rules for the CPU, Segmented for CUDA
/// devices; for meta, the allocator with the rules of meta_backend() (core/ops/dispatch.h).
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
