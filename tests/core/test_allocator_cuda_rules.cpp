// The Segmented allocator rules (CUDA devices, and meta mirroring CUDA): size classes, segments,
// splitting and merging, stream separation, the budget, refusals, bypass mode and statistics.
// Most cases run a private Allocator over a fake backend that hands out addresses it never
// touches, contiguous from one segment to the next (so a merge across segments would show), and
// counts every system call; expected values are derived in each test from the rules.
#include <vector>

#include "core/ops/dispatch.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

// System memory that exists only as addresses; records every call and can refuse.
class FakeBackend final : public MemoryBackend {
 public:
  struct State {
    int allocs = 0;
    int frees = 0;
    int refusals = 0;
    std::int64_t live_bytes = 0;
    std::vector<std::size_t> alloc_sizes;
    std::uintptr_t stream = 0;  // what stream_id() answers
    int refuse_next = 0;        // refuse this many calls from now on
    bool descending = false;    // each new block below the previous one, as a device may place them
  };
  explicit FakeBackend(State* state) : state_(state) {}
  void* system_alloc(std::size_t bytes) override {
    if (state_->refuse_next > 0) {
      --state_->refuse_next;
      ++state_->refusals;
      return nullptr;
    }
    ++state_->allocs;
    state_->live_bytes += static_cast<std::int64_t>(bytes);
    state_->alloc_sizes.push_back(bytes);
    if (state_->descending) {
      low_ -= bytes;
      return reinterpret_cast<void*>(low_);
    }
    next_ += bytes;
    return reinterpret_cast<void*>(next_ - bytes);
  }
  void system_free(void*, std::size_t bytes) noexcept override {
    ++state_->frees;
    state_->live_bytes -= static_cast<std::int64_t>(bytes);
  }
  std::uintptr_t stream_id() override { return state_->stream; }

 private:
  State* state_;
  std::uintptr_t next_ = 0x100000;
  std::uintptr_t low_ = std::uintptr_t{1} << 48;
};

std::int64_t i64(std::size_t n) { return static_cast<std::int64_t>(n); }
std::size_t round512(std::size_t n) { return (n + 511) / 512 * 512; }
char* at(void* p) { return static_cast<char*>(p); }

// Statistics a sequence moves, relative to where it started.
std::vector<std::int64_t> deltas(const MemoryStats& start, const MemoryStats& end) {
  return {end.allocated.current - start.allocated.current,
          end.allocated.peak - start.allocated.current,
          end.active.current - start.active.current,
          end.active.peak - start.active.current,
          end.reserved.current - start.reserved.current,
          end.reserved.peak - start.reserved.current,
          end.num_system_allocs - start.num_system_allocs,
          end.cache_hits - start.cache_hits};
}

}  // namespace

TEST_CASE("segmented allocator: rounding, size classes and segment sizes") {
  FakeBackend::State sys;
  Allocator a(kCPU, std::make_unique<FakeBackend>(&sys), AllocatorRules::Segmented);
  CHECK(a.rules() == AllocatorRules::Segmented);
  CHECK(a.allocate(0) == nullptr);
  CHECK(sys.allocs == 0);

  void* tiny = a.allocate(1);  // 512 B from a new 2 MiB small segment
  CHECK(a.stats().allocated.current == 512);
  CHECK(a.stats().active.current == 512);
  CHECK(a.stats().reserved.current == i64(kSmallSegment));
  void* edge = a.allocate(kSmallRequest);  // still small: carved from the same segment
  CHECK(at(edge) == at(tiny) + 512);
  CHECK(sys.allocs == 1);

  // Just over 1 MiB is large: rounded to 1 MiB + 512, in a 2 MiB segment; the remainder
  // (1 MiB - 512) is not more than 1 MiB, so the whole segment is in use.
  void* over = a.allocate(kSmallRequest + 1);
  CHECK(sys.alloc_sizes.back() == kLargeSegmentRound);
  CHECK(a.stats().allocated.current == i64(512 + kSmallRequest + kSmallRequest + 512));
  CHECK(a.stats().active.current == i64(512 + kSmallRequest + kLargeSegmentRound));

  // Over 10 MiB: a segment of the request rounded up to 2 MiB, split when the rest passes 1 MiB.
  void* big = a.allocate(10 * MiB + 1);  // 10 MiB + 512 in 12 MiB; the rest (2 MiB - 512) splits
  CHECK(sys.alloc_sizes.back() == 12 * MiB);
  CHECK(a.stats().active.current ==
        i64(512 + kSmallRequest + kLargeSegmentRound + 10 * MiB + 512));
  void* exact = a.allocate(14 * MiB);  // an exact multiple: an exact segment
  CHECK(sys.alloc_sizes.back() == 14 * MiB);
  CHECK(sys.alloc_sizes == std::vector<std::size_t>{kSmallSegment, 2 * MiB, 12 * MiB, 14 * MiB});
  CHECK(a.stats().reserved.current == i64(kSmallSegment + 2 * MiB + 12 * MiB + 14 * MiB));
  CHECK(a.stats().num_system_allocs == 4);
  CHECK(a.stats().cache_hits == 1);  // `edge`

  for (void* p : {tiny, edge, over, big, exact}) a.free(p);
  a.free(nullptr);  // a no-op
  a.free(big);      // a double free is ignored
  CHECK(a.stats().num_frees == 5);
  CHECK(a.stats().allocated.current == 0);
  CHECK(a.stats().active.current == 0);
  a.empty_cache();
  CHECK(a.stats().reserved.current == 0);
  CHECK(sys.frees == 4);
  CHECK(sys.live_bytes == 0);
}

TEST_CASE("segmented allocator: blocks split, and freed neighbours merge within a segment") {
  FakeBackend::State sys;
  Allocator a(kCPU, std::make_unique<FakeBackend>(&sys), AllocatorRules::Segmented);
  void* x = a.allocate(256 * KiB);
  void* y = a.allocate(256 * KiB);
  void* z = a.allocate(256 * KiB);
  CHECK(at(y) == at(x) + 256 * KiB);  // split from one segment, in address order
  CHECK(at(z) == at(y) + 256 * KiB);
  CHECK(sys.allocs == 1);
  CHECK(a.stats().active.current == i64(768 * KiB));

  a.free(y);
  a.free(x);  // merges with y: a free 512 KiB block at x
  void* xy = a.allocate(512 * KiB);
  CHECK(xy == x);
  CHECK(sys.allocs == 1);
  CHECK(a.stats().cache_hits == 3);  // y, z and xy came from free blocks
  CHECK(a.stats().active.current == i64(768 * KiB));  // no waste: every block fits exactly

  a.free(z);  // merges with the segment's tail: 1536 KiB free at z
  void* w = a.allocate(768 * KiB);
  CHECK(w == z);
  a.free(xy);
  // The best fit for 200 KiB: the free 512 KiB block at x, not the 768 KiB tail after w.
  void* v = a.allocate(200 * KiB);
  CHECK(v == x);
  a.free(v);
  a.free(w);
  CHECK(a.stats().reserved.current == i64(kSmallSegment));
  a.empty_cache();  // all blocks free and merged: the segment goes back whole
  CHECK(sys.frees == 1);
  CHECK(a.stats().reserved.current == 0);
}

TEST_CASE("segmented allocator: blocks never merge across segments, however adjacent") {
  FakeBackend::State sys;
  Allocator a(kCPU, std::make_unique<FakeBackend>(&sys), AllocatorRules::Segmented);
  void* first = a.allocate(kSmallRequest);
  void* second = a.allocate(kSmallRequest);  // the rest of segment 1, exactly
  void* third = a.allocate(kSmallRequest);   // segment 2, whose address follows segment 1's end
  CHECK(at(third) == at(second) + kSmallRequest);
  CHECK(sys.allocs == 2);
  a.free(second);
  a.free(third);
  a.empty_cache();  // segment 2 is wholly free; segment 1 still holds `first`
  CHECK(sys.frees == 1);
  CHECK(a.stats().reserved.current == i64(kSmallSegment));
  void* again = a.allocate(kSmallRequest);  // the free half of segment 1, not a merged 2 MiB
  CHECK(again == second);
  CHECK(sys.allocs == 2);
  a.free(again);
  a.free(first);
  a.empty_cache();
  CHECK(sys.live_bytes == 0);
}

TEST_CASE("segmented allocator: the small and large pools never lend to each other") {
  FakeBackend::State sys;
  Allocator a(kCPU, std::make_unique<FakeBackend>(&sys), AllocatorRules::Segmented);
  a.free(a.allocate(kSmallRequest));  // a free 2 MiB small segment
  void* large = a.allocate(kSmallRequest + 512);
  CHECK(sys.allocs == 2);  // the small segment is not used for a large request
  a.free(large);           // a free 2 MiB large segment
  void* small = a.allocate(512 * KiB);
  CHECK(sys.allocs == 2);  // served by the small segment
  CHECK(a.stats().active.current == i64(512 * KiB));
  a.free(small);

  // A large free block splits only when more than 1 MiB would remain.
  void* eight = a.allocate(8 * MiB);
  a.free(eight);
  const MemoryStats before = a.stats();
  void* three = a.allocate(3 * MiB);  // from the 8 MiB block: 5 MiB remain, split off
  CHECK(three == eight);
  void* rest = a.allocate(4 * MiB + 512 * KiB);  // from the 5 MiB remainder: 512 KiB left, kept
  CHECK(at(rest) == at(eight) + 3 * MiB);
  const MemoryStats after = a.stats();
  CHECK(after.num_system_allocs == before.num_system_allocs);
  CHECK(after.allocated.current - before.allocated.current == i64(3 * MiB + 4 * MiB + 512 * KiB));
  CHECK(after.active.current - before.active.current == i64(3 * MiB + 5 * MiB));
  a.free(three);
  a.free(rest);

  // Exactly 1 MiB left over is not more than 1 MiB: the block is used whole.
  void* whole = a.allocate(7 * MiB);  // from the merged 8 MiB block
  CHECK(whole == eight);
  CHECK(a.stats().active.current == i64(8 * MiB));
  a.free(whole);
  a.empty_cache();
  CHECK(sys.live_bytes == 0);
}

TEST_CASE("segmented allocator: equal fits go to the older segment, wherever the system put it") {
  FakeBackend::State sys{.descending = true};
  Allocator a(kCPU, std::make_unique<FakeBackend>(&sys), AllocatorRules::Segmented);
  void* old_free = a.allocate(kSmallRequest);
  void* old_kept = a.allocate(kSmallRequest);
  void* new_free = a.allocate(kSmallRequest);  // a second segment, at a lower address
  void* new_kept = a.allocate(kSmallRequest);
  REQUIRE(at(new_free) < at(old_free));
  a.free(new_free);
  a.free(old_free);
  // Which block is taken decides later merges, so the meta device (ascending addresses) and a GPU
  // (any addresses) must choose alike: by segment age, then by offset.
  CHECK(a.allocate(kSmallRequest) == old_free);
  CHECK(a.allocate(kSmallRequest) == new_free);
  for (void* p : {old_free, old_kept, new_free, new_kept}) a.free(p);
  a.empty_cache();
  CHECK(sys.live_bytes == 0);
}

TEST_CASE("segmented allocator: a block freed on one stream is reused only on that stream") {
  FakeBackend::State sys;
  Allocator a(kCPU, std::make_unique<FakeBackend>(&sys), AllocatorRules::Segmented);
  // Stream 3 sorts before stream 7 in the bins: its search must still not land on 7's blocks.
  sys.stream = 7;
  void* p = a.allocate(4 * KiB);
  a.free(p);
  sys.stream = 3;
  void* q = a.allocate(4 * KiB);  // stream 7's free segment is not offered to stream 3
  CHECK(q != p);
  CHECK(sys.allocs == 2);
  CHECK(a.stats().cache_hits == 0);
  sys.stream = 7;
  void* r = a.allocate(4 * KiB);
  CHECK(r == p);
  CHECK(a.stats().cache_hits == 1);
  a.free(r);
  // A block freed while another stream is current goes back to its own stream's bin.
  a.free(q);
  CHECK(a.allocate(4 * KiB) == p);  // stream 7's block, not q
  a.empty_cache();                  // stream 3's segment is wholly free: it goes back
  CHECK(sys.frees == 1);
  CHECK(a.stats().reserved.current == i64(kSmallSegment));
  a.free(p);
  a.empty_cache();
  CHECK(sys.live_bytes == 0);
}

TEST_CASE("segmented allocator: the budget frees whole segments, then refuses before the system") {
  FakeBackend::State sys;
  Allocator a(kCPU, std::make_unique<FakeBackend>(&sys), AllocatorRules::Segmented);
  a.set_budget(3 * MiB);
  void* small = a.allocate(512);  // a 2 MiB segment

  // A large request needs a new 2 MiB segment: 4 MiB > 3 MiB, and no segment is wholly free.
  const MemoryStats before = a.stats();
  bool thrown = false;
  try {
    a.allocate(kSmallRequest + 1);
  } catch (const OutOfMemoryError& e) {
    thrown = true;
    const std::string msg = e.what();
    CHECK(e.requested() == kSmallRequest + 512);
    CHECK(msg.find("out of memory under the budget") != std::string::npos);
    CHECK(msg.find("tried to allocate 1.00 MiB (a new 2.00 MiB segment)") != std::string::npos);
    CHECK(msg.find("allocated 512 B") != std::string::npos);
    CHECK(msg.find("reserved 2.00 MiB") != std::string::npos);
    CHECK(msg.find("budget 3.00 MiB") != std::string::npos);
  }
  REQUIRE(thrown);
  CHECK(sys.allocs == 1);  // the system was never asked
  const MemoryStats after = a.stats();
  CHECK(after.num_ooms == before.num_ooms + 1);
  CHECK(after.allocated.current == before.allocated.current);
  CHECK(after.active.current == before.active.current);
  CHECK(after.reserved.current == before.reserved.current);
  CHECK(after.num_allocs == before.num_allocs);

  // Once the small segment is wholly free, the budget releases it and the request fits.
  a.free(small);
  void* large = a.allocate(kSmallRequest + 1);
  CHECK(sys.frees == 1);
  CHECK(sys.allocs == 2);
  CHECK(a.stats().reserved.current == i64(2 * MiB));
  // A small request now needs a small segment: 2 + 2 > 3 and nothing is free to release.
  check_throws_with([&] { a.allocate(1); }, "tried to allocate 512 B (a new 2.00 MiB segment)");
  CHECK(sys.allocs == 2);
  a.free(large);
  a.set_budget(std::nullopt);
  a.empty_cache();
  CHECK(sys.live_bytes == 0);
}

TEST_CASE("segmented allocator: a refused system allocation releases free segments and retries") {
  FakeBackend::State sys;
  Allocator a(kCPU, std::make_unique<FakeBackend>(&sys), AllocatorRules::Segmented);
  a.free(a.allocate(4 * MiB));  // a wholly free 4 MiB segment
  sys.refuse_next = 1;
  void* p = a.allocate(1 * KiB);  // refused once: the free segment goes back, the retry succeeds
  CHECK(p != nullptr);
  CHECK(sys.refusals == 1);
  CHECK(sys.frees == 1);
  CHECK(sys.allocs == 2);
  CHECK(a.stats().num_ooms == 0);
  CHECK(a.stats().reserved.current == i64(kSmallSegment));

  sys.refuse_next = 2;  // refused twice: out of memory, with the statistics in the message
  check_throws_with([&] { a.allocate(6 * MiB); },
                    "the system refused 6.00 MiB; allocated 1.00 KiB");
  CHECK(sys.refusals == 3);
  CHECK(a.stats().num_ooms == 1);
  CHECK(a.stats().reserved.current == i64(kSmallSegment));  // the live segment stays
  a.free(p);
  a.empty_cache();
  CHECK(sys.live_bytes == 0);
}

TEST_CASE("segmented allocator: pool-bypass mode gives every request its own system block") {
  FakeBackend::State sys;
  Allocator a(kCPU, std::make_unique<FakeBackend>(&sys), AllocatorRules::Segmented);
  void* kept = a.allocate(1 * KiB);  // a shared small segment, live across the switch
  void* shared = a.allocate(1 * KiB);
  a.free(a.allocate(3 * MiB));  // a wholly free large segment
  a.set_cache_policy(CachePolicy::Bypass);  // drops the free segment only
  CHECK(sys.frees == 1);
  CHECK(a.stats().reserved.current == i64(kSmallSegment));

  void* p = a.allocate(1000);  // exactly 1024 bytes from the system, never split
  CHECK(sys.alloc_sizes.back() == 1024);
  CHECK(a.stats().active.current == i64(3 * KiB));
  a.free(p);
  CHECK(sys.frees == 2);
  a.free(a.allocate(5 * MiB + 1));
  CHECK(sys.alloc_sizes.back() == 5 * MiB + 512);
  CHECK(sys.frees == 3);
  CHECK(a.stats().cache_hits == 1);  // only `shared`, before the switch

  a.free(kept);  // the segment still holds `shared`: it stays
  CHECK(sys.frees == 3);
  a.free(shared);  // now wholly free: back at once
  CHECK(sys.frees == 4);
  CHECK(sys.live_bytes == 0);
  CHECK(a.stats().reserved.current == 0);
  a.set_cache_policy(CachePolicy::Cache);
  a.free(a.allocate(1 * KiB));
  a.free(a.allocate(1 * KiB));
  CHECK(a.stats().cache_hits == 2);
}

TEST_CASE("segmented allocator: statistics of a scripted sequence, derived from the rules") {
  FakeBackend::State sys;
  Allocator a(kCPU, std::make_unique<FakeBackend>(&sys), AllocatorRules::Segmented);
  const std::size_t A = round512(300000);         // small
  const std::size_t B = round512(5 * MiB + 100);  // large: a 6 MiB segment, rest <= 1 MiB: whole
  const std::size_t C = round512(700000);         // small: split from A's segment
  const std::size_t D = round512(200000);         // small: best fit is A's freed block, split
  const std::size_t E = 3 * MiB;                  // large: B's freed block, 3 MiB rest split off
  const std::size_t b_block = 6 * MiB;
  REQUIRE(b_block - B <= kSmallRequest);
  REQUIRE(kSmallSegment - A - C > A);  // so A's freed block is the best fit for D

  void* pa = a.allocate(300000);
  void* pb = a.allocate(5 * MiB + 100);
  void* pc = a.allocate(700000);
  a.free(pa);
  void* pd = a.allocate(200000);
  CHECK(pd == pa);
  a.free(pb);
  void* pe = a.allocate(3 * MiB);
  CHECK(pe == pb);

  const MemoryStats s = a.stats();
  CHECK(s.allocated.current == i64(C + D + E));
  CHECK(s.allocated.peak == i64(A + B + C));  // after c; later B + C + D is smaller since D < A
  CHECK(s.active.current == i64(C + D + E));
  CHECK(s.active.peak == i64(A + b_block + C));
  CHECK(s.reserved.current == i64(kSmallSegment + b_block));
  CHECK(s.reserved.peak == i64(kSmallSegment + b_block));
  CHECK(s.num_allocs == 5);
  CHECK(s.num_frees == 2);
  CHECK(s.num_system_allocs == 2);
  CHECK(s.cache_hits == 3);  // c, d, e

  a.reset_peak();
  CHECK(a.stats().allocated.peak == i64(C + D + E));
  CHECK(a.stats().active.peak == i64(C + D + E));
  a.free(pc);
  a.free(pd);
  a.free(pe);
  a.empty_cache();  // every block merged back into its segment: both go
  CHECK(sys.frees == 2);
  CHECK(a.stats().reserved.current == 0);
  CHECK(a.stats().reserved.peak == i64(kSmallSegment + b_block));
}

namespace {

// A sequence of tensors (byte-sized u8, so requests are exact) touching both pools, splitting,
// merging and reuse; the same as allocator calls below.
const std::vector<std::size_t> kSequenceBytes = {300000, 5 * MiB + 100, 700000, 200000,
                                                 3 * MiB, 12 * MiB,     64,     1 * MiB};

MemoryStats run_tensor_sequence(Device device) {
  std::vector<Tensor> t;
  for (std::size_t bytes : kSequenceBytes) {
    t.push_back(empty({static_cast<std::int64_t>(bytes)}, {.dtype = DType::u8, .device = device}));
    if (t.size() == 3) t[0] = Tensor();
    if (t.size() == 5) t[1] = Tensor();
    if (t.size() == 7) t[5] = Tensor();
  }
  return memory_stats(device);
}

MemoryStats run_allocator_sequence(Allocator& a) {
  std::vector<void*> p;
  for (std::size_t bytes : kSequenceBytes) {
    p.push_back(a.allocate(bytes));
    if (p.size() == 3) a.free(p[0]);
    if (p.size() == 5) a.free(p[1]);
    if (p.size() == 7) a.free(p[5]);
  }
  const MemoryStats s = a.stats();
  for (std::size_t i : {2, 3, 4, 6, 7}) a.free(p[i]);
  return s;
}

// Prepares a device's allocator for a sequence whose statistics must match a fresh allocator's:
// no cached segments, and no free block inside a segment that something else keeps alive.
MemoryStats clean_start(Device device) {
  empty_cache(device);
  reset_peak_memory_stats(device);
  const MemoryStats start = memory_stats(device);
  REQUIRE_MESSAGE(start.reserved.current == start.active.current,
                  device.str() << " holds free blocks beside live ones: a tensor leaked");
  return start;
}

}  // namespace

TEST_CASE("segmented allocator: meta mirroring CUDA moves like a Segmented allocator") {
  FakeBackend::State sys;
  Allocator reference(kCPU, std::make_unique<FakeBackend>(&sys), AllocatorRules::Segmented);
  const MemoryStats expected = run_allocator_sequence(reference);

  CHECK(allocator(kMeta).rules() == AllocatorRules::BestFit);  // the default mirrors the CPU
  CHECK(allocator(kCPU).rules() == AllocatorRules::BestFit);
  const MemoryStats meta_cpu_before = memory_stats(kMeta);
  MemoryStats start, end;
  {
    MetaBackendGuard guard(Backend::cuda);
    CHECK(allocator(kMeta).rules() == AllocatorRules::Segmented);
    start = clean_start(kMeta);
    end = run_tensor_sequence(kMeta);
  }
  CHECK(deltas(start, end) == deltas(MemoryStats{}, expected));
  CHECK(memory_stats(kMeta).num_allocs == meta_cpu_before.num_allocs);  // untouched
  CHECK(memory_stats(kMeta).reserved.current == meta_cpu_before.reserved.current);

  // A storage returns its block to the allocator that gave it, whatever meta mirrors by then.
  std::int64_t live = 0;
  Tensor kept;
  {
    MetaBackendGuard guard(Backend::cuda);
    live = memory_stats(kMeta).allocated.current;
    kept = empty({1000}, {.dtype = DType::u8, .device = kMeta});
    CHECK(memory_stats(kMeta).allocated.current == live + 1024);
  }
  kept = Tensor();  // freed while meta mirrors the CPU
  CHECK(memory_stats(kMeta).allocated.current == meta_cpu_before.allocated.current);
  {
    MetaBackendGuard guard(Backend::cuda);
    CHECK(memory_stats(kMeta).allocated.current == live);
    // A budget is enforced on the mirrored rules too, naming meta.
    empty_cache(kMeta);
    const auto reserved = static_cast<std::size_t>(memory_stats(kMeta).reserved.current);
    set_memory_budget(kMeta, reserved + kSmallSegment);
    Tensor fits = empty({static_cast<std::int64_t>(kSmallSegment)},
                        {.dtype = DType::u8, .device = kMeta});  // a 2 MiB large segment
    check_throws_with([] { empty({1}, {.dtype = DType::u8, .device = kMeta}); },
                      "meta: out of memory under the budget: tried to allocate 512 B (a new "
                      "2.00 MiB segment)");
    clear_memory_budget(kMeta);
    fits = Tensor();
    empty_cache(kMeta);
    CHECK(memory_stats(kMeta).reserved.current == i64(reserved));
  }
}

MB_CUDA_ONLY_TEST_CASE("segmented allocator: cuda:0 and meta mirroring CUDA reach the same peaks") {
  const Device gpu = cuda_device(0);
  CHECK(allocator(gpu).rules() == AllocatorRules::Segmented);
  const MemoryStats gpu_start = clean_start(gpu);
  const MemoryStats gpu_end = run_tensor_sequence(gpu);
  MemoryStats meta_start, meta_end;
  {
    MetaBackendGuard guard(Backend::cuda);
    meta_start = clean_start(kMeta);
    meta_end = run_tensor_sequence(kMeta);
  }
  CHECK(gpu_end.allocated.peak - gpu_start.allocated.current ==
        meta_end.allocated.peak - meta_start.allocated.current);
  CHECK(gpu_end.reserved.peak - gpu_start.reserved.current ==
        meta_end.reserved.peak - meta_start.reserved.current);
  CHECK(deltas(gpu_start, gpu_end) == deltas(meta_start, meta_end));
  empty_cache(gpu);
  CHECK(memory_stats(gpu).reserved.current == gpu_start.reserved.current);
}
