// The caching allocator: rounding, cache reuse, statistics, the hard budget and its
// out-of-memory error, pool-bypass mode, and the meta allocator following the same rules.
// Most cases run a private Allocator over a recording backend, so every system call is seen;
// the rest use the process-wide allocators and restore them (budget, policy) on every exit path.
#include <cstdlib>
#include <map>

#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

// Host memory that counts every system allocation and release.
class RecordingBackend final : public MemoryBackend {
 public:
  struct Counts {
    int allocs = 0;
    int frees = 0;
    std::int64_t live_bytes = 0;
  };
  explicit RecordingBackend(Counts* counts, std::size_t refuse_above = SIZE_MAX)
      : counts_(counts), refuse_above_(refuse_above) {}
  void* system_alloc(std::size_t bytes) override {
    if (bytes > refuse_above_) return nullptr;
    ++counts_->allocs;
    counts_->live_bytes += static_cast<std::int64_t>(bytes);
    return std::malloc(bytes);
  }
  void system_free(void* ptr, std::size_t bytes) noexcept override {
    ++counts_->frees;
    counts_->live_bytes -= static_cast<std::int64_t>(bytes);
    std::free(ptr);
  }

 private:
  Counts* counts_;
  std::size_t refuse_above_;
};

// Puts a process-wide allocator back the way every test expects it, however the test ends.
class GlobalAllocatorRestore {
 public:
  explicit GlobalAllocatorRestore(Device device) : device_(device) {}
  ~GlobalAllocatorRestore() {
    clear_memory_budget(device_);
    allocator(device_).set_cache_policy(CachePolicy::Cache);
  }
  GlobalAllocatorRestore(const GlobalAllocatorRestore&) = delete;
  GlobalAllocatorRestore& operator=(const GlobalAllocatorRestore&) = delete;

 private:
  Device device_;
};

constexpr std::int64_t KiB = 1024;

}  // namespace

TEST_CASE("allocator: requests round up to 512 bytes; zero bytes take nothing") {
  RecordingBackend::Counts counts;
  Allocator a(kCPU, std::make_unique<RecordingBackend>(&counts));
  CHECK(a.allocate(0) == nullptr);
  CHECK(a.stats().num_allocs == 0);
  CHECK(counts.allocs == 0);

  void* p = a.allocate(1);
  REQUIRE(p != nullptr);
  CHECK(a.stats().allocated.current == 512);
  CHECK(counts.live_bytes == 512);
  void* q = a.allocate(513);
  CHECK(a.stats().allocated.current == 512 + 1024);
  a.free(p);
  a.free(q);
  a.free(nullptr);  // a no-op
  CHECK(a.stats().allocated.current == 0);
  CHECK(a.stats().num_frees == 2);
}

TEST_CASE("allocator: a request too large to round up is refused, naming its size") {
  // Rounded up to 512 bytes, SIZE_MAX wrapped to a zero-byte block, and SIZE_MAX - 600 to a block
  // whose size the int64 statistics read as -512.
  for (AllocatorRules rules : {AllocatorRules::BestFit, AllocatorRules::Segmented}) {
    RecordingBackend::Counts counts;
    Allocator a(kCPU, std::make_unique<RecordingBackend>(&counts, 1 << 20), rules);
    const std::size_t largest_counted = static_cast<std::size_t>(INT64_MAX);
    int refused = 0;
    for (std::size_t bytes : {SIZE_MAX, SIZE_MAX - 600, largest_counted + 1, kMaxRequest + 1}) {
      INFO((rules == AllocatorRules::BestFit ? "best fit" : "segmented") << ", " << bytes);
      std::string message;
      std::size_t requested = 0;
      try {
        a.allocate(bytes);
      } catch (const OutOfMemoryError& e) {
        message = e.what();
        requested = e.requested();
      }
      CHECK(message.find("cannot allocate " + std::to_string(bytes) + " bytes") !=
            std::string::npos);
      CHECK(requested == bytes);
      CHECK(a.stats().num_ooms == ++refused);
    }
    // The largest request served rounds to itself, and reaches the system (which refuses it).
    check_throws_with([&] { a.allocate(kMaxRequest); }, "the system refused");
    CHECK(kMaxRequest % kLargeSegmentRound == 0);  // so of kBlockRound too
    CHECK(kMaxRequest <= largest_counted);
    CHECK(largest_counted - kMaxRequest < kLargeSegmentRound);
    CHECK(counts.allocs == 0);
    CHECK(a.stats().allocated.current == 0);
    CHECK(a.stats().reserved.current == 0);
  }
}

TEST_CASE("allocator: a freed block is reused from the cache") {
  RecordingBackend::Counts counts;
  Allocator a(kCPU, std::make_unique<RecordingBackend>(&counts));
  void* p = a.allocate(1000);  // 1024 after rounding
  a.free(p);
  MemoryStats s = a.stats();
  CHECK(s.allocated.current == 0);
  CHECK(s.active.current == 0);
  CHECK(s.reserved.current == 1024);  // still held, in the cache
  CHECK(counts.frees == 0);

  void* q = a.allocate(900);  // also 1024 after rounding: the cached block
  CHECK(q == p);
  s = a.stats();
  CHECK(s.cache_hits == 1);
  CHECK(s.num_system_allocs == 1);
  CHECK(s.num_allocs == 2);
  CHECK(counts.allocs == 1);
  a.free(q);

  // A cached block is reused only if it wastes at most a quarter of the request.
  void* big = a.allocate(4096);
  a.free(big);
  void* small = a.allocate(1024);  // the 1024 block fits exactly and wins over the 4096 one
  CHECK(small == p);
  void* mid = a.allocate(2048);  // 4096 > 2048 + 512: not reused, a new block
  CHECK(mid != big);
  CHECK(a.stats().cache_hits == 2);
  void* near = a.allocate(3584);  // 4096 <= 3584 + 896: reused
  CHECK(near == big);
  s = a.stats();
  CHECK(s.cache_hits == 3);
  CHECK(s.allocated.current == 1024 + 2048 + 3584);
  CHECK(s.active.current == 1024 + 2048 + 4096);  // the whole block is in use
  CHECK(s.reserved.current == 1024 + 2048 + 4096);
  a.free(small);
  a.free(mid);
  a.free(near);

  a.empty_cache();
  CHECK(a.stats().reserved.current == 0);
  CHECK(counts.frees == counts.allocs);
  CHECK(counts.live_bytes == 0);
}

TEST_CASE("allocator: current and peak statistics, and reset_peak") {
  RecordingBackend::Counts counts;
  Allocator a(kCPU, std::make_unique<RecordingBackend>(&counts));
  void* x = a.allocate(1024);
  void* y = a.allocate(2048);
  a.free(y);
  MemoryStats s = a.stats();
  CHECK(s.allocated.current == 1024);
  CHECK(s.allocated.peak == 3072);
  CHECK(s.active.peak == 3072);
  CHECK(s.reserved.current == 3072);
  CHECK(s.reserved.peak == 3072);

  a.reset_peak();
  s = a.stats();
  CHECK(s.allocated.peak == 1024);
  CHECK(s.active.peak == 1024);
  CHECK(s.reserved.peak == 3072);  // reserved current is still 3072 (cached)

  a.empty_cache();
  a.reset_peak();
  CHECK(a.stats().reserved.peak == 1024);
  void* z = a.allocate(512);
  CHECK(a.stats().allocated.peak == 1536);
  a.free(z);
  a.free(x);
  CHECK(a.stats().allocated.peak == 1536);
  CHECK(a.stats().allocated.current == 0);
}

TEST_CASE("allocator: the budget frees the cache, then refuses before asking the system") {
  RecordingBackend::Counts counts;
  Allocator a(kCPU, std::make_unique<RecordingBackend>(&counts));
  a.set_budget(4 * KiB);
  CHECK(a.budget() == std::optional<std::size_t>(4 * KiB));

  void* kept = a.allocate(2 * KiB);
  a.free(a.allocate(1 * KiB));  // 1 KiB now cached: reserved 3 KiB
  CHECK(a.stats().reserved.current == 3 * KiB);

  // 3 KiB + 2 KiB would pass the budget: the cached block is released, then 2 + 2 fits exactly.
  void* second = a.allocate(2 * KiB);
  CHECK(counts.frees == 1);
  CHECK(a.stats().reserved.current == 4 * KiB);
  CHECK(a.stats().num_ooms == 0);

  const MemoryStats before = a.stats();
  const int system_allocs = counts.allocs;
  bool thrown = false;
  try {
    a.allocate(100);
  } catch (const OutOfMemoryError& e) {
    thrown = true;
    const std::string msg = e.what();
    CHECK(e.requested() == 512);
    CHECK(msg.find("tried to allocate 512 B") != std::string::npos);
    CHECK(msg.find("allocated 4.00 KiB") != std::string::npos);
    CHECK(msg.find("reserved 4.00 KiB") != std::string::npos);
    CHECK(msg.find("budget 4.00 KiB") != std::string::npos);
    CHECK(msg.find("cpu") != std::string::npos);
  }
  CHECK(thrown);
  const MemoryStats after = a.stats();
  CHECK(counts.allocs == system_allocs);  // refused before asking the system
  CHECK(after.num_ooms == before.num_ooms + 1);
  CHECK(after.allocated.current == before.allocated.current);
  CHECK(after.reserved.current == before.reserved.current);
  CHECK(after.active.current == before.active.current);
  CHECK(after.num_allocs == before.num_allocs);

  // After a free the same request succeeds: the cached 2 KiB block is too wasteful to serve
  // 512 bytes, so it is released to make room under the budget.
  a.free(second);
  void* again = a.allocate(100);
  CHECK(counts.frees == 2);
  CHECK(a.stats().reserved.current == 2 * KiB + 512);
  a.free(again);
  a.set_budget(std::nullopt);
  CHECK_FALSE(a.budget().has_value());
  void* large = a.allocate(64 * KiB);
  CHECK(large != nullptr);
  a.free(large);
  a.free(kept);
}

TEST_CASE("allocator: a request the system refuses frees the cache, retries, then throws") {
  RecordingBackend::Counts counts;
  Allocator a(kCPU, std::make_unique<RecordingBackend>(&counts, 8 * KiB));
  a.free(a.allocate(4 * KiB));
  CHECK(a.stats().reserved.current == 4 * KiB);
  check_throws_with([&] { a.allocate(16 * KiB); }, "the system refused 16.00 KiB");
  CHECK(a.stats().num_ooms == 1);
  CHECK(a.stats().reserved.current == 0);  // the cache went back before the retry
  CHECK(a.stats().allocated.current == 0);
}

TEST_CASE("allocator: pool-bypass mode returns every block to the system at once") {
  RecordingBackend::Counts counts;
  Allocator a(kCPU, std::make_unique<RecordingBackend>(&counts));
  a.free(a.allocate(1 * KiB));
  CHECK(counts.live_bytes == 1 * KiB);
  a.set_cache_policy(CachePolicy::Bypass);  // drops what is cached
  CHECK(counts.live_bytes == 0);
  CHECK(a.stats().reserved.current == 0);

  void* p = a.allocate(1 * KiB);
  CHECK(counts.live_bytes == 1 * KiB);
  a.free(p);
  CHECK(counts.live_bytes == 0);
  CHECK(a.stats().reserved.current == 0);
  a.free(a.allocate(1 * KiB));
  CHECK(a.stats().cache_hits == 0);
  CHECK(counts.allocs == 3);

  a.set_cache_policy(CachePolicy::Cache);
  a.free(a.allocate(1 * KiB));
  a.free(a.allocate(1 * KiB));
  CHECK(a.stats().cache_hits == 1);
}

TEST_CASE("allocator: tensors release their storage when the last view dies") {
  empty_cache(kCPU);
  const std::int64_t base = memory_stats(kCPU).allocated.current;
  Tensor t = empty({256});  // 1 KiB
  CHECK(memory_stats(kCPU).allocated.current == base + 1 * KiB);
  CHECK(reinterpret_cast<std::uintptr_t>(t.raw_data()) % 64 == 0);  // host blocks are 64-aligned
  Tensor v = t.slice(0, 10, 20);
  t = Tensor();
  CHECK(memory_stats(kCPU).allocated.current == base + 1 * KiB);  // the view keeps it alive
  v = Tensor();
  CHECK(memory_stats(kCPU).allocated.current == base);
  CHECK(memory_stats(kCPU).reserved.current >= base + 1 * KiB);  // cached for reuse
}

TEST_CASE("allocator: set_memory_budget on the CPU frees the cache, then throws OutOfMemoryError") {
  GlobalAllocatorRestore restore(kCPU);
  empty_cache(kCPU);
  const MemoryStats start = memory_stats(kCPU);
  { Tensor cached = empty({64 * KiB}); }  // 256 KiB, now cached
  CHECK(memory_stats(kCPU).reserved.current == start.reserved.current + 256 * KiB);

  set_memory_budget(kCPU, static_cast<std::size_t>(start.reserved.current + 384 * KiB));
  Tensor keep = ones({16});
  const MemoryStats before = memory_stats(kCPU);
  bool thrown = false;
  try {
    Tensor too_big = empty({128 * KiB});  // 512 KiB: over the budget even with the cache released
  } catch (const OutOfMemoryError& e) {
    thrown = true;
    const std::string msg = e.what();
    CHECK(e.requested() == 512 * KiB);
    CHECK(msg.find("tried to allocate 512.00 KiB") != std::string::npos);
    CHECK(msg.find("allocated ") != std::string::npos);
    CHECK(msg.find("reserved ") != std::string::npos);
    CHECK(msg.find("budget ") != std::string::npos);
  }
  REQUIRE(thrown);
  const MemoryStats after = memory_stats(kCPU);
  CHECK(after.allocated.current == before.allocated.current);
  CHECK(after.num_ooms == before.num_ooms + 1);
  CHECK(after.reserved.current == before.reserved.current - 256 * KiB);  // the cache went first
  CHECK(keep.to_vector() == std::vector<double>(16, 1.0));

  // Under the budget, allocation goes on as usual.
  Tensor fits = zeros({32 * KiB});  // 128 KiB
  CHECK(fits.numel() == 32 * KiB);
  clear_memory_budget(kCPU);
  Tensor now_fits = empty({128 * KiB});
  CHECK(now_fits.numel() == 128 * KiB);
}

TEST_CASE("allocator: bypass mode on the CPU allocator returns tensor memory at once") {
  GlobalAllocatorRestore restore(kCPU);
  allocator(kCPU).set_cache_policy(CachePolicy::Bypass);
  const std::int64_t reserved = memory_stats(kCPU).reserved.current;
  CHECK(reserved == memory_stats(kCPU).active.current);  // nothing cached
  {
    Tensor t = ones({1024});
    CHECK(memory_stats(kCPU).reserved.current == reserved + 4 * KiB);
  }
  CHECK(memory_stats(kCPU).reserved.current == reserved);
  const std::int64_t hits = memory_stats(kCPU).cache_hits;
  { Tensor t = ones({1024}); }
  CHECK(memory_stats(kCPU).cache_hits == hits);
}

TEST_CASE("allocator: the meta allocator follows the same rules, without memory") {
  GlobalAllocatorRestore restore(kMeta);
  empty_cache(kMeta);
  empty_cache(kCPU);
  // The same sequence of tensors on both devices moves the statistics identically.
  auto run = [](Device d) {
    const MemoryStats s0 = memory_stats(d);
    reset_peak_memory_stats(d);
    Tensor a = empty({1000}, {.device = d});  // 4000 -> 4096
    Tensor b = empty({300}, {.device = d});   // 1200 -> 1536
    a = Tensor();
    Tensor c = empty({850}, {.device = d});  // 3400 -> 3584, served by the cached 4096 block
    const MemoryStats s = memory_stats(d);
    return std::vector<std::int64_t>{
        s.allocated.current - s0.allocated.current, s.allocated.peak - s0.allocated.current,
        s.reserved.current - s0.reserved.current,   s.reserved.peak - s0.reserved.current,
        s.active.current - s0.active.current,       s.cache_hits - s0.cache_hits,
        s.num_system_allocs - s0.num_system_allocs};
  };
  const std::vector<std::int64_t> cpu = run(kCPU);
  const std::vector<std::int64_t> meta = run(kMeta);
  CHECK(cpu == std::vector<std::int64_t>{1536 + 3584, 4096 + 1536, 4096 + 1536, 4096 + 1536,
                                         1536 + 4096, 1, 2});
  CHECK(meta == cpu);

  // A budget on meta is enforced the same way, and OutOfMemoryError names the device.
  empty_cache(kMeta);
  const std::int64_t reserved = memory_stats(kMeta).reserved.current;
  set_memory_budget(kMeta, static_cast<std::size_t>(reserved) + (std::size_t{1} << 30));
  Tensor fine = empty({1 << 28}, {.device = kMeta});  // exactly 1 GiB
  check_throws_with([] { empty({1}, {.device = kMeta}); }, "meta: out of memory under the budget");
  fine = Tensor();
  // 512 MiB does not take the cached 1 GiB block (too wasteful); the cache makes room instead.
  Tensor again = empty({1 << 27}, {.device = kMeta});
  CHECK(memory_stats(kMeta).reserved.current == reserved + (std::int64_t{1} << 29));
  again = Tensor();
  clear_memory_budget(kMeta);
  { Tensor huge = empty({std::int64_t{1} << 40}, {.device = kMeta}); }  // 4 TiB of nothing
  empty_cache(kMeta);
  CHECK(memory_stats(kMeta).reserved.current == reserved);
}

TEST_CASE("format_bytes") {
  CHECK(format_bytes(0) == "0 B");
  CHECK(format_bytes(512) == "512 B");
  CHECK(format_bytes(1536) == "1.50 KiB");
  CHECK(format_bytes(3 * 1024 * 1024) == "3.00 MiB");
  CHECK(format_bytes(std::int64_t{5} << 30) == "5.00 GiB");
}
