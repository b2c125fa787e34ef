// The memory claims of the design, measured with the allocators' statistics on a 4-layer MLP:
// (a) a step on the meta device predicts the CPU step's peaks exactly; (b) backward releases saved
// activations as it goes; (c) activation checkpointing keeps the gradients, costs nothing at the
// peak when each layer is checkpointed, and lowers the peak when segments of layers are.
#include "core/rng.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

constexpr std::int64_t kBatch = 64;
constexpr std::int64_t kWidth = 256;
constexpr int kLayers = 4;

struct Mlp {
  std::vector<Tensor> weights;  // (kWidth, kWidth) each
  std::vector<Tensor> biases;   // (kWidth,) each
};

// Weights on `device`, drawn from a fixed seed (values matter only on the CPU).
Mlp make_mlp(Device device, std::uint64_t seed = 3) {
  const GeneratorState saved = default_generator().state();
  manual_seed(seed);
  Mlp m;
  for (int i = 0; i < kLayers; ++i) {
    m.weights.push_back(
        (randn({kWidth, kWidth}, {.device = device}) * 0.06).detach().requires_grad_());
    m.biases.push_back((randn({kWidth}, {.device = device}) * 0.1).detach().requires_grad_());
  }
  default_generator().set_state(saved);
  return m;
}

Tensor layer(const Mlp& m, int i, const Tensor& h) {
  return relu(linear(h, m.weights[i], m.biases[i]));
}

enum class Checkpointing { Off, EachLayer, TwoSegments };

// The loss of one forward pass; no intermediate is kept outside the graph.
Tensor forward(const Mlp& m, const Tensor& x, Checkpointing ckpt) {
  Tensor h = x;
  const int span = ckpt == Checkpointing::TwoSegments ? kLayers / 2 : 1;
  for (int first = 0; first < kLayers; first += span) {
    auto segment = [&m, first, span](const Tensor& in) {
      Tensor t = in;
      for (int i = first; i < first + span; ++i) t = layer(m, i, t);
      return t;
    };
    h = ckpt == Checkpointing::Off ? segment(h) : checkpoint(segment, h);
  }
  return sum(h * h);
}

// Peaks of a step, relative to the bytes allocated and reserved when it started.
struct StepPeaks {
  std::int64_t allocated = 0;
  std::int64_t reserved = 0;
};

StepPeaks measure_step(Device device, const Mlp& m, const Tensor& x, Checkpointing ckpt) {
  empty_cache(device);
  reset_peak_memory_stats(device);
  const MemoryStats start = memory_stats(device);
  {
    Tensor loss = forward(m, x, ckpt);
    loss.backward();
  }
  const MemoryStats end = memory_stats(device);
  return {end.allocated.peak - start.allocated.current, end.reserved.peak - start.reserved.current};
}

void clear_grads(const Mlp& m) {
  for (const Tensor& w : m.weights) w.set_grad({});
  for (const Tensor& b : m.biases) b.set_grad({});
}

std::vector<Tensor> grads_of(const Mlp& m) {
  std::vector<Tensor> g;
  for (int i = 0; i < kLayers; ++i) {
    g.push_back(m.weights[i].grad());
    g.push_back(m.biases[i].grad());
  }
  return g;
}

void check_same_grads(const Mlp& m, const std::vector<Tensor>& expected) {
  const std::vector<Tensor> got = grads_of(m);
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    REQUIRE(got[i].defined());
    // The recomputation runs the very same kernels on the very same values.
    CHECK(got[i].to_vector() == expected[i].to_vector());
  }
}

}  // namespace

TEST_CASE("memory: a step on meta has exactly the peaks of the same step on the CPU") {
  const Mlp cpu_mlp = make_mlp(kCPU);
  const Mlp meta_mlp = make_mlp(kMeta);
  const Tensor cpu_x = randn({kBatch, kWidth});
  const Tensor meta_x = empty({kBatch, kWidth}, {.device = kMeta});
  for (Checkpointing ckpt :
       {Checkpointing::Off, Checkpointing::EachLayer, Checkpointing::TwoSegments}) {
    CAPTURE(static_cast<int>(ckpt));
    const StepPeaks cpu = measure_step(kCPU, cpu_mlp, cpu_x, ckpt);
    const StepPeaks meta = measure_step(kMeta, meta_mlp, meta_x, ckpt);
    INFO("peaks cpu " << cpu.allocated << " / " << cpu.reserved << ", meta " << meta.allocated
                      << " / " << meta.reserved);
    CHECK(cpu.allocated > 0);
    CHECK(meta.allocated == cpu.allocated);
    CHECK(meta.reserved == cpu.reserved);
    // The step leaves the same gradients behind on both devices (shape-wise).
    CHECK(meta_mlp.weights[0].grad().shape() == cpu_mlp.weights[0].grad().shape());
    clear_grads(cpu_mlp);
    clear_grads(meta_mlp);
  }
}

TEST_CASE("memory: backward frees saved activations as it goes") {
  const Mlp m = make_mlp(kCPU);
  const Tensor x = randn({kBatch, kWidth});
  auto backward_peak = [&](bool retain) {
    clear_grads(m);
    empty_cache(kCPU);
    Tensor loss = forward(m, x, Checkpointing::Off);
    const std::int64_t before = memory_stats(kCPU).allocated.current;
    reset_peak_memory_stats(kCPU);
    loss.backward(BackwardOptions{.retain_graph = retain});
    const MemoryStats after = memory_stats(kCPU);
    return std::pair{after.allocated.peak - before, after.allocated.current - before};
  };
  const auto [peak_retain, left_retain] = backward_peak(true);
  const auto [peak_release, left_release] = backward_peak(false);
  INFO("backward peak: retain " << peak_retain << ", release " << peak_release << "; left "
                                << left_retain << " vs " << left_release);
  CHECK(peak_release < peak_retain);
  CHECK(left_release < left_retain);
}

// Note [Checkpointing a linear + relu chain]: such a layer saves only its input (for the weight
// gradient) and its output (relu), and its output is the next layer's input; a checkpoint around it
// saves that same input. Checkpointing each layer therefore saves at most the last activation, and
// its worth is that it costs nothing at the peak. Checkpointing segments of several layers keeps
// only the segment inputs, which lowers the peak once activations, not weights, dominate it.
TEST_CASE("memory: checkpointing each layer keeps the gradients and never raises the peak") {
  const Mlp m = make_mlp(kCPU);
  const Tensor x = randn({kBatch, kWidth});
  const StepPeaks plain = measure_step(kCPU, m, x, Checkpointing::Off);
  const std::vector<Tensor> expected = grads_of(m);
  clear_grads(m);
  const StepPeaks ckpt = measure_step(kCPU, m, x, Checkpointing::EachLayer);
  INFO("peak allocated: plain " << plain.allocated << ", checkpointed " << ckpt.allocated);
  // The recomputed outputs and their incoming gradients must die inside the inner backward, as
  // they do without checkpointing; held until it returns, they cost two activations here.
  CHECK(ckpt.allocated <= plain.allocated);
  check_same_grads(m, expected);
}

TEST_CASE("memory: checkpointing segments lowers the peak when activations dominate") {
  // Batch 1024: one activation (1 MiB) outweighs a layer's weights (256 KiB).
  const Mlp m = make_mlp(kCPU);
  const std::int64_t batch = 1024;
  const std::int64_t activation = batch * kWidth * 4;
  const Tensor x = randn({batch, kWidth});
  const StepPeaks plain = measure_step(kCPU, m, x, Checkpointing::Off);
  const std::vector<Tensor> expected = grads_of(m);
  clear_grads(m);
  const StepPeaks ckpt = measure_step(kCPU, m, x, Checkpointing::TwoSegments);
  INFO("peak allocated: plain " << plain.allocated << ", two segments " << ckpt.allocated);
  // Two segments keep x and the second segment's input instead of four relu outputs; the
  // recomputation holds one segment's activations again, so one activation is saved overall.
  CHECK(ckpt.allocated <= plain.allocated - activation);
  check_same_grads(m, expected);
}
