#include <cmath>

#include "nn/models.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;
using namespace microbatch::nn;

TEST_CASE("Linear: PyTorch's default init bounds, forward, parameter names") {
  manual_seed(3);
  Linear lin(16, 4);
  const double bound = 1.0 / 4.0;
  for (double v : lin.weight.to_vector()) CHECK(std::abs(v) <= bound);
  for (double v : lin.bias.to_vector()) CHECK(std::abs(v) <= bound);
  auto named = lin.named_parameters();
  REQUIRE(named.size() == 2);
  CHECK(named[0].first == "weight");
  CHECK(named[1].first == "bias");
  Tensor x = randn({3, 16});
  check_close(lin(x), matmul(x, lin.weight.t()) + lin.bias, 1e-6, 1e-6, "linear forward");
}

TEST_CASE("Sequential names children by index and MLP counts its parameters") {
  MLP mlp({.in_features = 10, .hidden = {8, 6}, .num_classes = 3});
  auto named = mlp.named_parameters();
  REQUIRE(named.size() == 6);
  CHECK(named[0].first == "net.1.weight");
  CHECK(named[5].first == "net.5.bias");
  CHECK(mlp.num_parameters() == 10 * 8 + 8 + 8 * 6 + 6 + 6 * 3 + 3);
}

TEST_CASE("state_dict round trip and load errors") {
  manual_seed(1);
  MLP a({.in_features = 5, .hidden = {4}, .num_classes = 2});
  manual_seed(2);
  MLP b({.in_features = 5, .hidden = {4}, .num_classes = 2});
  b.load_state_dict(a.state_dict());
  for (auto& [name, t] : a.state_dict()) check_close(b.state_dict().at(name), t, 0, 0, name);
  StateDict missing = a.state_dict();
  missing.erase("net.1.bias");
  check_throws_with([&] { b.load_state_dict(missing); }, "[load_state_dict] missing key 'net.1.bias'");
  b.load_state_dict(missing, LoadMode::NonStrict);
  StateDict extra = a.state_dict();
  extra["bogus"] = zeros({1});
  check_throws_with([&] { b.load_state_dict(extra); }, "unexpected key 'bogus'");
  StateDict wrong = a.state_dict();
  wrong["net.1.weight"] = zeros({3, 3});
  check_throws_with([&] { b.load_state_dict(wrong); }, "'net.1.weight' has shape (3, 3), the model expects (4, 5)");
  wrong = a.state_dict();
  wrong["net.1.bias"] = Tensor();
  check_throws_with([&] { b.load_state_dict(wrong); }, "[load_state_dict] 'net.1.bias' is an undefined tensor");
  wrong["net.1.bias"] = empty({4}, {.device = kMeta});
  check_throws_with([&] { b.load_state_dict(wrong); }, "'net.1.bias' is on the meta device");
}

TEST_CASE("layers refuse sizes and probabilities torch.nn refuses when they are made") {
  check_throws_with([] { Dropout(1.5); }, "[Dropout] p must be in [0, 1], got 1.5");
  check_throws_with([] { Dropout(-0.1); }, "[Dropout] p must be in [0, 1], got -0.1");
  Dropout all(1.0);  // as torch: p = 1 zeroes everything in training
  CHECK(sum(all.forward(ones({4}))).item() == 0.0);
  check_throws_with([] { LayerNorm(0); }, "[LayerNorm] the normalized size must be positive, got 0");
  check_throws_with([] { LayerNorm(-1); }, "[LayerNorm] the normalized size must be positive, got -1");
}

TEST_CASE("GPTConfig::parameter_count is the model's count, for sizes no model could have too") {
  for (const GPTConfig& cfg : {GPTConfig{.vocab_size = 11, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16},
                               GPTConfig{.vocab_size = 65, .block_size = 64, .n_layer = 3, .n_head = 4, .n_embd = 24}}) {
    CHECK(cfg.parameter_count() == static_cast<double>(GPT(cfg).num_parameters()));
  }
  CHECK(GPTConfig::gpt2_small().parameter_count() == 124439808.0);
  const GPTConfig huge{.vocab_size = 65, .block_size = 16, .n_layer = 4294967297, .n_head = 2, .n_embd = 16};
  CHECK(huge.parameter_count() > 1e13);  // computed without building or overflowing anything
}

TEST_CASE("MLP counts only the labels that carry loss") {
  // Samples labelled -100 carry no loss in cross_entropy, so they do not count toward a
  // micro-batch's share of an accumulation window (the certificate's MLP case has such labels).
  MLP m({.in_features = 3, .hidden = {4}, .num_classes = 3});
  CHECK(m.count_loss_items(from_vector({-100, 0, 1, 2}, {4}, {.dtype = DType::i64})) == 3);
  CHECK(m.count_loss_items(from_vector({-100, -100}, {2}, {.dtype = DType::i64})) == 0);
  CHECK(m.count_loss_items(from_vector({0.2, 0.8, 0.5, 0.5}, {2, 2})) == 2);  // soft labels
}

TEST_CASE("Module::to casts parameters, which stay trainable leaves") {
  MLP m({.in_features = 5, .hidden = {4}, .num_classes = 2});
  m.to(DType::f64);
  for (auto& [name, t] : m.named_parameters()) {
    CHECK(t.dtype() == DType::f64);
    CHECK(t.requires_grad());
    CHECK(t.is_leaf());
  }
  Tensor x = randn({3, 5}, {.dtype = DType::f64});
  auto out = m(x, from_vector({0, 1, 1}, {3}, {.dtype = DType::i64}));
  out.loss.backward();
  for (auto& [name, t] : m.named_parameters()) CHECK(t.grad().defined());
  // The gradients move with their parameters, as torch's Module.to moves param.grad.
  const std::vector<double> before = m.named_parameters().front().second.grad().to_vector();
  m.to(DType::f32);
  for (auto& [name, t] : m.named_parameters()) {
    CAPTURE(name);
    REQUIRE(t.grad().defined());
    CHECK(t.grad().dtype() == DType::f32);
  }
  check_close(m.named_parameters().front().second.grad(), before, 1e-6, 1e-7, "moved gradient");
}

TEST_CASE("Module::to keeps a frozen parameter frozen") {
  MLP m({.in_features = 5, .hidden = {4}, .num_classes = 2});
  m.named_parameters().front().second.requires_grad_(false);
  m.to(DType::f64);
  auto params = m.named_parameters();
  CHECK_FALSE(params.front().second.requires_grad());
  for (std::size_t i = 1; i < params.size(); ++i) CHECK(params[i].second.requires_grad());
}

TEST_CASE("train/eval reaches every child; dropout is off in eval") {
  MLP m({.in_features = 6, .hidden = {32}, .num_classes = 2, .dropout = 0.5});
  m.eval();
  Tensor x = randn({4, 6});
  check_close(m(x).logits, m(x).logits, 0, 0, "eval is deterministic");
  m.train();
  CHECK(m.net->is_training());
}

namespace {
// Two layers that share one weight, as a language model's head shares its embedding's.
struct TiedPair : Module {
  TiedPair() {
    first = register_module("first", std::make_shared<Linear>(3, 4));
    second = register_module("second", std::make_shared<Linear>(3, 4));
    second->weight = first->weight;
  }
  std::shared_ptr<Linear> first, second;
};
}  // namespace

TEST_CASE("load_state_dict takes a tied weight under any of its names, as torch's lists each") {
  manual_seed(3);
  TiedPair m;
  auto named = m.named_parameters();  // listed once, under its first name
  REQUIRE(named.size() == 3);
  CHECK(named[0].first == "first.weight");
  const Tensor w = full({4, 3}, 0.5), b1 = full({4}, 1.0), b2 = full({4}, 2.0);
  auto check_loaded = [&](double value) {
    check_close(m.first->weight, full({4, 3}, value), 0, 0, "the tied weight");
    CHECK(m.second->weight.same_storage(m.first->weight));
  };
  // torch's state dict: the tied tensor under both names.
  m.load_state_dict({{"first.weight", w}, {"second.weight", w}, {"first.bias", b1}, {"second.bias", b2}});
  check_loaded(0.5);
  // Under the second name alone.
  m.load_state_dict({{"second.weight", full({4, 3}, 0.25)}, {"first.bias", b1}, {"second.bias", b2}});
  check_loaded(0.25);
  check_close(m.second->bias, b2, 0, 0, "second.bias");
  // Under neither: strict mode names both.
  check_throws_with([&] { m.load_state_dict({{"first.bias", b1}, {"second.bias", b2}}); },
                    "missing key 'first.weight' or 'second.weight'");
  m.load_state_dict({{"first.bias", b1}, {"second.bias", b2}}, LoadMode::NonStrict);
  check_loaded(0.25);
  // A wrong shape under the second name is named by it.
  check_throws_with([&] {
    m.load_state_dict({{"second.weight", zeros({3, 4})}, {"first.bias", b1}, {"second.bias", b2}});
  }, "'second.weight' has shape (3, 4), the model expects (4, 3)");
  check_throws_with([&] {
    m.load_state_dict({{"first.weight", w}, {"first.bias", b1}, {"second.bias", b2}, {"third.weight", w}});
  }, "unexpected key 'third.weight'");
}

TEST_CASE("CNN and GPT forward shapes, losses near log(classes) at init") {
  manual_seed(0);
  CNN cnn({.channels1 = 4, .channels2 = 8, .hidden = 16});
  Tensor images = rand({2, 28, 28});
  auto out = cnn(images, from_vector({3, 7}, {2}, {.dtype = DType::i64}));
  CHECK(out.logits.shape() == Shape{2, 10});
  CHECK(std::abs(out.loss.item() - std::log(10.0)) < 0.5);

  GPT gpt({.vocab_size = 13, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 16});
  Tensor ids = (rand({3, 8}) * 13.0).to(DType::i64);
  auto g = gpt(ids, ids);
  CHECK(g.logits.shape() == Shape{3, 8, 13});
  CHECK(std::abs(g.loss.item() - std::log(13.0)) < 0.3);
  // The head is tied to the token embedding: listed once.
  int wte = 0;
  for (auto& [name, t] : gpt.named_parameters()) wte += name == "wte.weight";
  CHECK(wte == 1);
  check_throws_with([&] { gpt((rand({1, 9}) * 13.0).to(DType::i64)); }, "[GPT] sequence length 9 exceeds block_size 8");
}

TEST_CASE("GPT with gradient checkpointing gives the same gradients") {
  GPTConfig cfg{.vocab_size = 7, .block_size = 6, .n_layer = 2, .n_head = 2, .n_embd = 8};
  manual_seed(5);
  Tensor ids = (rand({2, 6}) * 7.0).to(DType::i64);
  auto run = [&](bool ckpt) {
    manual_seed(9);
    GPTConfig c = cfg;
    c.gradient_checkpointing = ckpt;
    GPT m(c);
    m.to(DType::f64);
    m(ids, ids).loss.backward();
    std::vector<Tensor> grads;
    for (auto& [n, t] : m.named_parameters()) grads.push_back(t.grad());
    return grads;
  };
  auto plain = run(false), ckpt = run(true);
  REQUIRE(plain.size() == ckpt.size());
  for (std::size_t i = 0; i < plain.size(); ++i) check_close(ckpt[i], plain[i], 1e-12, 1e-14, "grad");
}
