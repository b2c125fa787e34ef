#include "examples/accumulation_styles.h"
#include "tests/core/harness.h"
#include "train/accelerator.h"
#include "train/accumulation_check.h"

using namespace microbatch;
using namespace microbatch::testing;

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
  for (std::int64_t n : {3, 1, 4, 2, 5}) batches.push_back(train::Batch{zeros({n}), zeros({n}), n, {}});
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
  for (std::size_t i = 0; i < pa.size(); ++i) check_close(pb[i].second, pa[i].second, 0, 0, pa[i].first);
}
