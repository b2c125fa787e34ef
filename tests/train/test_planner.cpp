// The MemoryPlanner against real CPU runs: for an MLP, a CNN and a GPT, each under budgets where
// the full batch fits, where it does not, and where only checkpointing fits, the plan is run for
// real on the CPU under the budget, and its measured peak is compared with the prediction; the
// micro-batch is checked to be maximal, by the planner's prediction and by a real run one sample
// larger.
//
// The budgets are placed with the planner's own predictions, only to land in each regime; every
// claim is then checked against the CPU allocator's statistics. All tests share the process-wide
// CPU allocator: each real run restores its budget and empties its cache when it ends.
#include <algorithm>
#include <bit>
#include <cmath>
#include <optional>

#include "core/allocator.h"
#include "core/rng.h"
#include "tests/core/harness.h"
#include "train/planner.h"

using namespace microbatch;
using namespace microbatch::train;

namespace {

struct Case {
  const char* name;
  ModelFactory make;
  SampleBatchFn sample;
  std::int64_t effective;  // chosen so that most micro-batch sizes leave a smaller last one
};

template <class M>
std::unique_ptr<nn::Model> own(std::unique_ptr<M> m) {
  return std::unique_ptr<nn::Model>(std::move(m));
}

// MLP 64 -> 8 x 128 -> 10: its checkpointing (sqrt segments) lowers the peak once a few samples
// are in flight, and its weights dominate small micro-batches.
Case mlp_case() {
  return {"mlp",
          [](bool ckpt) {
            auto m = std::make_unique<nn::MLP>(
                nn::MLPConfig{.in_features = 64, .hidden = std::vector<std::int64_t>(8, 128)});
            m->set_gradient_checkpointing(ckpt);
            return own(std::move(m));
          },
          [](std::int64_t n) {
            return Batch{randn({n, 64}), zeros({n}, {.dtype = DType::i64}), n, {}};
          },
          100};
}

// CNN 1 -> 8 -> 16 channels on 28 x 28: checkpointed as one segment per conv block (conv, relu,
// pool), which is what lowers its peak.
Case cnn_case() {
  return {"cnn",
          [](bool ckpt) {
            auto m = std::make_unique<nn::CNN>(
                nn::CNNConfig{.channels1 = 8, .channels2 = 16, .hidden = 32});
            if (ckpt) m->net->set_checkpoint_segments(4);
            return own(std::move(m));
          },
          [](std::int64_t n) {
            return Batch{randn({n, 28, 28}), zeros({n}, {.dtype = DType::i64}), n, {}};
          },
          20};
}

// A 4-layer GPT on 64-token sequences: activations dominate, and checkpointing each block cuts
// them.
Case gpt_case() {
  return {"gpt",
          [](bool ckpt) {
            auto m = std::make_unique<nn::GPT>(nn::GPTConfig{
                .vocab_size = 32, .block_size = 64, .n_layer = 4, .n_head = 2, .n_embd = 32});
            m->set_gradient_checkpointing(ckpt);
            return own(std::move(m));
          },
          [](std::int64_t n) {
            Tensor tokens = zeros({n, 64}, {.dtype = DType::i64});
            return Batch{tokens, tokens.clone(), n * 64, {}};
          },
          13};
}

// Restores the CPU budget and empties the CPU cache when a real run ends, however it ends.
class CpuAllocatorGuard {
 public:
  CpuAllocatorGuard() : budget_(allocator(kCPU).budget()) {}
  ~CpuAllocatorGuard() {
    allocator(kCPU).set_budget(budget_);
    empty_cache(kCPU);
  }
  CpuAllocatorGuard(const CpuAllocatorGuard&) = delete;
  CpuAllocatorGuard& operator=(const CpuAllocatorGuard&) = delete;

 private:
  std::optional<std::size_t> budget_;
};

struct RealRun {
  std::int64_t peak =
      0;  // reserved bytes above what the process held before, at the high-water mark
  bool out_of_memory = false;
};

// Trains windows of these sizes (two of the effective batch when none are given) in micro-batches
// of n (each window's last one smaller) on the CPU, as the Trainer does: fresh micro-batch tensors
// per step, held with the model's loss until its backward has run (the logits dropped before it),
// and AdamW at each window's end. The budget, if given, caps the bytes the run may add to what the
// process already holds.
RealRun run_on_cpu(const Case& c, std::int64_t n, bool ckpt, std::optional<std::int64_t> budget,
                   std::vector<std::int64_t> windows = {}) {
  if (windows.empty()) windows = {c.effective, c.effective};
  CpuAllocatorGuard guard;
  clear_memory_budget(kCPU);
  empty_cache(kCPU);
  const std::int64_t base = memory_stats(kCPU).reserved.current;
  RealRun run;
  try {
    std::unique_ptr<nn::Model> model = c.make(ckpt);
    optim::ParamStore store(*model);
    optim::AdamW optimizer(store);
    empty_cache(kCPU);  // the parameters' blocks from before the arenas
    // The budget holds from the first step, as in the Trainer (building a model is not a step).
    if (budget) set_memory_budget(kCPU, static_cast<std::size_t>(base + *budget));
    reset_peak_memory_stats(kCPU);
    for (std::int64_t window : windows) {
      for (std::int64_t first = 0; first < window; first += n) {
        const Batch batch = c.sample(std::min(n, window - first));
        nn::ModelOutput out = model->forward(batch.inputs, batch.labels);
        out.logits = Tensor();
        out.loss.backward();
      }
      optimizer.step();
      optimizer.zero_grad();
    }
  } catch (const OutOfMemoryError&) {
    run.out_of_memory = true;
  }
  run.peak = memory_stats(kCPU).reserved.peak - base;
  return run;
}

enum class Regime { FullBatch, SplitBatch, ForcedCheckpointing, CheckpointingForThroughput };

const char* regime_name(Regime r) {
  switch (r) {
    case Regime::FullBatch:
      return "full batch fits";
    case Regime::SplitBatch:
      return "full batch does not fit";
    case Regime::ForcedCheckpointing:
      return "only checkpointing fits";
    case Regime::CheckpointingForThroughput:
      return "checkpointing for throughput";
  }
  return "";
}

// Plans under `budget`, checks the regime, then runs the plan (and one more sample) for real.
void check_plan(const Case& c, std::int64_t budget, Regime regime) {
  INFO(std::string(c.name) << ", " << std::string(regime_name(regime)) << ", budget " << budget);
  MemoryPlanner planner(c.make, c.sample, {.budget = budget, .effective_batch = c.effective});
  const MemoryPlan plan = planner.plan();
  const std::int64_t usable = planner.usable_budget();
  const std::int64_t n = plan.micro_batch_size;
  const bool ckpt = plan.gradient_checkpointing;

  // The plan is self-consistent.
  CHECK(plan.effective_batch == c.effective);
  CHECK(plan.accumulation_steps == (c.effective + n - 1) / n);
  CHECK(plan.predicted_peak == plan.breakdown.total());
  CHECK(plan.predicted_peak <= usable);
  CHECK(usable == static_cast<std::int64_t>(std::floor(static_cast<double>(budget) * 0.95)));
  CHECK(plan.breakdown.weights > 0);
  CHECK(plan.breakdown.gradients == plan.breakdown.weights);  // f32 weights, f32 gradients
  CHECK(plan.breakdown.optimizer_state == 2 * plan.breakdown.weights);  // two f32 moments
  CHECK(plan.breakdown.activations > 0);

  switch (regime) {
    case Regime::FullBatch:
      CHECK(n == c.effective);
      CHECK(plan.accumulation_steps == 1);
      CHECK_FALSE(ckpt);
      break;
    case Regime::SplitBatch:
      CHECK(n > 1);
      CHECK(n < c.effective);
      CHECK_FALSE(ckpt);
      break;
    case Regime::ForcedCheckpointing:
      CHECK(planner.max_micro_batch(false) == 0);
      CHECK(ckpt);
      break;
    case Regime::CheckpointingForThroughput:
      CHECK(planner.max_micro_batch(false) > 0);
      CHECK(ckpt);
      CHECK(n > planner.max_micro_batch(false));
      break;
  }

  // Two windows for real, under the budget: no refusal, and the peak is the predicted one.
  const RealRun run = run_on_cpu(c, n, ckpt, budget);
  MESSAGE(std::string(c.name) << ", " << std::string(regime_name(regime)) << ": budget " << budget
                              << " (usable " << usable << "), micro-batch " << n << " x "
                              << plan.accumulation_steps
                              << std::string(ckpt ? ", checkpointing" : "") << "; predicted peak "
                              << plan.predicted_peak << ", measured " << run.peak);
  REQUIRE_FALSE(run.out_of_memory);
  CHECK(run.peak <= budget);
  CHECK(run.peak <= usable);
  CHECK(std::abs(static_cast<double>(plan.predicted_peak - run.peak)) <=
        0.05 * static_cast<double>(run.peak));

  // Maximal: one more sample does not fit, by the prediction and by a real run. The real run has no
  // budget: under one, the allocator would release its cache mid-step and often squeeze the step
  // in, which is exactly what a plan must not rely on (its peak is the peak without releases).
  if (n < c.effective) {
    CHECK(planner.predict_window(n + 1, ckpt).total() > usable);
    const RealRun more = run_on_cpu(c, n + 1, ckpt, std::nullopt);
    REQUIRE_FALSE(more.out_of_memory);
    CHECK(more.peak > usable);
    MESSAGE("  one more sample (" << n + 1 << "): predicted "
                                  << planner.predict_window(n + 1, ckpt).total() << ", measured "
                                  << more.peak);
  }
}

// Budgets from the planner's predictions, one per regime, with usable = budget * 0.95.
std::int64_t budget_for(double usable) {
  return static_cast<std::int64_t>(std::ceil(usable / 0.95));
}

void check_regimes(const Case& c, bool with_throughput_case) {
  MemoryPlanner probe(c.make, c.sample, {.budget = 1, .effective_batch = c.effective});
  const double one = static_cast<double>(probe.predict_window(1, false).total());
  const double one_ckpt = static_cast<double>(probe.predict_window(1, true).total());
  const double full = static_cast<double>(probe.predict_window(c.effective, false).total());
  REQUIRE(one_ckpt < one);  // checkpointing saves something even for one sample
  check_plan(c, budget_for(full * 1.1), Regime::FullBatch);
  check_plan(c, budget_for((one + full) / 2), Regime::SplitBatch);
  check_plan(c, budget_for((one + one_ckpt) / 2), Regime::ForcedCheckpointing);
  if (!with_throughput_case) return;
  // The throughput case needs a budget where checkpointing fits enough more samples to cut the
  // number of micro-batches by more than its extra forward costs: look for one just above one
  // sample.
  std::optional<std::int64_t> budget;
  for (int percent = 1; percent <= 30 && !budget; ++percent) {
    const std::int64_t b = budget_for(one + percent / 100.0 * (full - one));
    MemoryPlanner planner(c.make, c.sample, {.budget = b, .effective_batch = c.effective});
    if (planner.plan().gradient_checkpointing && planner.max_micro_batch(false) > 0) budget = b;
  }
  REQUIRE(budget.has_value());
  check_plan(c, *budget, Regime::CheckpointingForThroughput);
}

}  // namespace

TEST_CASE("planner: MLP plans fit their budget, match the measured peak and are maximal") {
  check_regimes(mlp_case(), true);
}

TEST_CASE("planner: CNN plans fit their budget, match the measured peak and are maximal") {
  check_regimes(cnn_case(), true);
}

TEST_CASE("planner: GPT plans fit their budget, match the measured peak and are maximal") {
  // Activations dominate a GPT, so checkpointing is taken only when nothing fits without it.
  check_regimes(gpt_case(), false);
}

TEST_CASE("planner: a smaller last micro-batch costs cache, and the window prediction counts it") {
  const Case c = gpt_case();
  MemoryPlanner planner(c.make, c.sample, {.budget = 1 << 30, .effective_batch = c.effective});
  // 13 = 5 + 5 + 3: the 3-sample step cannot reuse the 5-sample blocks (a block serves a request at
  // most a quarter smaller), so the window holds both sets.
  const std::int64_t step = planner.predict(5, false).total();
  const std::int64_t window = planner.predict_window(5, false).total();
  const RealRun run = run_on_cpu(c, 5, false, std::nullopt);
  MESSAGE(std::string("gpt micro-batch 5 of 13: one step ")
          << step << ", window " << window << ", measured " << run.peak);
  CHECK(window > step + step / 10);
  CHECK(run.peak == window);
}

TEST_CASE("planner: a budget too small for one sample fails at once, saying what is needed") {
  const Case c = gpt_case();
  MemoryPlanner probe(c.make, c.sample, {.budget = 1, .effective_batch = c.effective});
  const std::int64_t need = probe.predict_window(1, true).total();  // the least one sample can take
  MemoryPlanner planner(c.make, c.sample, {.budget = need, .effective_batch = c.effective});
  std::string message;
  std::size_t requested = 0;
  try {
    planner.plan();
  } catch (const OutOfMemoryError& e) {
    message = e.what();
    requested = e.requested();
  }
  INFO(message);
  CHECK(message.find("[planner] the budget of " + format_bytes(need) +
                     " is too small for one sample") == 0);
  CHECK(message.find("needs " + format_bytes(need)) != std::string::npos);
  CHECK(message.find("weights ") != std::string::npos);
  CHECK(message.find("activations ") != std::string::npos);
  CHECK(requested == static_cast<std::size_t>(need));
  // The budget it names is enough.
  const std::int64_t named = budget_for(static_cast<double>(need));
  CHECK(message.find(std::to_string(named) + " bytes") != std::string::npos);
  MemoryPlanner enough(c.make, c.sample, {.budget = named, .effective_batch = c.effective});
  CHECK(enough.plan().micro_batch_size >= 1);
}

TEST_CASE("planner: a too-small error names the least budget that plans, whatever the margin") {
  // usable = floor(budget * (1 - margin)) in doubles, and 1 - margin is rarely exact: with a 30%
  // margin the MLP 50 -> 66 -> 4 needs 64512 bytes, ceil(64512 / 0.7) = 92160 was named, and
  // floor(92160 * 0.7) = 64511; elsewhere ceil(need / 0.7) named a byte more than the least.
  for (double margin : {0.3, 0.05, 0.1}) {
    for (std::int64_t in : {8, 50}) {
      for (std::int64_t hidden = 60; hidden <= 70; ++hidden) {
        const ModelFactory make = [in, hidden](bool ckpt) {
          auto m = std::make_unique<nn::MLP>(
              nn::MLPConfig{.in_features = in, .hidden = {hidden}, .num_classes = 4});
          m->set_gradient_checkpointing(ckpt);
          return own(std::move(m));
        };
        const SampleBatchFn sample = [in](std::int64_t n) {
          return Batch{randn({n, in}), zeros({n}, {.dtype = DType::i64}), n, {}};
        };
        auto config = [&](std::int64_t budget) {
          return PlannerConfig{.budget = budget, .margin = margin, .effective_batch = 4};
        };
        std::string message;
        try {
          MemoryPlanner(make, sample, config(1)).plan();
        } catch (const OutOfMemoryError& e) {
          message = e.what();
        }
        INFO("margin " << margin << ", MLP " << in << " -> " << hidden << " -> 4: " << message);
        const std::size_t open = message.rfind('(');
        REQUIRE(message.find("is too small for one sample") != std::string::npos);
        REQUIRE(message.rfind(" bytes)") != std::string::npos);
        const std::int64_t named = std::stoll(message.substr(open + 1));
        MemoryPlanner enough(make, sample, config(named));
        CHECK(enough.plan().micro_batch_size >= 1);
        MemoryPlanner one_less(make, sample, config(named - 1));
        testing::check_throws_with([&] { one_less.plan(); }, "is too small for one sample");
      }
    }
  }
}

TEST_CASE("planner: a fixed micro-batch size is only checked; forced checkpointing is kept") {
  const Case c = mlp_case();
  MemoryPlanner probe(c.make, c.sample, {.budget = 1, .effective_batch = c.effective});
  const std::int64_t budget =
      budget_for(static_cast<double>(probe.predict_window(20, false).total()));
  MemoryPlanner fixed(c.make, c.sample,
                      {.budget = budget, .effective_batch = c.effective, .micro_batch_size = 10});
  const MemoryPlan plan = fixed.plan();
  CHECK(plan.micro_batch_size == 10);
  CHECK(plan.accumulation_steps == 10);
  CHECK_FALSE(plan.gradient_checkpointing);

  MemoryPlanner too_big(c.make, c.sample,
                        {.budget = budget,
                         .effective_batch = c.effective,
                         .allow_checkpointing = false,
                         .micro_batch_size = 90});
  testing::check_throws_with([&] { too_big.plan(); }, "the micro-batch size 90 does not fit");

  MemoryPlanner forced(
      c.make, c.sample,
      {.budget = budget, .effective_batch = c.effective, .force_checkpointing = true});
  const MemoryPlan p = forced.plan();
  CHECK(p.gradient_checkpointing);
  CHECK(p.micro_batch_size == forced.max_micro_batch(true));
  CHECK(p.micro_batch_size >= 20);  // checkpointing fits at least what fits without it
}

TEST_CASE("planner: predict() leaves no allocation behind and does not move the random stream") {
  const Case c = gpt_case();
  MemoryPlanner planner(c.make, c.sample, {.budget = 1 << 30, .effective_batch = c.effective});
  manual_seed(7);
  const MemoryStats cpu = memory_stats(kCPU), meta = memory_stats(kMeta);
  const GeneratorState rng = default_generator().state();
  for (bool ckpt : {false, true}) {
    const MemoryBreakdown b = planner.predict_window(5, ckpt);
    CHECK(b.total() > 0);
  }
  CHECK(memory_stats(kCPU).allocated.current == cpu.allocated.current);
  CHECK(memory_stats(kMeta).allocated.current == meta.allocated.current);
  CHECK(memory_stats(kMeta).reserved.current <= meta.reserved.current);
  CHECK(default_generator().state().seed == rng.seed);
  CHECK(default_generator().state().offset == rng.offset);
}

TEST_CASE("planner: the plan prints as a table and as JSON") {
  MemoryPlan plan;
  plan.micro_batch_size = 24;
  plan.accumulation_steps = 3;
  plan.effective_batch = 64;
  plan.gradient_checkpointing = true;
  plan.breakdown = {.weights = 1024,
                    .gradients = 1024,
                    .optimizer_state = 2048,
                    .activations = 4096,
                    .workspace = 512};
  plan.predicted_peak = plan.breakdown.total();
  plan.budget = 10 << 10;
  CHECK(plan.predicted_peak == 8704);
  const std::string text = plan.str();
  INFO(text);
  for (const char* needle :
       {"micro-batch size", "24", "the last has 16", "gradient checkpointing  on", "weights",
        "gradients", "optimizer state", "activations", "workspace", "8.50 KiB"}) {
    CHECK(text.find(needle) != std::string::npos);
  }
  const nlohmann::json j = plan.to_json();
  CHECK(j["micro_batch_size"] == 24);
  CHECK(j["breakdown"]["activations"] == 4096);
  CHECK(j["breakdown"]["total"] == 8704);
  CHECK(j["gradient_checkpointing"] == true);
}

namespace {

// One step's and one window's predicted peak for every micro-batch size 1..effective (index 0
// unused): measurements do not depend on the budget, so one probe serves every budget.
struct Landscape {
  std::vector<std::int64_t> step, window;
};

Landscape landscape(const Case& c, bool ckpt) {
  MemoryPlanner probe(c.make, c.sample, {.budget = 1, .effective_batch = c.effective});
  Landscape l{std::vector<std::int64_t>(c.effective + 1),
              std::vector<std::int64_t>(c.effective + 1)};
  for (std::int64_t n = 1; n <= c.effective; ++n) {
    l.step[n] = probe.predict(n, ckpt).total();
    l.window[n] = probe.predict_window(n, ckpt).total();
  }
  return l;
}

// The exhaustive answer: below the largest size whose one step fits, every size down to the
// first whose window fits (one measurement each).
std::int64_t walk_down(const Landscape& l, std::int64_t usable) {
  std::int64_t n = static_cast<std::int64_t>(l.step.size()) - 1;
  while (n > 0 && l.step[n] > usable) --n;
  while (n > 0 && l.window[n] > usable) --n;
  return n;
}

std::int64_t micro_batches(std::int64_t effective, std::int64_t n) {
  return n == 0 ? 0 : (effective + n - 1) / n;
}

}  // namespace

TEST_CASE("planner: the micro-batch search finds the exhaustive walk's micro-batch count") {
  for (const Case& c : {mlp_case(), cnn_case(), gpt_case()}) {
    MemoryPlanner probe(c.make, c.sample, {.budget = 1, .effective_batch = c.effective});
    const double one = static_cast<double>(probe.predict_window(1, false).total());
    const double one_ckpt = static_cast<double>(probe.predict_window(1, true).total());
    const double full = static_cast<double>(probe.predict_window(c.effective, false).total());
    // check_regimes' budgets, which must give the walk's very answer ...
    std::vector<std::int64_t> exact = {budget_for(full * 1.1), budget_for((one + full) / 2),
                                       budget_for((one + one_ckpt) / 2)};
    for (int percent = 1; percent <= 30; ++percent)
      exact.push_back(budget_for(one + percent / 100.0 * (full - one)));
    // ... and a sweep from below one sample to above the whole batch.
    std::vector<std::int64_t> sweep;
    for (int i = 0; i <= 24; ++i)
      sweep.push_back(budget_for(one_ckpt * 0.98 + i / 24.0 * (full * 1.02 - one_ckpt * 0.98)));
    for (bool ckpt : {false, true}) {
      const Landscape l = landscape(c, ckpt);
      int same = 0, budgets = 0;
      for (const std::vector<std::int64_t>* list : {&exact, &sweep}) {
        for (std::int64_t budget : *list) {
          MemoryPlanner planner(c.make, c.sample,
                                {.budget = budget, .effective_batch = c.effective});
          const std::int64_t usable = planner.usable_budget();
          const std::int64_t n = planner.max_micro_batch(ckpt), walked = walk_down(l, usable);
          INFO(std::string(c.name) << std::string(ckpt ? " with checkpointing" : "") << ", budget "
                                   << budget << ": search " << n << ", walk " << walked);
          if (list == &exact) CHECK(n == walked);
          CHECK(micro_batches(c.effective, n) == micro_batches(c.effective, walked));
          if (n > 0) {
            CHECK(l.window[n] <= usable);                          // fits
            if (n < c.effective) CHECK(l.window[n + 1] > usable);  // maximal
          }
          same += n == walked;
          ++budgets;
        }
      }
      MESSAGE(std::string(c.name) << std::string(ckpt ? " with checkpointing" : "")
                                  << ": the walk's own answer at " << same << " of " << budgets
                                  << " budgets, and its micro-batch count at all of them");
    }
  }
}

TEST_CASE("planner: the micro-batch search takes O(log E) measurements, not hundreds") {
  // The MLP with an effective batch of 1000, under the budget of one step of 750: every window from
  // 750 down to about 550 holds a second set of blocks for its smaller last micro-batch and does
  // not fit, so the walk measured each of them.
  Case c = mlp_case();
  c.effective = 1000;
  int measurements = 0;
  const ModelFactory counted = [&](bool ckpt) {
    ++measurements;
    return c.make(ckpt);
  };
  MemoryPlanner probe(c.make, c.sample, {.budget = 1, .effective_batch = c.effective});
  const std::int64_t budget = budget_for(static_cast<double>(probe.predict(750, false).total()));
  MemoryPlanner planner(counted, c.sample, {.budget = budget, .effective_batch = c.effective});
  const std::int64_t n = planner.max_micro_batch(false);
  const int bound = 8 * static_cast<int>(std::bit_width(static_cast<std::uint64_t>(c.effective)));
  MESSAGE("micro-batch " << n << " of " << c.effective << " in " << measurements
                         << " measurements (bound " << bound << ")");
  CHECK(measurements <= bound);
  CHECK(n > 0);
  CHECK(planner.predict_window(n, false).total() <= planner.usable_budget());
  CHECK(planner.predict_window(n + 1, false).total() > planner.usable_budget());
  // The walk would have measured every size from the step bound down past the bound's worth.
  std::int64_t top = c.effective;
  while (planner.predict(top, false).total() > planner.usable_budget()) --top;
  for (std::int64_t m = top; m > top - bound; --m)
    CHECK(planner.predict_window(m, false).total() > planner.usable_budget());
}

TEST_CASE("planner: the search finds fewer micro-batches that the gallop strides over") {
  // Note [Searching for the micro-batch]: the MLP at E = 513, with an epoch tail of 100 and this
  // budget, has fitting and non-fitting windows interleaved below top; the gallop and bisection
  // alone landed on 20 (26 micro-batches) where 34 (16) fits.
  Case c = mlp_case();
  c.effective = 513;
  const std::int64_t remainder = 100, budget = 2353153;
  const PlannerConfig config{.budget = budget,
                             .effective_batch = c.effective,
                             .epoch_remainder = remainder,
                             .allow_checkpointing = false};
  MemoryPlanner planner(c.make, c.sample, config);
  const MemoryPlan plan = planner.plan();
  const std::int64_t usable = planner.usable_budget(), n = plan.micro_batch_size;

  // Every size up to the first whose one step does not fit (no larger window can fit), measured:
  // the largest size that fits, which has the fewest micro-batches of any that fits.
  MemoryPlanner probe(c.make, c.sample, config);
  std::int64_t largest = 0;
  std::vector<std::int64_t> misses;
  for (std::int64_t m = 1; m <= c.effective && probe.predict(m, false).total() <= usable; ++m) {
    if (probe.predict_window(m, false).total() <= usable) {
      largest = m;
    } else {
      misses.push_back(m);
    }
  }
  REQUIRE(largest > 0);
  const std::int64_t fewest = micro_batches(c.effective, largest);
  // The case is the one the Note describes: a size below the answer does not fit.
  REQUIRE(std::any_of(misses.begin(), misses.end(), [&](std::int64_t m) { return m < largest; }));
  INFO("plan " << n << " x " << plan.accumulation_steps << "; exhaustive " << largest << " x "
               << fewest);
  CHECK(plan.accumulation_steps == fewest);
  CHECK(n == largest);
  CHECK_FALSE(plan.gradient_checkpointing);
  CHECK(plan.predicted_peak <= usable);
  CHECK(planner.predict_window(n + 1, false).total() > usable);  // maximal

  // Two epochs of 3 windows and the tail, for real under the budget: no refusal, and the peak the
  // plan predicts.
  const std::vector<std::int64_t> epoch = {c.effective, c.effective, c.effective, remainder};
  std::vector<std::int64_t> windows = epoch;
  windows.insert(windows.end(), epoch.begin(), epoch.end());
  const RealRun run = run_on_cpu(c, n, false, budget, windows);
  REQUIRE_FALSE(run.out_of_memory);
  CHECK(run.peak <= usable);
  CHECK(run.peak == plan.predicted_peak);
}
