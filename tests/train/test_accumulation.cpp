#include <atomic>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <type_traits>

#include "examples/accumulation_styles.h"
#include "tests/core/harness.h"
#include "train/accelerator.h"
#include "train/accumulation_check.h"
#include "train/trainer.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {

// One trainable weight w = 1: the loss sum(w * 2) has gradient 2.
struct Scalar : nn::Module {
  Tensor w;
  Scalar() {
    w = ones({1});
    register_parameter("w", &w);
  }
};

Tensor scalar_loss(const Scalar& model) { return sum(model.w * 2.0); }

// `count` batches of one item each, then nullopt.
std::function<std::optional<train::Batch>()> unit_batches(int count) {
  return [count, n = 0]() mutable -> std::optional<train::Batch> {
    if (n++ >= count) return std::nullopt;
    return train::Batch{zeros({1}), zeros({1}), 1, {}};
  };
}

// Samples 0..n-1 (input i is the value i), all of class 0.
train::TensorDataset counting_dataset(std::int64_t n) {
  return train::TensorDataset(arange(0, static_cast<double>(n)).reshape({n, 1}),
                              zeros({n}, {.dtype = DType::i64}));
}

// A dataset whose read of one example fails once, as a transient I/O error would.
class FlakyDataset : public train::Dataset {
 public:
  FlakyDataset(std::int64_t size, std::int64_t failing)
      : data_(counting_dataset(size)), failing_(failing) {}
  std::int64_t size() const override { return data_.size(); }
  train::Example get(std::int64_t index) const override {
    if (index == failing_ && !failed_.exchange(true)) throw std::runtime_error("transient read");
    return data_.get(index);
  }

 private:
  train::TensorDataset data_;
  std::int64_t failing_;
  mutable std::atomic<bool> failed_{false};  // read from the loader's prefetch thread
};

}  // namespace

TEST_CASE("accumulation certificate: every split equals the full batch (f64 and f32)") {
  for (DType dt : {DType::f64, DType::f32}) {
    const double tol = train::accumulation_tolerance(dt);
    for (const auto& c : train::check_accumulation({.dtype = dt})) {
      INFO(c.model << " " << c.split << " " << dtype_name(dt));
      CHECK(c.max_gradient <= tol);
      CHECK(c.max_weight <= tol);
      CHECK(c.gradients.size() > 0);
      if (c.naive_max_gradient >= 0) {
        // The naive `mean / N` rule is visibly wrong on padded token batches.
        CHECK(c.naive_max_gradient > 1e-3);
      }
    }
  }
}

TEST_CASE("windowed loader: weights are shares of the window's items; the last window may be short") {
  std::vector<train::Batch> batches;
  for (std::int64_t n : {3, 1, 4, 2, 5}) {
    batches.push_back(train::Batch{zeros({n}), zeros({n}), n, {}});
  }
  std::size_t next = 0;
  train::WindowedLoader loader([&]() -> std::optional<train::Batch> {
    if (next == batches.size()) return std::nullopt;
    return batches[next++];
  }, 2);
  std::vector<double> weights;
  std::vector<bool> ends;
  while (auto b = loader.next()) {
    weights.push_back(b->weight);
    ends.push_back(b->ends_window);
  }
  REQUIRE(weights.size() == 5);
  CHECK(weights[0] == doctest::Approx(3.0 / 4.0));
  CHECK(weights[1] == doctest::Approx(1.0 / 4.0));
  CHECK(weights[2] == doctest::Approx(4.0 / 6.0));
  CHECK(weights[4] == 1.0);  // a window of one batch
  CHECK(ends == std::vector<bool>{false, true, false, true, true});
  check_throws_with([] { train::Accelerator({.gradient_accumulation_steps = 0}); },
                    "gradient_accumulation_steps must be >= 1");
}

TEST_CASE("the raw loop and the Accelerator give identical weights after the same steps") {
  manual_seed(7);
  Tensor images = rand({90, 28, 28});
  Tensor labels = (rand({90}) * 10.0).to(DType::i64);
  train::TensorDataset data(images, labels);
  // 90 samples in micro-batches of 8 leave a short last batch and a short last window.
  examples::ExampleConfig config{.per_device_train_batch_size = 8, .gradient_accumulation_steps = 4,
                                 .max_steps = 5};
  manual_seed(1);
  nn::MLP a({.in_features = 784, .hidden = {32}, .num_classes = 10});
  manual_seed(1);
  nn::MLP b({.in_features = 784, .hidden = {32}, .num_classes = 10});
  std::vector<double> la = examples::train_raw_loop(a, data, config);
  std::vector<double> lb = examples::train_with_accelerator(b, data, config);
  CHECK(la == lb);
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    check_close(pb[i].second, pa[i].second, 0, 0, pa[i].first);
  }
}

TEST_CASE("the raw loop and the Accelerator agree when whole windows carry no loss") {
  // 16 samples, one labelled: most windows of 2 x 2 have no loss-bearing sample. Their weight is
  // 0, not 0 / 0 (NaN would reach every gradient); the steps still decay the weights alike.
  manual_seed(8);
  Tensor images = rand({16, 28, 28});
  std::vector<double> y(16, -100.0);
  y[9] = 4;
  train::TensorDataset data(images, from_vector(y, {16}, {.dtype = DType::i64}));
  examples::ExampleConfig config{.per_device_train_batch_size = 2, .gradient_accumulation_steps = 2,
                                 .max_steps = 4};
  manual_seed(1);
  nn::MLP a({.in_features = 784, .hidden = {16}, .num_classes = 10});
  manual_seed(1);
  nn::MLP b({.in_features = 784, .hidden = {16}, .num_classes = 10});
  examples::train_raw_loop(a, data, config);
  examples::train_with_accelerator(b, data, config);
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    CAPTURE(pa[i].first);
    for (double v : pa[i].second.to_vector()) REQUIRE(std::isfinite(v));
    check_close(pb[i].second, pa[i].second, 0, 0, pa[i].first);
  }
  config.gradient_accumulation_steps = 0;
  check_throws_with([&] { examples::train_raw_loop(a, data, config); },
                    "[train_raw_loop] gradient_accumulation_steps must be >= 1, got 0");
}

TEST_CASE("Accelerator: the scheduler stays put after a skipped step (found_inf)") {
  Scalar model;
  optim::ParamStore store(model);
  optim::AdamW adamw(store, {.lr = 1.0});
  optim::LRScheduler schedule(adamw, {.type = optim::ScheduleType::Linear, .total_steps = 10});
  train::Accelerator accelerator({.gradient_accumulation_steps = 2, .cpu = true});
  auto optimizer = accelerator.prepare(adamw);
  auto scheduler = accelerator.prepare(schedule);
  auto batches = accelerator.prepare(unit_batches(8));  // four windows of two
  int window = 0;
  while (auto batch = batches.next()) {
    auto scope = accelerator.accumulate(*batch);
    accelerator.backward(scalar_loss(model));
    // The first three windows overflow, as an fp16 loss scaler would find; the fourth does not.
    const bool found_inf = window < 3;
    optimizer.step({.found_inf = found_inf});
    scheduler.step();
    optimizer.zero_grad();
    if (batch->ends_window) {
      CHECK(optimizer.step_was_skipped() == found_inf);
      ++window;
    }
  }
  CHECK(window == 4);
  CHECK(adamw.step_count() == 1);
  CHECK(schedule.steps() == 1);
  CHECK(adamw.lr() == doctest::Approx(0.9));  // one step of 10 down the linear schedule
}

TEST_CASE("Accelerator: backward() outside a scope is refused with accumulation") {
  Scalar model;
  optim::ParamStore store(model);
  train::Accelerator accelerator({.gradient_accumulation_steps = 4, .cpu = true});
  check_throws_with([&] { accelerator.backward(scalar_loss(model)); },
                    "outside an accumulate() scope with gradient_accumulation_steps = 4");
  auto batches = accelerator.prepare(unit_batches(3));  // one short window: weights 1/3
  while (auto batch = batches.next()) {
    auto scope = accelerator.accumulate(*batch);
    accelerator.backward(scalar_loss(model));
  }
  CHECK(store.grads().item() == doctest::Approx(2.0));
  // The last scope's weight (1/3) ended with it.
  CHECK(grad_weight() == 1.0);
  check_throws_with([&] { accelerator.backward(scalar_loss(model)); }, "outside an accumulate()");
  CHECK(store.grads().item() == doctest::Approx(2.0));
  // With one micro-batch per window every weight is 1, and backward() needs no scope.
  train::Accelerator single({.gradient_accumulation_steps = 1, .cpu = true});
  store.zero_grad();
  single.backward(scalar_loss(model));
  CHECK(store.grads().item() == 2.0);
}

TEST_CASE("windowed loader: a read that fails mid-window is retried into the same window") {
  FlakyDataset data(9, 2);  // the third read of the first window fails once
  train::DataLoader loader(data, {.batch_size = 1});
  train::Accelerator accelerator({.gradient_accumulation_steps = 4, .cpu = true});
  auto batches = accelerator.prepare(loader);
  CHECK_THROWS_WITH_AS(batches.next(), "transient read", std::runtime_error);
  std::vector<std::int64_t> seen;
  std::vector<double> weights;
  std::vector<bool> ends;
  while (auto batch = batches.next()) {
    seen.push_back(batch->batch.indices.at(0));
    weights.push_back(batch->weight);
    ends.push_back(batch->ends_window);
  }
  CHECK(seen == std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8});
  CHECK(weights == std::vector<double>{0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 0.25, 1.0});
  CHECK(ends == std::vector<bool>{false, false, false, true, false, false, false, true, true});
}

TEST_CASE("Accelerator: every backward in a scope is weighted; backward() takes seed and options") {
  Scalar model;
  optim::ParamStore store(model);
  train::Accelerator accelerator({.gradient_accumulation_steps = 4, .cpu = true});
  auto batches = accelerator.prepare(unit_batches(4));  // four equal micro-batches: weights 1/4
  while (auto batch = batches.next()) {
    auto scope = accelerator.accumulate(*batch);
    scalar_loss(model).backward();  // not through the accelerator: weighted all the same
  }
  CHECK(store.grads().item() == 2.0);  // the mean of the four, not their sum 8
  store.zero_grad();
  // An fp16 loop seeds backward with the loss scale; retain_graph lets a second pass reuse the
  // graph. Each micro-batch adds (scale * 2 + 2) / 4.
  const double scale = 1024.0;
  auto scaled = accelerator.prepare(unit_batches(4));
  while (auto batch = scaled.next()) {
    auto scope = accelerator.accumulate(*batch);
    Tensor loss = scalar_loss(model);
    accelerator.backward(loss, full(loss.shape(), scale), {.retain_graph = true});
    accelerator.backward(loss);
  }
  CHECK(store.grads().item() == (scale + 1.0) * 2.0);
}

TEST_CASE("windowed loader: moving the DataLoader drops the window read ahead") {
  train::TensorDataset data = counting_dataset(16);
  train::DataLoader loader(data, {.batch_size = 2, .shuffle = true, .seed = 3});
  train::DataLoader reference(data, {.batch_size = 2, .shuffle = true, .seed = 3});
  train::Accelerator accelerator({.gradient_accumulation_steps = 4, .cpu = true});
  auto batches = accelerator.prepare(loader);
  REQUIRE(batches.next());  // reads a window of four batches ahead and hands out the first
  // Note [Cutting a window]: part of the window is out, its gradients added; a move is refused
  // until the window ends, or until reset() drops it explicitly.
  check_throws_with([&] { batches.set_epoch(1); },
                    "[WindowedLoader] set_epoch() with 1 of this window's 4 micro-batches "
                    "handed out");
  batches.reset();
  batches.set_epoch(1);
  reference.set_epoch(1);
  auto first = batches.next();
  REQUIRE(first);
  CHECK(first->batch.indices == reference.batch_indices(0));
  CHECK(first->weight == 0.25);  // a fresh window of four
  for (int i = 0; i < 3; ++i) REQUIRE(batches.next());  // the window ends: moves are free again
  // Moved on the DataLoader itself, as a resume from a checkpoint does: caught all the same.
  loader.set_state({.epoch = 2, .position = 5});
  reference.set_epoch(2);
  auto resumed = batches.next();
  REQUIRE(resumed);
  CHECK(resumed->batch.indices == reference.batch_indices(5));
  CHECK(resumed->weight == doctest::Approx(1.0 / 3.0));  // batches 5, 6, 7 end the epoch
  // The DataLoader moved part-way through that window: refused at the next batch.
  loader.set_epoch(0);
  check_throws_with([&] { batches.next(); }, "the DataLoader was moved with 1 of this window's 3");
  batches.reset();
  batches.set_state({.epoch = 0, .position = 1});
  reference.set_epoch(0);
  CHECK(batches.next()->batch.indices == reference.batch_indices(1));
  // A source it cannot see into is the caller's to reset.
  auto blind = accelerator.prepare([&] { return loader.next(); });
  check_throws_with([&] { blind.set_epoch(0); }, "needs a DataLoader source");
  REQUIRE(blind.next());
  loader.set_epoch(1);
  blind.reset();
  reference.set_epoch(1);
  CHECK(blind.next()->batch.indices == reference.batch_indices(0));
}

TEST_CASE("Accelerator: loaders count items by the prepared model's ignore_index") {
  // Note [Items by the model's ignore_index]: a GPT that ignores -1, with a loader counting by
  // the default -100, would weigh micro-batches by labels the loss ignores, with no error.
  nn::GPT gpt({.vocab_size = 8, .block_size = 4, .n_layer = 1, .n_head = 1, .n_embd = 4,
               .ignore_index = -1});
  train::TensorDataset data(zeros({4, 4}, {.dtype = DType::i64}), zeros({4, 4}, {.dtype = DType::i64}));
  train::DataLoader counts_default(data, {.batch_size = 2});
  train::DataLoader counts_model(data, {.batch_size = 2, .collate = {.ignore_index = -1}});
  {
    train::Accelerator accelerator({.gradient_accumulation_steps = 2, .cpu = true});
    accelerator.prepare_model(gpt);
    check_throws_with([&] { accelerator.prepare(counts_default); },
                      "[Accelerator] the DataLoader counts items with ignore_index -100 but the "
                      "model ignores -1");
    auto batches = accelerator.prepare(counts_model);
    CHECK(batches.next());
  }
  {  // prepared the other way round
    train::Accelerator accelerator({.gradient_accumulation_steps = 2, .cpu = true});
    auto batches = accelerator.prepare(counts_default);
    check_throws_with([&] { accelerator.prepare_model(gpt); }, "but the model ignores -1");
  }
  static_assert(!std::is_copy_constructible_v<train::WindowedLoader>,
                "a copy would hand out the same read-ahead batches again");
}

TEST_CASE("Accelerator: a scheduler skips only when its own optimizer skipped") {
  // As Accelerate attaches each prepared scheduler to its optimizer: B's schedule moves with B's
  // steps whatever A does.
  Scalar a_model, b_model;
  optim::ParamStore a_store(a_model), b_store(b_model);
  optim::SGD a_inner(a_store, {.lr = 1.0}), b_inner(b_store, {.lr = 1.0});
  optim::LRScheduler a_sched(a_inner, {.type = optim::ScheduleType::Linear, .total_steps = 10});
  optim::LRScheduler b_sched(b_inner, {.type = optim::ScheduleType::Linear, .total_steps = 10});
  train::Accelerator accelerator({.cpu = true});
  auto a = accelerator.prepare(a_inner);
  auto b = accelerator.prepare(b_inner);
  auto a_schedule = accelerator.prepare(a_sched);
  auto b_schedule = accelerator.prepare(b_sched);
  for (int i = 0; i < 3; ++i) {
    a.step({.found_inf = true});
    b.step();
    a_schedule.step();
    b_schedule.step();
  }
  CHECK(a.step_was_skipped());
  CHECK(a_sched.steps() == 0);
  CHECK(b_sched.steps() == 3);
  CHECK(b_inner.lr() == doctest::Approx(0.7));
}

TEST_CASE("Accelerator: a batch that no prepared loader made is refused") {
  train::Accelerator accelerator({.gradient_accumulation_steps = 2, .cpu = true});
  train::WindowBatch hand_built;  // ends_window false: the optimizer would never step
  hand_built.batch = train::Batch{zeros({1}), zeros({1}), 1, {}};
  check_throws_with([&] { auto scope = accelerator.accumulate(hand_built); }, "prepared loader");
  // The refusal leaves no scope open.
  auto batches = accelerator.prepare(unit_batches(1));
  auto batch = batches.next();
  REQUIRE(batch);
  CHECK(batch->from_loader());
  auto scope = accelerator.accumulate(*batch);
  CHECK(accelerator.sync_gradients());
}

TEST_CASE("examples: data with no batch is refused, not waited on forever") {
  train::TensorDataset empty(zeros({0, 28, 28}), zeros({0}, {.dtype = DType::i64}));
  nn::MLP model({.in_features = 784, .hidden = {8}, .num_classes = 10});
  check_throws_with([&] { examples::train_raw_loop(model, empty, {}); }, "no batches");
  check_throws_with([&] { examples::train_with_accelerator(model, empty, {}); }, "no batches");
  train::TensorDataset three = counting_dataset(3);
  train::DataLoader short_of_one(three, {.batch_size = 4, .drop_last = true});
  train::Accelerator accelerator({.cpu = true});
  check_throws_with([&] { accelerator.prepare(short_of_one); }, "no batches (3 examples");
}

TEST_CASE("Trainer: every split of a window gives one step with a GPT's own ignore_index") {
  // Note [Batch items]: a micro-batch's items are the labels its model's loss averages over. With
  // ignore_index = 0 the 0 labels carry no loss; counted as items, they would weight the rows
  // (1, 6, 5 and 3 items here) by the wrong shares, and each split would give another step.
  std::vector<double> xs, ys;
  const int ignored[4] = {5, 0, 1, 3};
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < 6; ++t) {
      xs.push_back((r + t) % 5);
      ys.push_back(t < ignored[r] ? 0 : 1 + (r * t) % 4);
    }
  const Tensor inputs = from_vector(xs, {4, 6}, {.dtype = DType::i64});
  const Tensor labels = from_vector(ys, {4, 6}, {.dtype = DType::i64});
  const train::TensorDataset data(inputs, labels);
  const train::ModelInit init = [] {
    nn::GPTConfig config{.vocab_size = 5, .block_size = 6, .n_layer = 1, .n_head = 1, .n_embd = 8};
    config.ignore_index = 0;
    auto gpt = std::make_unique<nn::GPT>(config);
    gpt->to(DType::f64);
    return gpt;
  };
  std::vector<double> losses, norms;
  for (auto [micro, steps] : {std::pair{4, 1}, std::pair{1, 4}, std::pair{2, 2}}) {
    CAPTURE(micro);
    TempDir dir;
    train::Trainer trainer(init,
                           {.output_dir = dir.path.string(), .per_device_train_batch_size = micro,
                            .per_device_eval_batch_size = 1, .gradient_accumulation_steps = steps,
                            .max_steps = 1, .max_grad_norm = 0, .logging_steps = 1,
                            .use_cpu = true},
                           data, &data);
    std::ostringstream sink;
    trainer.set_log_stream(&sink);
    trainer.train();
    const std::vector<nlohmann::json> lines = step_lines(dir.path);
    REQUIRE(lines.size() == 1);
    losses.push_back(lines[0]["loss"]);
    norms.push_back(lines[0]["grad_norm"]);
    // Evaluation weights its batches of one row by the same items: the whole set's mean loss.
    NoGradGuard no_grad;
    const double whole = trainer.model().forward(inputs, labels).loss.item();
    CHECK(trainer.evaluate().at("eval_loss") == doctest::Approx(whole).epsilon(1e-12));
  }
  for (std::size_t i = 1; i < losses.size(); ++i) {
    CHECK(losses[i] == doctest::Approx(losses[0]).epsilon(1e-12));
    CHECK(norms[i] == doctest::Approx(norms[0]).epsilon(1e-12));
  }
}
