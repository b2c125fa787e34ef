#include "core/allocator.h"

#include <cstdlib>
#include <iterator>
#include <vector>

#include "core/error.h"
#include "core/ops/dispatch.h"
#include "kernels/device.h"

namespace microbatch {

namespace {

std::size_t round_up(std::size_t n, std::size_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

class HostBackend final : public MemoryBackend {
 public:
  void* system_alloc(std::size_t bytes) override { return std::aligned_alloc(64, bytes); }
  void system_free(void* ptr, std::size_t) noexcept override { std::free(ptr); }
};

// Meta blocks are addresses that are never dereferenced: distinct, ever increasing from `base`.
class MetaBackend final : public MemoryBackend {
 public:
  explicit MetaBackend(std::uintptr_t base) : next_(base) {}
  void* system_alloc(std::size_t bytes) override {
    next_ += bytes;
    return reinterpret_cast<void*>(next_ - bytes);
  }
  void system_free(void*, std::size_t) noexcept override {}

 private:
  std::uintptr_t next_;
};

class CudaBackend final : public MemoryBackend {
 public:
  explicit CudaBackend(int index) : index_(index) {}
  void* system_alloc(std::size_t bytes) override { return kernels::cuda::malloc(bytes, index_); }
  void system_free(void* ptr, std::size_t) noexcept override { kernels::cuda::free(ptr, index_); }
  std::uintptr_t stream_id() override { return kernels::cuda::current_stream_id(index_); }

 private:
  int index_;
};

}  // namespace

Allocator::Allocator(Device device, std::unique_ptr<MemoryBackend> backend, AllocatorRules rules)
    : device_(device), backend_(std::move(backend)), rules_(rules) {}

Allocator::~Allocator() {
  std::lock_guard lock(mutex_);
  release_cache_locked();
  // Live blocks belong to tensors that outlive the allocator (static destruction order); leave them.
}

void* Allocator::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  std::lock_guard lock(mutex_);
  if (bytes > kMaxRequest) {  // rounded up, it would wrap around (to 0 for SIZE_MAX)
    ++stats_.num_ooms;
    throw OutOfMemoryError(
        fmt::format("[allocator] {}: cannot allocate {} bytes: a request is at most {} bytes, "
                    "the largest block the byte statistics can count",
                    device_.str(), bytes, kMaxRequest),
        bytes);
  }
  const std::size_t need = round_up(bytes, kBlockRound);
  return rules_ == AllocatorRules::BestFit ? allocate_best_fit_locked(need)
                                           : allocate_segmented_locked(need);
}

void Allocator::free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  std::lock_guard lock(mutex_);
  if (rules_ == AllocatorRules::BestFit) {
    free_best_fit_locked(ptr);
  } else {
    free_segmented_locked(ptr);
  }
}

void* Allocator::system_alloc_locked(std::size_t need, std::size_t bytes) {
  // A Segmented request may need a segment larger than itself: the message says so.
  const std::string segment =
      bytes == need
          ? std::string()
          : fmt::format(" (a new {} segment)", format_bytes(static_cast<std::int64_t>(bytes)));
  auto over_budget = [&] {
    return budget_ && static_cast<std::size_t>(stats_.reserved.current) + bytes > *budget_;
  };
  if (over_budget()) release_cache_locked();
  if (over_budget()) {
    ++stats_.num_ooms;
    throw OutOfMemoryError(
        fmt::format("[allocator] {}: out of memory under the budget: tried to allocate {}{}; "
                    "allocated {}, reserved {}, budget {}. Lower the micro-batch size, turn on "
                    "activation checkpointing, or raise the budget.",
                    device_.str(), format_bytes(static_cast<std::int64_t>(need)), segment,
                    format_bytes(stats_.allocated.current), format_bytes(stats_.reserved.current),
                    format_bytes(static_cast<std::int64_t>(*budget_))),
        need);
  }
  void* ptr = backend_->system_alloc(bytes);
  if (ptr == nullptr) {
    release_cache_locked();
    ptr = backend_->system_alloc(bytes);
  }
  if (ptr == nullptr) {
    ++stats_.num_ooms;
    throw OutOfMemoryError(
        fmt::format("[allocator] {}: the system refused {}{}; allocated {}, reserved {}. Lower the "
                    "micro-batch size or set a memory budget so the planner can fit the step.",
                    device_.str(), format_bytes(static_cast<std::int64_t>(need)), segment,
                    format_bytes(stats_.allocated.current), format_bytes(stats_.reserved.current)),
        need);
  }
  stats_.reserved.add(static_cast<std::int64_t>(bytes));
  ++stats_.num_system_allocs;
  return ptr;
}

void Allocator::release_cache_locked() noexcept {
  if (rules_ == AllocatorRules::Segmented) {
    release_free_segments_locked();
    return;
  }
  for (auto& [size, ptr] : cache_) {
    backend_->system_free(ptr, size);
    stats_.reserved.sub(static_cast<std::int64_t>(size));
  }
  cache_.clear();
}

// ---- BestFit -----------------------------------------------------------------------------------

void* Allocator::allocate_best_fit_locked(std::size_t need) {
  void* ptr = nullptr;
  std::size_t size = need;
  if (policy_ == CachePolicy::Cache) {
    auto it = cache_.lower_bound(need);
    if (it != cache_.end() && it->first <= need + need / 4) {
      ptr = it->second;
      size = it->first;
      cache_.erase(it);
      ++stats_.cache_hits;
    }
  }
  if (ptr == nullptr) ptr = system_alloc_locked(need, need);
  live_.emplace(ptr, Block{size, need});
  stats_.allocated.add(static_cast<std::int64_t>(need));
  stats_.active.add(static_cast<std::int64_t>(size));
  ++stats_.num_allocs;
  return ptr;
}

void Allocator::free_best_fit_locked(void* ptr) noexcept {
  auto it = live_.find(ptr);
  if (it == live_.end()) return;  // not ours: nothing sane to do in a noexcept path
  Block block = it->second;
  live_.erase(it);
  stats_.allocated.sub(static_cast<std::int64_t>(block.requested));
  stats_.active.sub(static_cast<std::int64_t>(block.size));
  ++stats_.num_frees;
  if (policy_ == CachePolicy::Bypass) {
    backend_->system_free(ptr, block.size);
    stats_.reserved.sub(static_cast<std::int64_t>(block.size));
  } else {
    cache_.emplace(block.size, ptr);
  }
}

// ---- Segmented ---------------------------------------------------------------------------------

void* Allocator::allocate_segmented_locked(std::size_t need) {
  const Pool pool = need <= kSmallRequest ? Pool::Small : Pool::Large;
  const std::uintptr_t stream = backend_->stream_id();
  char* ptr = nullptr;
  if (policy_ == CachePolicy::Cache) {
    std::set<BinKey>& free_blocks = bin(pool);
    auto it = free_blocks.lower_bound(BinKey{stream, need, 0, nullptr});
    if (it != free_blocks.end() && std::get<0>(*it) == stream) {
      ptr = std::get<3>(*it);
      free_blocks.erase(it);
      ++stats_.cache_hits;
    }
  }
  if (ptr == nullptr) {
    const std::size_t bytes = policy_ == CachePolicy::Bypass ? need
                              : pool == Pool::Small          ? kSmallSegment
                                                             : round_up(need, kLargeSegmentRound);
    ptr = static_cast<char*>(system_alloc_locked(need, bytes));
    segments_.emplace(ptr, bytes);
    spans_.emplace(ptr, Span{.size = bytes,
                             .requested = 0,
                             .stream = stream,
                             .pool = pool,
                             .segment = ptr,
                             .segment_order = next_segment_order_++});
  }
  Span& span = spans_.find(ptr)->second;
  const std::size_t rest = span.size - need;
  if (pool == Pool::Small ? rest >= kBlockRound : rest > kSmallRequest) {
    Span tail = span;
    tail.size = rest;
    span.size = need;
    spans_.emplace(ptr + need, tail);
    bin(pool).insert(bin_key(ptr + need, tail));
  }
  span.requested = need;
  stats_.allocated.add(static_cast<std::int64_t>(need));
  stats_.active.add(static_cast<std::int64_t>(span.size));
  ++stats_.num_allocs;
  return ptr;
}

void Allocator::free_segmented_locked(void* p) noexcept {
  auto it = spans_.find(static_cast<char*>(p));
  if (it == spans_.end() || it->second.requested == 0) return;  // not ours, or already free
  Span& span = it->second;
  stats_.allocated.sub(static_cast<std::int64_t>(span.requested));
  stats_.active.sub(static_cast<std::int64_t>(span.size));
  ++stats_.num_frees;
  span.requested = 0;
  // Merge with the free neighbours in the same segment (spans of a segment are contiguous).
  auto free_neighbour = [&](auto n) {
    return n != spans_.end() && n->second.segment == span.segment && n->second.requested == 0;
  };
  if (auto next = std::next(it); free_neighbour(next)) {
    bin(span.pool).erase(bin_key(next->first, next->second));
    span.size += next->second.size;
    spans_.erase(next);
  }
  if (it != spans_.begin()) {
    if (auto prev = std::prev(it); free_neighbour(prev)) {
      bin(span.pool).erase(bin_key(prev->first, prev->second));
      prev->second.size += span.size;
      spans_.erase(it);
      it = prev;
    }
  }
  const Span& merged = it->second;
  const auto segment = segments_.find(merged.segment);
  if (policy_ == CachePolicy::Bypass && it->first == merged.segment &&
      merged.size == segment->second) {
    backend_->system_free(segment->first, segment->second);
    stats_.reserved.sub(static_cast<std::int64_t>(segment->second));
    segments_.erase(segment);
    spans_.erase(it);
    return;
  }
  bin(merged.pool).insert(bin_key(it->first, merged));
}

void Allocator::release_free_segments_locked() noexcept {
  for (std::set<BinKey>* free_blocks : {&small_bin_, &large_bin_}) {
    for (auto it = free_blocks->begin(); it != free_blocks->end();) {
      char* ptr = std::get<3>(*it);
      const auto span = spans_.find(ptr);
      const auto segment = segments_.find(span->second.segment);
      if (ptr != segment->first || span->second.size != segment->second) {
        ++it;  // part of a segment with blocks in use
        continue;
      }
      backend_->system_free(ptr, segment->second);
      stats_.reserved.sub(static_cast<std::int64_t>(segment->second));
      segments_.erase(segment);
      spans_.erase(span);
      it = free_blocks->erase(it);
    }
  }
}

// ---- statistics and settings -------------------------------------------------------------------

MemoryStats Allocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void Allocator::reset_peak() {
  std::lock_guard lock(mutex_);
  stats_.allocated.peak = stats_.allocated.current;
  stats_.reserved.peak = stats_.reserved.current;
  stats_.active.peak = stats_.active.current;
}

void Allocator::set_budget(std::optional<std::size_t> bytes) {
  std::lock_guard lock(mutex_);
  budget_ = bytes;
}

std::optional<std::size_t> Allocator::budget() const {
  std::lock_guard lock(mutex_);
  return budget_;
}

void Allocator::empty_cache() {
  std::lock_guard lock(mutex_);
  release_cache_locked();
}

void Allocator::set_cache_policy(CachePolicy policy) {
  std::lock_guard lock(mutex_);
  policy_ = policy;
  if (policy == CachePolicy::Bypass) release_cache_locked();
}

Allocator& allocator(Device device) {
  // Allocators live for the whole process: tensors in static storage may be freed very late.
  // Meta keeps one allocator per backend it can mirror, in disjoint address ranges.
  static Allocator* cpu = new Allocator(kCPU, std::make_unique<HostBackend>());
  static Allocator* meta_cpu = new Allocator(kMeta, std::make_unique<MetaBackend>(0x10000));
  static Allocator* meta_cuda = new Allocator(
      kMeta, std::make_unique<MetaBackend>(std::uintptr_t{1} << 62), AllocatorRules::Segmented);
  static std::mutex cuda_mutex;
  static std::vector<Allocator*> cuda;
  switch (device.type) {
    case DeviceType::cpu: return *cpu;
    case DeviceType::meta: return meta_backend() == Backend::cuda ? *meta_cuda : *meta_cpu;
    case DeviceType::cuda: {
      std::lock_guard lock(cuda_mutex);
      MB_CHECK(device.index >= 0 && device.index < cuda_device_count(),
               "[allocator] {} is not available ({} CUDA devices)", device.str(),
               cuda_device_count());
      if (cuda.size() <= static_cast<std::size_t>(device.index)) cuda.resize(device.index + 1);
      Allocator*& a = cuda[device.index];
      if (a == nullptr) {
        a = new Allocator(device, std::make_unique<CudaBackend>(device.index),
                          AllocatorRules::Segmented);
        // MB_ALLOCATOR_BYPASS=1: every block goes back to cudaFree, so compute-sanitizer sees
        // each allocation's real bounds.
        const char* bypass = std::getenv("MB_ALLOCATOR_BYPASS");
        if (bypass != nullptr && std::string(bypass) == "1") a->set_cache_policy(CachePolicy::Bypass);
      }
      return *a;
    }
  }
  MB_ASSERT(false, "unknown device type");
  return *cpu;
}

MemoryStats memory_stats(Device device) { return allocator(device).stats(); }
void reset_peak_memory_stats(Device device) { allocator(device).reset_peak(); }
void set_memory_budget(Device device, std::size_t bytes) { allocator(device).set_budget(bytes); }
void clear_memory_budget(Device device) { allocator(device).set_budget(std::nullopt); }
void empty_cache(Device device) { allocator(device).empty_cache(); }

std::string format_bytes(std::int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while ((v >= 1024.0 || v <= -1024.0) && u < 4) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0) return fmt::format("{} B", bytes);
  return fmt::format("{:.2f} {}", v, units[u]);
}

}  // namespace microbatch
