// The boundary step's kernels on CUDA against their CPU references (accumulate, the norm and
// non-finite reduction, the fused AdamW, SGD, the loss-scale update, the whole deferred step), and
// the host bookkeeping of the deferred step, which runs on the CPU too.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <set>

#include "core/ops/dispatch.h"
#include "kernels/device.h"
#include "kernels/elementwise.h"
#include "kernels/loss_scale.h"
#include "kernels/optim.h"
#include "optim/boundary_step.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A matrix that decays and a bias that does not, as in test_mixed_precision.
class Pair : public nn::Module {
 public:
  explicit Pair(std::uint64_t seed = 11) {
    manual_seed(seed);
    w = randn({8, 5});
    b = randn({5});
    register_parameter("w", &w);
    register_parameter("b", &b);
  }
  Tensor w, b;
};

// One training run's optimizer side: the store, AdamW, the schedule, a scaler, the boundary step.
struct Run {
  Run(Device device, std::optional<DType> compute, optim::BoundaryTiming timing, optim::LossScalerConfig scaler_config,
      double max_grad_norm)
      : model(), scaler(scaler_config) {
    model.to(device);
    store.emplace(model, optim::ParamStoreOptions{.compute_dtype = compute});
    adamw.emplace(*store, optim::AdamWConfig{.lr = 1e-2, .weight_decay = 0.1});
    scheduler.emplace(*adamw, optim::ScheduleConfig{.type = optim::ScheduleType::Linear, .warmup_steps = 2,
                                                    .total_steps = 20});
    boundary.emplace(*store, *adamw, *scheduler, &scaler,
                     optim::BoundaryStepConfig{.max_grad_norm = max_grad_norm, .timing = timing});
  }
  Pair model;
  optim::DynamicLossScaler scaler;
  std::optional<optim::ParamStore> store;
  std::optional<optim::AdamW> adamw;
  std::optional<optim::LRScheduler> scheduler;
  std::optional<optim::BoundaryStep> boundary;
};

// Scaled gradients for window k (1-based): finite except where `poisoned` says.
Tensor window_grads(std::int64_t numel, std::int64_t k, bool poisoned, double scale) {
  manual_seed(100 + static_cast<std::uint64_t>(k));
  std::vector<double> g = (randn({numel}) * scale).to_vector();
  if (poisoned) g[static_cast<std::size_t>(numel - 2)] = kInf;  // in the bias: "b" is the first bad parameter
  return from_vector(g, {numel});
}

void check_same_outcome(const optim::StepOutcome& a, const optim::StepOutcome& b, double rtol) {
  CHECK(a.step == b.step);
  CHECK(a.skipped == b.skipped);
  CHECK(a.lr == b.lr);
  CHECK(a.loss_scale == b.loss_scale);
  CHECK(a.first_non_finite == b.first_non_finite);
  CHECK(a.floor_error == b.floor_error);
  if (std::isfinite(a.grad_norm)) {
    CHECK(std::abs(a.grad_norm - b.grad_norm) <= rtol * std::abs(a.grad_norm));
  } else {
    CHECK(!std::isfinite(b.grad_norm));
  }
}

std::vector<std::uint8_t> bytes_of(const Tensor& t) {
  Tensor c = t.device().is_cpu() ? t.contiguous() : t.to(kCPU);
  std::vector<std::uint8_t> out(c.nbytes());
  std::memcpy(out.data(), c.raw_data(), out.size());
  return out;
}

// A zeroed GradStatsBuffer on `device`, and its result read back (waiting for the stream).
Tensor stats_buffer(Device device) {
  return zeros({static_cast<std::int64_t>(sizeof(kernels::GradStatsBuffer))}, {.dtype = DType::u8, .device = device});
}
kernels::GradStatsBuffer* stats_of(const Tensor& buffer) {
  return static_cast<kernels::GradStatsBuffer*>(buffer.raw_data());
}
kernels::GradStats read_stats(const Tensor& buffer) {
  kernels::GradStats s;
  kernels::cuda::memcpy_device_to_host(&s, buffer.raw_data(), sizeof s, buffer.device().index);
  return s;
}

// The trainer's CPU formula for the factor of a step (train/trainer.cpp before the device path).
double trainer_grad_scale(double sum_sq, double scale, double max_grad_norm) {
  const double inv_scale = static_cast<double>(static_cast<float>(1.0 / scale));
  const double norm = std::sqrt(sum_sq) * inv_scale;
  const double clip = max_grad_norm > 0 ? std::min(1.0, max_grad_norm / (norm + 1e-6)) : 1.0;
  return inv_scale * clip;
}

}  // namespace

// ---- host logic (runs everywhere) ----------------------------------------------------------------

TEST_CASE("gated_grad_scale is the trainer's unscale and clip factor") {
  for (double sum_sq : {0.0, 1e-3, 2.5, 1e6, 3e12}) {
    for (float scale : {1.0f, 3.0f, 1024.0f, 65536.0f}) {
      for (double max_norm : {0.0, 0.5, 1.0, 1e9}) {
        const double got = kernels::gated_grad_scale(sum_sq, &scale, max_norm);
        CHECK(got == doctest::Approx(trainer_grad_scale(sum_sq, scale, max_norm)).epsilon(1e-15));
      }
    }
    CHECK(kernels::gated_grad_scale(sum_sq, nullptr, 0.0) == 1.0);
  }
}

TEST_CASE("pack_split covers every element once and aligns every pack of every array") {
  // A pack of an array is pack * element size bytes, aligned to that size up to 16 (a 64-bit or
  // 128-bit access): f32 += bf16 in packs of 4 reads 16-byte f32 packs and 8-byte bf16 packs.
  struct Case {
    std::size_t first, other;
    std::int64_t pack;
  };
  const Case cases[] = {{4, 4, 4}, {4, 2, 8}, {8, 4, 4}, {2, 2, 8}, {8, 2, 8},
                        {4, 2, 4}, {2, 4, 4}, {8, 4, 2}};
  for (const Case c : cases) {
    const std::uintptr_t first_align = std::min<std::uintptr_t>(16, c.pack * c.first);
    const std::uintptr_t other_align = std::min<std::uintptr_t>(16, c.pack * c.other);
    for (std::int64_t n : {0, 1, 2, 7, 8, 9, 31, 33, 100}) {
      for (std::uintptr_t first_offset = 0; first_offset < 16; first_offset += c.first) {
        for (std::uintptr_t other_offset = 0; other_offset < 16; other_offset += c.other) {
          const kernels::ArrayAddress first{4096 + first_offset, c.first};
          const kernels::ArrayAddress other{8192 + other_offset, c.other};
          const kernels::PackSplit split = kernels::pack_split(n, c.pack, first, {other});
          std::vector<int> seen(static_cast<std::size_t>(n), 0);
          for (std::int64_t p = 0; p < split.packs(); ++p) {
            const std::int64_t start = split.pack_start(p);
            REQUIRE(start + c.pack <= n);
            CHECK((first.address + static_cast<std::uintptr_t>(start) * c.first) % first_align == 0);
            CHECK((other.address + static_cast<std::uintptr_t>(start) * c.other) % other_align == 0);
            for (std::int64_t e = 0; e < c.pack; ++e) ++seen[static_cast<std::size_t>(start + e)];
          }
          for (std::int64_t j = 0; j < split.scalar_count(); ++j) {
            const std::int64_t i = split.scalar_index(j);
            REQUIRE((i >= 0 && i < n));
            ++seen[static_cast<std::size_t>(i)];
          }
          CHECK(std::all_of(seen.begin(), seen.end(), [](int k) { return k == 1; }));
          CHECK((split.head < c.pack || split.head == n));
          // Arrays that one head can align both get packs once n leaves room for one: the head
          // that aligns the first array, and the other array aligned after it.
          const std::uintptr_t head = (first_align - first_offset % first_align) % first_align / c.first;
          const bool shareable = (other_offset + head * c.other) % other_align == 0;
          if (shareable && n >= static_cast<std::int64_t>(head) + c.pack) CHECK(split.packs() > 0);
          if (!shareable) CHECK(split.head == n);
        }
      }
    }
  }
  // Without other arrays, and with an absent one (address 0), only the first decides.
  CHECK(kernels::pack_split(100, 4, {4100, 4}).head == 3);
  CHECK(kernels::pack_split(100, 4, {4100, 4}, {{0, 2}}).head == 3);
  CHECK(kernels::pack_split(100, 4, {4102, 4}).head == 100);  // not even element-aligned
  // f32 += bf16: a bf16 array 8 bytes off a 16-byte boundary still takes packs (of 8 bytes).
  CHECK(kernels::pack_split(100, 4, {4096, 4}, {{8200, 2}}).head == 0);
  CHECK(kernels::pack_split(100, 4, {4096, 4}, {{8196, 2}}).head == 100);
}

TEST_CASE("the loss-scale rule on a bare state walks with DynamicLossScaler") {
  const optim::LossScalerConfig config{.init_scale = 16.0, .growth_interval = 3, .hysteresis = 2, .min_loss_scale = 1.0};
  optim::DynamicLossScaler scaler(config);
  kernels::LossScaleState state = scaler.state();
  const std::string pattern = "..x..xx...xxxxxxxxxx....x.x..x";  // x: an overflowing window
  for (char c : pattern) {
    const bool found_inf = c == 'x';
    scaler.update(found_inf);
    kernels::apply_loss_scale_update(state, found_inf, scaler.rule());
    CHECK(state.scale == scaler.state().scale);
    CHECK(state.growth_tracker == scaler.growth_tracker());
    CHECK(state.hysteresis_overflows == scaler.hysteresis_overflows());
    CHECK(state.overflows_at_floor == scaler.state().overflows_at_floor);
  }
  CHECK(scaler.scale() >= 1.0);
}

TEST_CASE("ParamStore::entry_at maps arena elements to their parameters") {
  Pair m;
  optim::ParamStore store(m);
  CHECK(store.entry_at(0).name == "w");
  CHECK(store.entry_at(39).name == "w");
  CHECK(store.entry_at(40).name == "b");
  CHECK(store.entry_at(44).name == "b");
  check_throws_with([&] { store.entry_at(45); }, "outside the arena");
}

TEST_CASE("deferred boundary step on the CPU: the immediate step's weights and counts, outcomes one boundary late") {
  const optim::LossScalerConfig scaler_config{.init_scale = 1024.0, .growth_interval = 3, .hysteresis = 2,
                                              .min_loss_scale = 1.0};
  Run now(kCPU, DType::f16, optim::BoundaryTiming::Immediate, scaler_config, 0.0);
  Run later(kCPU, DType::f16, optim::BoundaryTiming::Deferred, scaler_config, 0.0);
  CHECK(!now.boundary->deferred());
  CHECK(later.boundary->deferred());
  const std::set<std::int64_t> poisoned{3, 4, 7};
  std::vector<optim::StepOutcome> expected;
  std::int64_t taken = 0;
  for (std::int64_t k = 1; k <= 10; ++k) {
    const Tensor g = window_grads(now.store->numel(), k, poisoned.count(k) > 0, 1024.0);
    Tensor(now.store->grads()).copy_(g);
    Tensor(later.store->grads()).copy_(g);
    std::vector<optim::StepOutcome> a = now.boundary->step(k, optim::Settle::Later);
    REQUIRE(a.size() == 1);
    expected.push_back(a[0]);
    std::vector<optim::StepOutcome> b = later.boundary->step(k, optim::Settle::Later);
    // The deferred step reports the previous window, and its host counters lag by that window.
    REQUIRE(b.size() == (k == 1 ? 0u : 1u));
    if (k > 1) check_same_outcome(expected[k - 2], b[0], 0.0);
    CHECK(later.adamw->step_count() == taken);
    if (!a[0].skipped) ++taken;
    CHECK(now.adamw->step_count() == taken);
    // The arenas moved identically, bit for bit (no clipping here: the factor is inv_scale itself).
    CHECK(bytes_of(later.store->master()) == bytes_of(now.store->master()));
    CHECK(bytes_of(later.store->weights()) == bytes_of(now.store->weights()));
    now.store->zero_grad();
    later.store->zero_grad();
  }
  std::vector<optim::StepOutcome> last = later.boundary->settle();
  REQUIRE(last.size() == 1);
  check_same_outcome(expected.back(), last[0], 0.0);
  CHECK(later.boundary->settle().empty());
  CHECK(expected[2].skipped);
  CHECK(expected[2].first_non_finite == "b");
  CHECK(later.adamw->step_count() == now.adamw->step_count());
  CHECK(later.adamw->step_count() == 7);
  CHECK(later.scheduler->steps() == now.scheduler->steps());
  CHECK(later.adamw->lr() == now.adamw->lr());
  CHECK(later.scaler.state_dict() == now.scaler.state_dict());
  for (const char* name : {"exp_avg", "exp_avg_sq"}) {
    CHECK(bytes_of(later.adamw->state_dict().at(name)) == bytes_of(now.adamw->state_dict().at(name)));
  }
}

TEST_CASE("deferred boundary step on the CPU: Settle::Now reports the window at once; clipping agrees") {
  const optim::LossScalerConfig scaler_config{.init_scale = 256.0, .growth_interval = 2};
  Run now(kCPU, std::nullopt, optim::BoundaryTiming::Immediate, scaler_config, 0.5);
  Run later(kCPU, std::nullopt, optim::BoundaryTiming::Deferred, scaler_config, 0.5);
  for (std::int64_t k = 1; k <= 6; ++k) {
    const Tensor g = window_grads(now.store->numel(), k, k == 2, 256.0);
    Tensor(now.store->grads()).copy_(g);
    Tensor(later.store->grads()).copy_(g);
    const auto a = now.boundary->step(k, optim::Settle::Now);
    const auto b = later.boundary->step(k, optim::Settle::Now);
    REQUIRE(a.size() == 1);
    REQUIRE(b.size() == 1);
    check_same_outcome(a[0], b[0], 1e-15);
    CHECK(later.adamw->step_count() == now.adamw->step_count());
    check_close(later.store->master(), now.store->master(), 1e-6, 1e-7, "clipped master weights");
    now.store->zero_grad();
    later.store->zero_grad();
  }
  CHECK(later.scaler.state_dict() == now.scaler.state_dict());
}

TEST_CASE("deferred boundary step: the seed is the scale the device holds, ahead of the host's copy") {
  const optim::LossScalerConfig scaler_config{.init_scale = 64.0};
  Run later(kCPU, std::nullopt, optim::BoundaryTiming::Deferred, scaler_config, 0.0);
  Run now(kCPU, std::nullopt, optim::BoundaryTiming::Immediate, scaler_config, 0.0);
  const Tensor loss = scalar_tensor(2.5);
  CHECK(later.boundary->backward_seed(loss).item() == 64.0);
  CHECK(now.boundary->backward_seed(loss).item() == 64.0);
  CHECK(later.boundary->backward_seed(loss).shape() == loss.shape());
  Tensor(later.store->grads()).copy_(window_grads(later.store->numel(), 1, true, 64.0));
  CHECK(later.boundary->step(1, optim::Settle::Later).empty());
  CHECK(later.boundary->backward_seed(loss).item() == 32.0);  // backed off where the kernels read it
  CHECK(later.scaler.scale() == 64.0);                        // the host learns it at the next read
  CHECK(later.boundary->settle()[0].skipped);
  CHECK(later.scaler.scale() == 32.0);
  Run plain(kCPU, std::nullopt, optim::BoundaryTiming::Deferred, scaler_config, 0.0);
  optim::BoundaryStep no_scaler(*plain.store, *plain.adamw, *plain.scheduler, nullptr,
                                {.timing = optim::BoundaryTiming::Deferred});
  CHECK(!no_scaler.backward_seed(loss).defined());
}

TEST_CASE("deferred boundary step: at the loss-scale floor it reports the error and queues nothing more") {
  const optim::LossScalerConfig scaler_config{.init_scale = 4.0, .min_loss_scale = 1.0, .max_overflows_at_floor = 2};
  Run now(kCPU, std::nullopt, optim::BoundaryTiming::Immediate, scaler_config, 0.0);
  Run later(kCPU, std::nullopt, optim::BoundaryTiming::Deferred, scaler_config, 0.0);
  const Tensor w0 = later.store->master().clone();
  std::int64_t floor_at_now = 0, floor_at_later = 0;
  for (std::int64_t k = 1; k <= 10 && floor_at_later == 0; ++k) {
    const Tensor g = window_grads(now.store->numel(), k, true, 4.0);
    if (floor_at_now == 0) {
      Tensor(now.store->grads()).copy_(g);
      const auto a = now.boundary->step(k, optim::Settle::Later);
      if (!a[0].floor_error.empty()) floor_at_now = k;
    }
    Tensor(later.store->grads()).copy_(g);
    const auto b = later.boundary->step(k, optim::Settle::Later);
    if (!b.empty() && !b.back().floor_error.empty()) {
      floor_at_later = b.back().step;
      CHECK(b.back().skipped);
      CHECK(b.back().floor_error.find("loss-scale floor") != std::string::npos);
      CHECK(later.boundary->settle().empty());  // window k was not queued
    }
  }
  CHECK(floor_at_now == 4);  // 4 -> 2 -> 1, then two overflows at the floor
  CHECK(floor_at_later == floor_at_now);
  CHECK(bytes_of(later.store->master()) == bytes_of(w0));
  CHECK(later.adamw->step_count() == 0);
  CHECK(later.scheduler->steps() == 0);
}

TEST_CASE("deferred buffers: the same blocks on meta as on the CPU; an f32 seed is a view") {
  // The planner holds them on meta mirroring a GPU (Note [What the Trainer holds beside the arenas]
  // in train/planner.cpp); meta mirroring the CPU and the CPU itself allocate the same requests.
  const kernels::LossScaleState state{.scale = 512.0f};
  struct Place {
    Device device;
    Backend mirror;
    const char* name;
  };
  const std::size_t stats_block = (sizeof(kernels::GradStatsBuffer) + 511) / 512 * 512;
  for (const bool scaled : {false, true}) {
    for (const Place& at : {Place{kCPU, Backend::cpu, "cpu"},
                            Place{kMeta, Backend::cpu, "meta as the CPU"},
                            Place{kMeta, Backend::cuda, "meta as a GPU"}}) {
      INFO((scaled ? "with a loss scale, " : "without one, ") << std::string(at.name));
      MetaBackendGuard mirror(at.mirror);
      empty_cache(at.device);
      const std::int64_t before = memory_stats(at.device).allocated.current;
      const optim::DeferredBuffers buffers(at.device, scaled ? &state : nullptr);
      CHECK(memory_stats(at.device).allocated.current - before ==
            static_cast<std::int64_t>(stats_block + (scaled ? 512 : 0)));
      CHECK(buffers.stats.numel() == static_cast<std::int64_t>(sizeof(kernels::GradStatsBuffer)));
      CHECK(buffers.scale_state.defined() == scaled);
      const Tensor loss = scalar_tensor(2.5, {.device = at.device});
      const std::int64_t seeded = memory_stats(at.device).allocated.current;
      const Tensor seed = buffers.seed(loss);
      CHECK(seed.defined() == scaled);
      CHECK(memory_stats(at.device).allocated.current == seeded);  // a view
      if (!scaled) continue;
      CHECK(seed.shape() == loss.shape());
      CHECK(seed.storage() == buffers.scale_state.storage());
      if (at.device.is_cpu()) CHECK(seed.item() == 512.0);
      // A 16-bit loss gets the scale converted to its dtype (a tensor of its own).
      const Tensor half_seed = buffers.seed(loss.to(DType::bf16));
      CHECK(half_seed.dtype() == DType::bf16);
      CHECK(half_seed.storage() != buffers.scale_state.storage());
      if (at.device.is_cpu()) CHECK(half_seed.item() == 512.0);
    }
  }
}

// ---- CUDA kernels against the CPU ------------------------------------------------------------------

MB_CUDA_TEST_CASE("cuda accumulate: vector and strided paths, 16-bit sources, misaligned offsets, odd sizes") {
  const Device gpu = test_gpu();
  struct Case {
    DType dst, src;
    double rtol;
  };
  const Case cases[] = {{DType::f32, DType::f32, 1e-6}, {DType::f32, DType::f16, 1e-6}, {DType::f32, DType::bf16, 1e-6},
                        {DType::f64, DType::f32, 1e-12}, {DType::bf16, DType::f32, 1e-2}, {DType::f16, DType::f16, 2e-3}};
  for (const Case& c : cases) {
    for (std::int64_t n : {1, 31, 33, 1000003}) {
      for (std::int64_t dst_offset : {0, 1, 3}) {
        for (std::int64_t src_offset : {0, 1, 2}) {
          if (n == 1000003 && dst_offset + src_offset > 1 && c.dst != DType::f32) continue;  // keep it quick
          for (double w : {1.0, 0.37}) {
            if (n == 1000003 && w == 1.0) continue;
            CAPTURE(dtype_name(c.dst));
            CAPTURE(dtype_name(c.src));
            CAPTURE(n);
            CAPTURE(dst_offset);
            CAPTURE(src_offset);
            CAPTURE(w);
            manual_seed(static_cast<std::uint64_t>(n + dst_offset * 7 + src_offset));
            const Tensor dst_base = randn({n + 3}).to(c.dst);
            const Tensor src_base = randn({n + 3}).to(c.src);
            Tensor expected = dst_base.slice(0, dst_offset, dst_offset + n).clone();
            accumulate_(expected, src_base.slice(0, src_offset, src_offset + n), w);
            const Tensor dst_gpu = dst_base.to(gpu);
            Tensor dst_view = dst_gpu.slice(0, dst_offset, dst_offset + n);
            accumulate_(dst_view, src_base.to(gpu).slice(0, src_offset, src_offset + n), w);
            const Tensor got = dst_gpu.to(kCPU).slice(0, dst_offset, dst_offset + n);
            check_close(got, expected, c.rtol, c.rtol * 1e-2, "accumulate");
            // Outside the view nothing moved.
            if (dst_offset > 0) CHECK(dst_gpu.to(kCPU).slice(0, 0, 1).item() == dst_base.slice(0, 0, 1).item());
          }
        }
      }
    }
  }
  // The strided path: transposed views on both sides.
  for (DType src_dtype : {DType::f32, DType::f16, DType::bf16}) {
    manual_seed(3);
    const Tensor dst_base = randn({33, 65});
    const Tensor src_base = randn({33, 65}).to(src_dtype);
    Tensor expected = dst_base.clone();
    Tensor expected_t = expected.t();
    accumulate_(expected_t, src_base.t(), 0.5);
    const Tensor dst_gpu = dst_base.to(gpu);
    Tensor dst_t = dst_gpu.t();
    accumulate_(dst_t, src_base.to(gpu).t(), 0.5);
    check_close(dst_gpu.to(kCPU), expected, 1e-6, 1e-7, "strided accumulate");
  }
}

MB_CUDA_ONLY_TEST_CASE("cuda accumulate with statistics: the updated values' sum of squares and first non-finite") {
  const Device gpu = cuda_device(0);
  kernels::cuda::set_device(0);
  for (std::int64_t n : {1, 33, 1000003}) {
    for (bool poison : {false, true}) {
      manual_seed(9);
      const Tensor dst = randn({n});
      std::vector<double> s = randn({n}).to_vector();
      const std::int64_t bad = n / 2;
      if (poison) s[static_cast<std::size_t>(bad)] = kNaN;
      const Tensor src = from_vector(s, {n}).to(DType::f16);
      Tensor expected = dst.clone();
      accumulate_(expected, src, 0.25);
      const kernels::cpu::NormResult ref = kernels::cpu::sum_squares(expected.kview());
      const Tensor dst_gpu = dst.to(gpu);
      const Tensor buffer = stats_buffer(gpu);
      kernels::cuda::accumulate(dst_gpu.kview(), src.to(gpu).kview(), 0.25, stats_of(buffer));
      const kernels::GradStats got = read_stats(buffer);
      CHECK((got.non_finite != 0) == poison);
      CHECK(got.first_non_finite == (poison ? bad : -1));
      if (!poison) CHECK(got.sum_sq == doctest::Approx(ref.sum_sq).epsilon(1e-6));
      check_close(dst_gpu, expected, 1e-6, 1e-7, "accumulated values");
    }
  }
}

MB_CUDA_ONLY_TEST_CASE("cuda sum_squares: CPU's value, an inf and a NaN found, the first one named, bitwise repeatable") {
  const Device gpu = cuda_device(0);
  kernels::cuda::set_device(0);
  for (DType dtype : {DType::f32, DType::f16, DType::bf16, DType::f64}) {
    for (std::int64_t n : {1, 31, 33, 1000003}) {
      for (std::int64_t offset : {0, 1}) {
        CAPTURE(dtype_name(dtype));
        CAPTURE(n);
        CAPTURE(offset);
        manual_seed(21);
        std::vector<double> v = randn({n + 1}).to_vector();
        const Tensor clean = from_vector(v, {n + 1}).to(dtype).slice(0, offset, offset + n);
        const Tensor clean_gpu = from_vector(v, {n + 1}).to(gpu, dtype).slice(0, offset, offset + n);
        const kernels::cpu::NormResult ref = kernels::cpu::sum_squares(clean.contiguous().kview());
        const Tensor buffer = stats_buffer(gpu);
        kernels::cuda::sum_squares(clean_gpu.kview(), stats_of(buffer));
        const kernels::GradStats first = read_stats(buffer);
        CHECK(first.non_finite == 0);
        CHECK(first.first_non_finite == -1);
        CHECK(first.sum_sq == doctest::Approx(ref.sum_sq).epsilon(1e-12));
        kernels::cuda::sum_squares(clean_gpu.kview(), stats_of(buffer));
        const kernels::GradStats second = read_stats(buffer);
        CHECK(std::memcmp(&first.sum_sq, &second.sum_sq, sizeof(double)) == 0);  // deterministic
        if (n < 33) continue;
        v[static_cast<std::size_t>(offset + n - 5)] = kNaN;  // a NaN late, an inf earlier: the inf is first
        v[static_cast<std::size_t>(offset + n / 3)] = kInf;
        const Tensor bad_gpu = from_vector(v, {n + 1}).to(gpu, dtype).slice(0, offset, offset + n);
        kernels::cuda::sum_squares(bad_gpu.kview(), stats_of(buffer));
        const kernels::GradStats bad = read_stats(buffer);
        CHECK(bad.non_finite == 1);
        CHECK(bad.first_non_finite == n / 3);
      }
    }
  }
}

MB_CUDA_ONLY_TEST_CASE("cuda adamw: the fused gated pass equals cpu::adamw over 5 steps, one skipped") {
  const Device gpu = cuda_device(0);
  kernels::cuda::set_device(0);
  for (DType work_dtype : {DType::f16, DType::bf16, DType::f32}) {
    for (std::int64_t offset : {0, 1}) {
      CAPTURE(dtype_name(work_dtype));
      CAPTURE(offset);
      const std::int64_t n = 1000003;
      auto view = [&](const Tensor& t) { return t.slice(0, offset, offset + n); };
      manual_seed(31);
      Tensor p_cpu = randn({n + 1});
      Tensor m_cpu = zeros({n + 1}), v_cpu = zeros({n + 1});
      Tensor w_cpu = zeros({n + 1}, {.dtype = work_dtype});
      Tensor p_gpu = p_cpu.to(gpu), m_gpu = m_cpu.to(gpu), v_gpu = v_cpu.to(gpu), w_gpu = w_cpu.to(gpu);
      const Tensor scale_gpu = scalar_tensor(1024.0).to(gpu);
      const float scale = 1024.0f;
      const Tensor buffer = stats_buffer(gpu);
      const double max_norm = 300.0;
      std::int64_t t = 0;
      for (int step = 1; step <= 5; ++step) {
        manual_seed(40 + step);
        std::vector<double> g = (randn({n + 1}) * 1024.0).to_vector();
        const bool skip = step == 3;
        if (skip) g[static_cast<std::size_t>(offset + 12345)] = kInf;
        const Tensor g_cpu = from_vector(g, {n + 1});
        const Tensor g_gpu = g_cpu.to(gpu);
        kernels::AdamWArgs args{.lr = 1e-3, .weight_decay = 0.1, .step = t + 1, .decay_end = n / 2};
        const auto before = bytes_of(p_gpu);
        kernels::cuda::sum_squares(view(g_gpu).kview(), stats_of(buffer));
        kernels::cuda::adamw(view(p_gpu).kview(), view(g_gpu).kview(), view(m_gpu).kview(), view(v_gpu).kview(), args,
                             view(w_gpu).kview(),
                             {.stats = &stats_of(buffer)->result,
                              .loss_scale = static_cast<const float*>(scale_gpu.raw_data()),
                              .max_grad_norm = max_norm});
        const kernels::cpu::NormResult r = kernels::cpu::sum_squares(view(g_cpu).contiguous().kview());
        CHECK(r.non_finite == skip);
        if (skip) {
          CHECK(bytes_of(p_gpu) == before);
          continue;
        }
        ++t;
        args.grad_scale = trainer_grad_scale(r.sum_sq, scale, max_norm);
        kernels::cpu::adamw(view(p_cpu).kview(), view(g_cpu).kview(), view(m_cpu).kview(), view(v_cpu).kview(), args,
                            view(w_cpu).kview());
      }
      check_close(p_gpu, p_cpu, 1e-5, 1e-7, "master");
      check_close(m_gpu, m_cpu, 1e-5, 1e-7, "exp_avg");
      check_close(v_gpu, v_cpu, 1e-5, 1e-9, "exp_avg_sq");
      check_close(w_gpu, w_cpu, work_dtype == DType::f32 ? 1e-5 : 1e-2, 1e-6, "working copy");
    }
  }
}

MB_CUDA_ONLY_TEST_CASE("cuda sgd and scale follow the CPU") {
  const Device gpu = cuda_device(0);
  kernels::cuda::set_device(0);
  const std::int64_t n = 1001;
  manual_seed(51);
  Tensor p_cpu = randn({n}), buf_cpu = zeros({n});
  Tensor p_gpu = p_cpu.to(gpu), buf_gpu = buf_cpu.to(gpu);
  for (int step = 0; step < 3; ++step) {
    const Tensor g = randn({n});
    const kernels::SGDArgs args{.lr = 0.1, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01,
                                .first_step = step == 0, .grad_scale = 0.5, .decay_end = 600};
    kernels::cpu::sgd(p_cpu.kview(), g.kview(), buf_cpu.kview(), args);
    kernels::cuda::sgd(p_gpu.kview(), g.to(gpu).kview(), buf_gpu.kview(), args);
  }
  check_close(p_gpu, p_cpu, 1e-5, 1e-7, "sgd params");
  check_close(buf_gpu, buf_cpu, 1e-5, 1e-7, "sgd momentum");
  kernels::cpu::scale(p_cpu.kview(), 0.3);
  kernels::cuda::scale(p_gpu.kview(), 0.3);
  check_close(p_gpu, p_cpu, 1e-5, 1e-7, "scale");
}

MB_CUDA_ONLY_TEST_CASE("cuda loss-scale update walks with DynamicLossScaler over a scripted overflow pattern") {
  const Device gpu = cuda_device(0);
  kernels::cuda::set_device(0);
  const optim::LossScalerConfig config{.init_scale = 16.0, .growth_interval = 3, .hysteresis = 2, .min_loss_scale = 1.0};
  optim::DynamicLossScaler scaler(config);
  const kernels::LossScaleState initial = scaler.state();
  Tensor state = empty({static_cast<std::int64_t>(sizeof initial)}, {.dtype = DType::u8, .device = gpu});
  kernels::cuda::memcpy_host_to_device(state.raw_data(), &initial, sizeof initial, 0);
  auto* device_state = static_cast<kernels::LossScaleState*>(state.raw_data());
  const Tensor buffer = stats_buffer(gpu);
  const Tensor finite = from_vector({1.0, 2.0}, {2}).to(gpu);
  const Tensor overflow = from_vector({1.0, kInf}, {2}).to(gpu);
  const std::string pattern = "..x..xx...xxxxxxxxxx....x.x..x......";
  for (char c : pattern) {
    const bool found_inf = c == 'x';
    kernels::cuda::sum_squares((found_inf ? overflow : finite).kview(), stats_of(buffer));
    kernels::cuda::update_loss_scale(device_state, &stats_of(buffer)->result, scaler.rule());
    scaler.update(found_inf);
    kernels::LossScaleState got;
    kernels::cuda::memcpy_device_to_host(&got, state.raw_data(), sizeof got, 0);
    CHECK(got.scale == scaler.state().scale);
    CHECK(got.growth_tracker == scaler.growth_tracker());
    CHECK(got.hysteresis_overflows == scaler.hysteresis_overflows());
    CHECK(got.overflows_at_floor == scaler.state().overflows_at_floor);
  }
}

MB_CUDA_TEST_CASE("cuda ParamStore: grad_norm, first_non_finite and clip_grad_norm_ as on the CPU") {
  Pair on_cpu, on_gpu;
  on_gpu.to(test_gpu());
  optim::ParamStore a(on_cpu), b(on_gpu);
  const Tensor g = window_grads(a.numel(), 1, false, 3.0);
  Tensor(a.grads()).copy_(g);
  Tensor(b.grads()).copy_(g);
  CHECK(b.grad_norm().norm == doctest::Approx(a.grad_norm().norm).epsilon(1e-12));
  CHECK(b.first_non_finite().empty());
  CHECK(optim::clip_grad_norm_(b, 1.0) == doctest::Approx(optim::clip_grad_norm_(a, 1.0)).epsilon(1e-12));
  check_close(b.grads(), a.grads(), 1e-6, 1e-7, "clipped gradients");
  Tensor(b.grads()).copy_(window_grads(a.numel(), 1, true, 3.0));
  CHECK(b.grad_norm().non_finite);
  CHECK(b.first_non_finite() == "b");
}

MB_CUDA_TEST_CASE("cuda boundary step on a small model equals the CPU's within 1e-5") {
  const optim::LossScalerConfig scaler_config{.init_scale = 1024.0, .growth_interval = 3, .hysteresis = 2,
                                              .min_loss_scale = 1.0};
  for (std::optional<DType> compute : {std::optional<DType>(), std::optional<DType>(DType::f16)}) {
    CAPTURE(compute.has_value());
    Run cpu_run(kCPU, compute, optim::BoundaryTiming::Auto, scaler_config, 2.0);
    // Auto defers on CUDA; a rehearsal on the CPU asks for the deferred step it stands in for.
    const optim::BoundaryTiming timing =
        test_gpu().is_cuda() ? optim::BoundaryTiming::Auto : optim::BoundaryTiming::Deferred;
    Run gpu_run(test_gpu(), compute, timing, scaler_config, 2.0);
    CHECK(!cpu_run.boundary->deferred());
    CHECK(gpu_run.boundary->deferred());
    const Tensor loss = scalar_tensor(1.0).to(test_gpu());
    const Tensor seed = gpu_run.boundary->backward_seed(loss);
    CHECK(seed.device() == test_gpu());
    CHECK(seed.item() == 1024.0);
    std::vector<optim::StepOutcome> expected, got;
    for (std::int64_t k = 1; k <= 8; ++k) {
      const Tensor g = window_grads(cpu_run.store->numel(), k, k == 3 || k == 4, 1024.0);
      Tensor(cpu_run.store->grads()).copy_(g);
      Tensor(gpu_run.store->grads()).copy_(g);
      for (auto& o : cpu_run.boundary->step(k, optim::Settle::Later)) expected.push_back(o);
      for (auto& o : gpu_run.boundary->step(k, k % 3 == 0 ? optim::Settle::Now : optim::Settle::Later))
        got.push_back(o);
      cpu_run.store->zero_grad();
      gpu_run.store->zero_grad();
    }
    for (auto& o : gpu_run.boundary->settle()) got.push_back(o);
    REQUIRE(got.size() == expected.size());
    for (std::size_t i = 0; i < got.size(); ++i) check_same_outcome(expected[i], got[i], 1e-9);
    CHECK(gpu_run.adamw->step_count() == cpu_run.adamw->step_count());
    CHECK(gpu_run.scheduler->steps() == cpu_run.scheduler->steps());
    CHECK(gpu_run.scaler.state_dict() == cpu_run.scaler.state_dict());
    check_close(gpu_run.store->master(), cpu_run.store->master(), 1e-5, 1e-5, "master weights");
    check_close(gpu_run.store->weights(), cpu_run.store->weights(), compute ? 1e-3 : 1e-5, 1e-5, "working weights");
    check_close(gpu_run.adamw->state_dict().at("exp_avg"), cpu_run.adamw->state_dict().at("exp_avg"), 1e-5, 1e-5,
                "exp_avg");
  }
}
