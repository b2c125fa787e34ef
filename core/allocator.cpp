#include "core/allocator.h"

#include <cstdlib>
#include <vector>

#include "core/error.h"
#include "kernels/device.h"

namespace microbatch {

namespace {

std::size_t round_up(std::size_t n) { return (n + kBlockRound - 1) / kBlockRound * kBlockRound; }

class HostBackend final : public MemoryBackend {
 public:
  void* system_alloc(std::size_t bytes) override { return std::aligned_alloc(64, bytes); }
  void system_free(void* ptr, std::size_t) noexcept override { std::free(ptr); }
};

// Meta blocks are addresses that are never dereferenced: distinct, ever increasing.
class MetaBackend final : public MemoryBackend {
 public:
  void* system_alloc(std::size_t bytes) override {
    next_ += bytes;
    return reinterpret_cast<void*>(next_ - bytes);
  }
  void system_free(void*, std::size_t) noexcept override {}

 private:
  std::uintptr_t next_ = 0x10000;
};

class CudaBackend final : public MemoryBackend {
 public:
  explicit CudaBackend(int index) : index_(index) {}
  void* system_alloc(std::size_t bytes) override { return kernels::cuda::malloc(bytes, index_); }
  void system_free(void* ptr, std::size_t) noexcept override { kernels::cuda::free(ptr, index_); }

 private:
  int index_;
};

}  // namespace

Allocator::Allocator(Device device, std::unique_ptr<MemoryBackend> backend)
    : device_(device), backend_(std::move(backend)) {}

Allocator::~Allocator() {
  std::lock_guard lock(mutex_);
  release_cache_locked();
  // Live blocks belong to tensors that outlive the allocator (static destruction order); leave them.
}

void* Allocator::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  std::lock_guard lock(mutex_);
  const std::size_t need = round_up(bytes);
  if (policy_ == CachePolicy::Cache) {
    auto it = cache_.lower_bound(need);
    if (it != cache_.end() && it->first <= need + need / 4) {
      void* ptr = it->second;
      std::size_t size = it->first;
      cache_.erase(it);
      live_.emplace(ptr, Block{size, need});
      stats_.allocated.add(static_cast<std::int64_t>(need));
      stats_.active.add(static_cast<std::int64_t>(size));
      ++stats_.num_allocs;
      ++stats_.cache_hits;
      return ptr;
    }
  }
  auto over_budget = [&] {
    return budget_ && static_cast<std::size_t>(stats_.reserved.current) + need > *budget_;
  };
  if (over_budget()) release_cache_locked();
  if (over_budget()) {
    ++stats_.num_ooms;
    throw OutOfMemoryError(
        fmt::format("[allocator] {}: out of memory under the budget: tried to allocate {}; "
                    "allocated {}, reserved {}, budget {}. Lower the micro-batch size, turn on "
                    "activation checkpointing, or raise the budget.",
                    device_.str(), format_bytes(static_cast<std::int64_t>(need)),
                    format_bytes(stats_.allocated.current), format_bytes(stats_.reserved.current),
                    format_bytes(static_cast<std::int64_t>(*budget_))),
        need);
  }
  void* ptr = backend_->system_alloc(need);
  if (ptr == nullptr) {
    release_cache_locked();
    ptr = backend_->system_alloc(need);
  }
  if (ptr == nullptr) {
    ++stats_.num_ooms;
    throw OutOfMemoryError(
        fmt::format("[allocator] {}: the system refused {}; allocated {}, reserved {}. Lower the "
                    "micro-batch size or set a memory budget so the planner can fit the step.",
                    device_.str(), format_bytes(static_cast<std::int64_t>(need)),
                    format_bytes(stats_.allocated.current), format_bytes(stats_.reserved.current)),
        need);
  }
  live_.emplace(ptr, Block{need, need});
  stats_.reserved.add(static_cast<std::int64_t>(need));
  stats_.allocated.add(static_cast<std::int64_t>(need));
  stats_.active.add(static_cast<std::int64_t>(need));
  ++stats_.num_allocs;
  ++stats_.num_system_allocs;
  return ptr;
}

void Allocator::free(void* ptr) noexcept {
  if (ptr == nullptr) return;
  std::lock_guard lock(mutex_);
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

void Allocator::release_cache_locked() noexcept {
  for (auto& [size, ptr] : cache_) {
    backend_->system_free(ptr, size);
    stats_.reserved.sub(static_cast<std::int64_t>(size));
  }
  cache_.clear();
}

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
  static Allocator* cpu = new Allocator(kCPU, std::make_unique<HostBackend>());
  static Allocator* meta = new Allocator(kMeta, std::make_unique<MetaBackend>());
  static std::mutex cuda_mutex;
  static std::vector<Allocator*> cuda;
  switch (device.type) {
    case DeviceType::cpu: return *cpu;
    case DeviceType::meta: return *meta;
    case DeviceType::cuda: {
      std::lock_guard lock(cuda_mutex);
      MB_CHECK(device.index >= 0 && device.index < cuda_device_count(),
               "[allocator] {} is not available ({} CUDA devices)", device.str(),
               cuda_device_count());
      if (cuda.size() <= static_cast<std::size_t>(device.index)) cuda.resize(device.index + 1);
      Allocator*& a = cuda[device.index];
      if (a == nullptr) a = new Allocator(device, std::make_unique<CudaBackend>(device.index));
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
