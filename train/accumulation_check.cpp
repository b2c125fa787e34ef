#include "train/accumulation_check.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>

#include "nn/models.h"
#include "optim/optimizer.h"

namespace microbatch::train {

namespace {

struct StepResult {
  std::vector<std::pair<std::string, Tensor>> grads;
  std::vector<std::pair<std::string, Tensor>> weights;
};

enum class Weighting { Exact, NaiveMean };

// One optimizer step from a fresh model (same seed each time) over the given micro-batch split.
// The step is SGD with momentum and weight decay: its update is linear in the gradient, so the
// weights differ exactly as much as the accumulated gradients do. (AdamW's first step is
// lr * g / (|g| + eps), a sign function that turns rounding noise in a gradient that is zero in
// exact arithmetic — the GPT's key bias is one — into a full lr-sized difference; that says
// nothing about the accumulation.)
StepResult run_step(const std::function<std::unique_ptr<nn::Model>()>& make, const Tensor& inputs,
                    const Tensor& labels, const std::vector<std::int64_t>& split, Weighting weighting) {
  std::unique_ptr<nn::Model> model = make();
  optim::ParamStore store(*model);
  optim::SGD opt(store, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01});
  store.zero_grad();
  std::vector<std::int64_t> items;
  std::int64_t start = 0, total = 0;
  for (std::int64_t n : split) {
    items.push_back(model->count_loss_items(labels.slice(0, start, start + n)));
    total += items.back();
    start += n;
  }
  start = 0;
  for (std::size_t i = 0; i < split.size(); ++i) {
    const std::int64_t n = split[i];
    const double w = weighting == Weighting::Exact
                         ? static_cast<double>(items[i]) / static_cast<double>(total)
                         : 1.0 / static_cast<double>(split.size());
    nn::ModelOutput out = model->forward(inputs.slice(0, start, start + n), labels.slice(0, start, start + n));
    GradWeightGuard guard(w);
    out.loss.backward();
    start += n;
  }
  StepResult r;
  for (const auto& e : store.entries()) {
    if (!e.frozen) r.grads.emplace_back(e.name, store.grad_of(e).clone());
  }
  opt.step();
  for (const auto& e : store.entries()) r.weights.emplace_back(e.name, store.weight_of(e).clone());
  return r;
}

std::string split_name(const std::vector<std::int64_t>& split) {
  std::string s;
  for (std::size_t i = 0; i < split.size(); ++i) {
    if (i > 0) s += '+';
    s += std::to_string(split[i]);
  }
  return s;
}

AccumulationCase compare(const std::string& model, const std::vector<std::int64_t>& split,
                         const StepResult& full, const StepResult& parts) {
  AccumulationCase c{model, split_name(split), {}, {}, 0.0, 0.0, -1.0};
  for (std::size_t i = 0; i < full.grads.size(); ++i) {
    double g = max_relative_difference(parts.grads[i].second, full.grads[i].second);
    double w = max_relative_difference(parts.weights[i].second, full.weights[i].second);
    c.gradients.push_back({full.grads[i].first, g});
    c.weights.push_back({full.weights[i].first, w});
    c.max_gradient = std::max(c.max_gradient, g);
    c.max_weight = std::max(c.max_weight, w);
  }
  return c;
}

}  // namespace

double max_relative_difference(const Tensor& a, const Tensor& b) {
  MB_CHECK(a.shape() == b.shape(), "[max_relative_difference] shapes differ: {} vs {}", shape_str(a.shape()),
           shape_str(b.shape()));
  std::vector<double> x = a.to_vector(), y = b.to_vector();
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    diff = std::max(diff, std::abs(x[i] - y[i]));
    scale = std::max(scale, std::abs(y[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

double accumulation_tolerance(DType dtype) { return dtype == DType::f64 ? 1e-12 : 1e-6; }

std::vector<AccumulationCase> check_accumulation(AccumulationCheckOptions options) {
  std::vector<AccumulationCase> cases;
  const DType dt = options.dtype;

  // Classification: 12 samples, even and uneven splits; three are labelled ignore_index (-100) and
  // carry no loss, so the micro-batches' shares of the window differ from their sizes.
  {
    auto make = [&] {
      manual_seed(options.seed);
      auto m = std::make_unique<nn::MLP>(nn::MLPConfig{.in_features = 20, .hidden = {32, 16}, .num_classes = 5});
      m->to(dt);
      return std::unique_ptr<nn::Model>(std::move(m));
    };
    manual_seed(options.seed + 1);
    Tensor x = randn({12, 20}, {.dtype = dt});
    Tensor y = (rand({12}) * 5.0).to(DType::i64);
    std::vector<double> ignored(12, 0.0);
    for (int i : {1, 6, 7}) ignored[i] = 1.0;
    y = masked_fill(y, from_vector(ignored, {12}, {.dtype = DType::boolean}), -100.0);
    StepResult full = run_step(make, x, y, {12}, Weighting::Exact);
    for (auto split : std::vector<std::vector<std::int64_t>>{{4, 4, 4}, {5, 5, 2}, {1, 11}}) {
      cases.push_back(compare("mlp", split, full, run_step(make, x, y, split, Weighting::Exact)));
    }
  }

  // Tokens: 6 sequences of 8 with different amounts of padding (ignore_index) per sequence.
  {
    nn::GPTConfig cfg{.vocab_size = 11, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16};
    auto make = [&] {
      manual_seed(options.seed);
      auto m = std::make_unique<nn::GPT>(cfg);
      m->to(dt);
      return std::unique_ptr<nn::Model>(std::move(m));
    };
    manual_seed(options.seed + 2);
    Tensor x = (rand({6, 8}) * 11.0).to(DType::i64);
    Tensor y = (rand({6, 8}) * 11.0).to(DType::i64);
    const std::int64_t real_tokens[6] = {8, 2, 5, 8, 1, 6};  // the rest of each row is padding
    std::vector<double> mask(48);
    for (int r = 0; r < 6; ++r)
      for (int t = 0; t < 8; ++t) mask[r * 8 + t] = t >= real_tokens[r] ? 1.0 : 0.0;
    y = masked_fill(y, from_vector(mask, {6, 8}, {.dtype = DType::boolean}), -100.0);
    StepResult full = run_step(make, x, y, {6}, Weighting::Exact);
    for (auto split : std::vector<std::vector<std::int64_t>>{{2, 2, 2}, {4, 2}, {1, 1, 1, 1, 1, 1}}) {
      AccumulationCase c = compare("gpt", split, full, run_step(make, x, y, split, Weighting::Exact));
      StepResult naive = run_step(make, x, y, split, Weighting::NaiveMean);
      c.naive_max_gradient = compare("gpt", split, full, naive).max_gradient;
      cases.push_back(std::move(c));
    }
  }
  return cases;
}

}  // namespace microbatch::train
