// What compute_metrics and predict() see (train/metrics.h): the classification metrics, and the
// logits and labels of evaluation batches of different lengths, padded across batches as Hugging
// Face's nested_concat pads them.
#include <cmath>
#include <sstream>

#include "tests/core/harness.h"
#include "tests/train/trainer_fixtures.h"
#include "train/trainer.h"

using namespace microbatch;
using namespace microbatch::testing;
using namespace microbatch::train;

namespace {

ModelInit tiny_gpt(std::int64_t ignore_index = -100) {
  return [ignore_index] {
    return std::make_unique<nn::GPT>(nn::GPTConfig{.vocab_size = 11,
                                                   .block_size = 8,
                                                   .n_layer = 1,
                                                   .n_head = 1,
                                                   .n_embd = 8,
                                                   .ignore_index = ignore_index});
  };
}

// Token accuracy over the labels that are not ignore_index, as a Hugging Face user's
// compute_metrics masks them.
Metrics token_accuracy(const EvalPrediction& p) {
  const std::vector<double> pred = argmax(p.logits, 2).to_vector(), gold = p.labels.to_vector();
  double correct = 0, scored = 0;
  for (std::size_t i = 0; i < gold.size(); ++i) {
    if (static_cast<std::int64_t>(gold[i]) == p.ignore_index) continue;
    ++scored;
    correct += pred[i] == gold[i] ? 1 : 0;
  }
  return {{"token_accuracy", correct / scored}, {"scored", scored}};
}

}  // namespace

TEST_CASE("classification metrics: accuracy and macro precision, recall, F1") {
  // Predictions 0, 1, 1, 2 for labels 0, 1, 2, 2.
  Tensor logits = from_vector({5, 0, 0, 0, 5, 0, 0, 5, 0, 0, 0, 5}, {4, 3});
  Tensor labels = from_vector({0, 1, 2, 2}, {4}, {.dtype = DType::i64});
  Metrics m = classification_metrics({logits, labels});
  CHECK(m["accuracy"] == doctest::Approx(0.75));
  // Per class precision 1, 1/2, 1; recall 1, 1, 1/2; F1 1, 2/3, 2/3.
  CHECK(m["precision"] == doctest::Approx((1 + 0.5 + 1) / 3));
  CHECK(m["recall"] == doctest::Approx((1 + 1 + 0.5) / 3));
  CHECK(m["f1"] == doctest::Approx((1 + 2.0 / 3 + 2.0 / 3) / 3));
}

TEST_CASE("classification metrics: rows labelled ignore_index are not scored") {
  // Predictions 0, 1, 2, 0 for labels 0, 1, 2 and one that carries no loss: every scored row is
  // right, and the ignored row is no class (not a false positive of class 0 either).
  const Tensor logits = from_vector({9, 0, 0, 0, 9, 0, 0, 0, 9, 9, 0, 0}, {4, 3});
  Metrics m =
      classification_metrics({logits, from_vector({0, 1, 2, -100}, {4}, {.dtype = DType::i64})});
  CHECK(m["accuracy"] == 1.0);
  CHECK(m["precision"] == 1.0);
  CHECK(m["recall"] == 1.0);
  CHECK(m["f1"] == 1.0);
  // The prediction's own ignore_index (the model's) is the one left out.
  m = classification_metrics({logits, from_vector({0, 1, 2, 7}, {4}, {.dtype = DType::i64}), 7});
  CHECK(m["accuracy"] == 1.0);
  CHECK(m["f1"] == 1.0);
  // With no row to score there is no score: no metrics, rather than a 0 that reads as one.
  CHECK(classification_metrics({logits, full({4}, -100, {.dtype = DType::i64})}).empty());

  // Through the Trainer: eval_accuracy is that of the rows that carry a label.
  manual_seed(3);
  const Tensor x = randn({12, 4});
  std::vector<double> y = {0, 1, 2, 0, 1, 2, -100, -100, 0, 1, -100, 2};
  const TensorDataset data(x, from_vector(y, {12}, {.dtype = DType::i64}));
  TempDir dir;
  Trainer trainer(
      [] {
        return std::make_unique<nn::MLP>(
            nn::MLPConfig{.in_features = 4, .hidden = {5}, .num_classes = 3});
      },
      {.output_dir = dir.path.string(), .per_device_eval_batch_size = 5, .use_cpu = true}, data,
      &data, classification_metrics);
  const PredictionOutput p = trainer.predict(data);
  const std::vector<double> pred = argmax(p.predictions, 1).to_vector();
  double correct = 0;
  for (std::size_t i = 0; i < y.size(); ++i) correct += y[i] != -100 && pred[i] == y[i] ? 1 : 0;
  CHECK(p.metrics.at("test_accuracy") == correct / 9);
}

TEST_CASE(
    "predict: token batches of different lengths are padded to the longest, as nested_concat") {
  // Batches of 2: lengths (2, 2), (8, 8), (5): each batch padded to its own longest by the
  // collator, a later batch longer than the first.
  const Sequences data({2, 2, 8, 8, 5}, 11);
  for (std::int64_t ignore_index : {std::int64_t{-100}, std::int64_t{0}}) {
    CAPTURE(ignore_index);
    TempDir dir;
    Trainer trainer(
        tiny_gpt(ignore_index),
        {.output_dir = dir.path.string(), .per_device_eval_batch_size = 2, .use_cpu = true}, data,
        &data, token_accuracy);
    const PredictionOutput p = trainer.predict(data);
    REQUIRE(p.predictions.shape() == Shape{5, 8, 11});
    REQUIRE(p.label_ids.shape() == Shape{5, 8});
    // Each batch's own forward, placed in its rows; the rest is padding: logits -100 (Hugging
    // Face's padding_index), labels the model's ignore_index.
    std::vector<double> logits(5 * 8 * 11, -100.0),
        labels(5 * 8, static_cast<double>(ignore_index));
    double correct = 0, scored = 0;
    {
      NoGradGuard no_grad;
      for (std::int64_t first = 0; first < 5; first += 2) {
        std::vector<Example> rows;
        for (std::int64_t i = first; i < std::min<std::int64_t>(first + 2, 5); ++i)
          rows.push_back(data.get(i));
        const Batch b = collate(rows, {.ignore_index = ignore_index});
        const Tensor out = trainer.model().forward(b.inputs).logits;  // (B, T, 11)
        const std::vector<double> v = out.to_vector(), l = b.labels.to_vector(),
                                  a = argmax(out, 2).to_vector();
        const std::int64_t t = out.shape()[1];
        for (std::int64_t r = 0; r < out.shape()[0]; ++r)
          for (std::int64_t k = 0; k < t; ++k) {
            const std::int64_t row = first + r;
            for (std::int64_t c = 0; c < 11; ++c)
              logits[(row * 8 + k) * 11 + c] = v[(r * t + k) * 11 + c];
            labels[row * 8 + k] = l[r * t + k];
            if (l[r * t + k] == static_cast<double>(ignore_index)) continue;
            ++scored;
            correct += a[r * t + k] == l[r * t + k] ? 1 : 0;
          }
      }
    }
    CHECK(p.predictions.to_vector() == logits);
    CHECK(p.label_ids.to_vector() == labels);
    CHECK(p.metrics.at("test_scored") == scored);
    CHECK(p.metrics.at("test_token_accuracy") == correct / scored);
  }
}

TEST_CASE("HostRows: batches may differ only in their second dimension") {
  HostRows rows("logits", kLogitsPadding);
  rows.add(zeros({2, 3, 4}));
  check_throws_with(
      [&] {
        rows.add(zeros({2, 3, 5}));
      },
      "[evaluate] evaluation batch 1 has logits f32 (2, 3, 5), batch 0 had f32 (2, 3, 4)");
  check_throws_with(
      [&] {
        rows.add(zeros({2, 3, 4}, {.dtype = DType::f64}));
      },
      "evaluation batch 1 has logits f64");
  rows.add(ones({1, 5, 4}));
  const Tensor t = rows.tensor();
  REQUIRE(t.shape() == Shape{3, 5, 4});
  CHECK(t.select(0, 0).slice(0, 3, 5).to_vector() == std::vector<double>(8, -100.0));
  CHECK(t.select(0, 2).to_vector() == std::vector<double>(20, 1.0));
  // A padding value the labels' dtype cannot hold is refused, not wrapped into a class.
  HostRows labels("labels", -100);
  labels.add(zeros({1, 2}, {.dtype = DType::u8}));
  labels.add(zeros({1, 3}, {.dtype = DType::u8}));
  check_throws_with([&] { (void)labels.tensor(); },
                    "padded with -100, which is not a value of their dtype u8");
}
