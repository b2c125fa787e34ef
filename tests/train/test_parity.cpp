// Parity with PyTorch: the same initial weights and batches as scripts/make_parity_fixtures.py
// (torch 1.13) give the same micro-batch losses for 20 AdamW steps with exact accumulation, and the
// same gradients after the first window.
#include <algorithm>
#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "nn/models.h"
#include "optim/optimizer.h"
#include "tests/core/harness.h"
#include "train/accumulation_check.h"

using namespace microbatch;
using namespace microbatch::testing;

namespace {


std::int64_t loss_items(const Tensor& labels) {
  if (labels.dim() == 1) return labels.shape()[0];
  return static_cast<std::int64_t>(sum(ne(labels, scalar_tensor(-100, {.dtype = DType::i64})).to(DType::i64)).item());
}

void check_parity(const std::string& name, nn::Model& model) {
  const std::string dir = MB_FIXTURES_DIR;
  SafetensorsFile file = load_safetensors(dir + "/parity_" + name + ".safetensors");
  std::ifstream in(dir + "/parity_" + name + ".json");
  REQUIRE(in.good());
  nlohmann::json ref = nlohmann::json::parse(in);
  const std::vector<double> expected_losses = ref["losses"].get<std::vector<double>>();
  const std::vector<std::int64_t> split = ref["split"].get<std::vector<std::int64_t>>();

  nn::StateDict init;
  for (auto& [key, t] : file.tensors)
    if (key.rfind("init.", 0) == 0) init[key.substr(5)] = t;
  model.load_state_dict(init);
  optim::ParamStore store(model);
  optim::AdamW opt(store, {.lr = ref["lr"].get<double>(), .weight_decay = ref["weight_decay"].get<double>()});

  std::vector<double> losses;
  for (int step = 0; step < ref["steps"].get<int>(); ++step) {
    Tensor x = file.tensors.at(fmt::format("batch.{}.inputs", step));
    Tensor y = file.tensors.at(fmt::format("batch.{}.labels", step));
    const std::int64_t total = loss_items(y);
    std::int64_t start = 0;
    opt.zero_grad();
    for (std::int64_t n : split) {
      Tensor xs = x.slice(0, start, start + n), ys = y.slice(0, start, start + n);
      nn::ModelOutput out = model(xs, ys);
      GradWeightGuard weight(static_cast<double>(loss_items(ys)) / static_cast<double>(total));
      out.loss.backward();
      losses.push_back(out.loss.item());
      start += n;
    }
    if (step == 0) {
      for (const auto& e : store.entries()) {
        const double rel = train::max_relative_difference(store.grad_of(e), file.tensors.at("grad1." + e.name));
        CHECK_MESSAGE(rel <= 1e-5, name << " gradient of " << e.name << " after step 1: relative difference " << rel);
      }
    }
    opt.step();
  }
  REQUIRE(losses.size() == expected_losses.size());
  double worst = 0;
  for (std::size_t i = 0; i < losses.size(); ++i) {
    const double rel = std::abs(losses[i] - expected_losses[i]) / std::abs(expected_losses[i]);
    worst = std::max(worst, rel);
    CHECK_MESSAGE(rel <= 1e-4, name << " micro-batch " << i << ": loss " << losses[i] << " vs torch "
                                    << expected_losses[i]);
  }
  MESSAGE(name << ": " << losses.size() << " losses within " << worst << " (relative) of PyTorch");
}

}  // namespace

TEST_CASE("MLP matches PyTorch for 20 AdamW steps with accumulation") {
  nn::MLP model({.in_features = 20, .hidden = {32, 16}, .num_classes = 5});
  check_parity("mlp", model);
}

TEST_CASE("2-layer GPT matches PyTorch for 20 AdamW steps with accumulation over padded batches") {
  nn::GPT model({.vocab_size = 17, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16});
  check_parity("gpt", model);
}
