#include "nn/models.h"

#include <cmath>

#include <nlohmann/json.hpp>

namespace microbatch::nn {

nlohmann::json Model::architecture() const { return nullptr; }

nlohmann::json MLP::architecture() const {
  return {{"model", "mlp"},
          {"in_features", config.in_features},
          {"hidden", config.hidden},
          {"num_classes", config.num_classes}};
}

nlohmann::json CNN::architecture() const {
  return {{"model", "cnn"},           {"in_channels", config.in_channels},
          {"channels1", config.channels1}, {"channels2", config.channels2},
          {"hidden", config.hidden},   {"num_classes", config.num_classes},
          {"image_size", config.image_size}};
}

// n_head and ignore_index are what the weights' shapes do not show: the same weights split into
// other heads compute another function, and another ignored label trains on other items.
nlohmann::json GPT::architecture() const {
  return {{"model", "gpt"},
          {"vocab_size", config.vocab_size},
          {"block_size", config.block_size},
          {"n_layer", config.n_layer},
          {"n_head", config.n_head},
          {"n_embd", config.n_embd},
          {"ignore_index", config.ignore_index}};
}

std::int64_t Model::count_not_ignored(const Tensor& labels, std::int64_t ignore_index) {
  const Tensor ignored =
      scalar_tensor(static_cast<double>(ignore_index), {.dtype = labels.dtype(), .device = labels.device()});
  return static_cast<std::int64_t>(sum(ne(labels, ignored).to(DType::i64)).item());
}

std::int64_t Model::count_loss_items(const Tensor& labels) const {
  // Class indices equal to the loss's ignore_index (-100 for classify, a GPT's own) carry no loss,
  // as torch's cross_entropy and Hugging Face's token counts treat them; soft (floating) labels all
  // do.
  if (is_integer(labels.dtype())) return count_not_ignored(labels, ignore_index());
  return labels.dim() == 0 ? 1 : labels.shape()[0];
}

namespace {
void check_size(const char* model, const char* name, std::int64_t value) {
  MB_CHECK(value >= 1, "[{}] {} must be >= 1, got {}", model, name, value);
}
// A dropout of 1 zeroes every activation: nothing could be learned.
void check_dropout(const char* model, double p) {
  MB_CHECK(p >= 0.0 && p < 1.0, "[{}] dropout must be in [0, 1), got {}", model, p);
}
}  // namespace

// ---- MLP ---------------------------------------------------------------------------------------

void MLPConfig::validate() const {
  check_size("MLP", "in_features", in_features);
  for (std::int64_t h : hidden) check_size("MLP", "every hidden width", h);
  check_size("MLP", "num_classes", num_classes);
  check_dropout("MLP", dropout);
}

MLP::MLP(MLPConfig cfg) : config(std::move(cfg)) {
  config.validate();
  net = register_module("net", std::make_shared<Sequential>());
  net->push_back(std::make_shared<Flatten>());
  std::int64_t width = config.in_features;
  for (std::int64_t h : config.hidden) {
    net->push_back(std::make_shared<Linear>(width, h));
    net->push_back(std::make_shared<ReLU>());
    if (config.dropout > 0) net->push_back(std::make_shared<Dropout>(config.dropout));
    width = h;
  }
  net->push_back(std::make_shared<Linear>(width, config.num_classes));
}

namespace {
// The loss of 16-bit logits is returned in f32 (Note [Mixed precision] in optim/param_store.h): the
// loss-scaled loss must not overflow, and a logged loss should not be rounded to 16 bits. The
// cross-entropy kernels read the 16-bit logits and compute in f32, so no f32 copy of the logits
// (or of their gradient) is made: at GPT-2's (8192, 50257) logits that is 3.3 GB less.
CrossEntropyOptions loss_options(const Tensor& logits, std::int64_t ignore_index = -100) {
  CrossEntropyOptions options;
  options.ignore_index = ignore_index;
  if (is_16bit_float(logits.dtype())) options.loss_dtype = DType::f32;
  return options;
}

ModelOutput classify(Sequential& net, const Tensor& inputs, const Tensor& labels) {
  ModelOutput out;
  out.logits = net.forward(inputs);
  if (labels.defined()) out.loss = cross_entropy(out.logits, labels, loss_options(out.logits));
  return out;
}
}  // namespace

ModelOutput MLP::forward(const Tensor& inputs, const Tensor& labels) { return classify(*net, inputs, labels); }

namespace {
std::int64_t sqrt_segments(std::size_t layers) {
  return std::max<std::int64_t>(2, std::llround(std::sqrt(static_cast<double>(layers))));
}
}  // namespace

void MLP::set_gradient_checkpointing(bool on) { net->set_checkpoint_segments(on ? sqrt_segments(net->size()) : 0); }
// Four segments, about one per conv block: three (the sqrt rule) leaves the peak where it was.
void CNN::set_gradient_checkpointing(bool on) { net->set_checkpoint_segments(on ? 4 : 0); }

// ---- CNN ---------------------------------------------------------------------------------------

void CNNConfig::validate() const {
  check_size("CNN", "in_channels", in_channels);
  check_size("CNN", "channels1", channels1);
  check_size("CNN", "channels2", channels2);
  check_size("CNN", "hidden", hidden);
  check_size("CNN", "num_classes", num_classes);
  MB_CHECK(image_size >= 4, "[CNN] image_size must be >= 4 (two 2x2 poolings), got {}", image_size);
  check_dropout("CNN", dropout);
}

CNN::CNN(CNNConfig cfg) : config(cfg) {
  config.validate();
  net = register_module("net", std::make_shared<Sequential>());
  net->push_back(std::make_shared<Conv2d>(config.in_channels, config.channels1, 3, Conv2dLayerOptions{.padding = 1}));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<MaxPool2d>(MaxPool2dOptions{.kernel_size = 2}));
  net->push_back(std::make_shared<Conv2d>(config.channels1, config.channels2, 3, Conv2dLayerOptions{.padding = 1}));
  net->push_back(std::make_shared<ReLU>());
  net->push_back(std::make_shared<MaxPool2d>(MaxPool2dOptions{.kernel_size = 2}));
  net->push_back(std::make_shared<Flatten>());
  const std::int64_t side = config.image_size / 4;
  net->push_back(std::make_shared<Linear>(config.channels2 * side * side, config.hidden));
  net->push_back(std::make_shared<ReLU>());
  if (config.dropout > 0) net->push_back(std::make_shared<Dropout>(config.dropout));
  net->push_back(std::make_shared<Linear>(config.hidden, config.num_classes));
}

ModelOutput CNN::forward(const Tensor& inputs, const Tensor& labels) {
  Tensor x = inputs.dim() == 3 ? inputs.unsqueeze(1) : inputs;  // (N, 28, 28) -> (N, 1, 28, 28)
  return classify(*net, x, labels);
}

// ---- GPT ---------------------------------------------------------------------------------------

GPTConfig GPTConfig::gpt2_small() {
  return {.vocab_size = 50257, .block_size = 1024, .n_layer = 12, .n_head = 12, .n_embd = 768};
}

void GPTConfig::validate() const {
  check_size("GPT", "vocab_size", vocab_size);
  check_size("GPT", "block_size", block_size);
  check_size("GPT", "n_layer", n_layer);
  check_size("GPT", "n_head", n_head);
  check_size("GPT", "n_embd", n_embd);
  MB_CHECK(n_embd % n_head == 0, "[GPT] n_embd {} is not divisible by n_head {}", n_embd, n_head);
  check_dropout("GPT", dropout);
}

double GPTConfig::parameter_count() const {
  const double v = static_cast<double>(vocab_size), t = static_cast<double>(block_size),
               l = static_cast<double>(n_layer), c = static_cast<double>(n_embd);
  // Per block: two layer norms (4C), c_attn (3C^2 + 3C), c_proj (C^2 + C), c_fc (4C^2 + 4C) and
  // the MLP's c_proj (4C^2 + C); then ln_f (2C).
  return v * c + t * c + l * (12.0 * c * c + 13.0 * c) + 2.0 * c;
}

CausalSelfAttention::CausalSelfAttention(const GPTConfig& config)
    : n_head(config.n_head), dropout(config.dropout) {
  config.validate();
  c_attn = register_module("c_attn", std::make_shared<Linear>(config.n_embd, 3 * config.n_embd));
  c_proj = register_module("c_proj", std::make_shared<Linear>(config.n_embd, config.n_embd));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  const std::int64_t B = x.shape()[0], T = x.shape()[1], C = x.shape()[2], D = C / n_head;
  const std::vector<Tensor> qkv = split(c_attn->forward(x), C, 2);  // 3 x (B, T, C)
  auto head = [&](int i) {                                            // (B, H, T, D)
    return qkv[i].reshape({B, T, n_head, D}).transpose(1, 2);
  };
  Tensor y = scaled_dot_product_attention(
      head(0), head(1), head(2),
      {.causal = true, .dropout_p = is_training() ? dropout : 0.0, .scale = std::nullopt});  // 1 / sqrt(D)
  y = y.transpose(1, 2).reshape({B, T, C});
  return c_proj->forward(y);
}

Block::Block(const GPTConfig& config) {
  ln_1 = register_module("ln_1", std::make_shared<LayerNorm>(config.n_embd));
  attn = register_module("attn", std::make_shared<CausalSelfAttention>(config));
  ln_2 = register_module("ln_2", std::make_shared<LayerNorm>(config.n_embd));
  c_fc = register_module("c_fc", std::make_shared<Linear>(config.n_embd, 4 * config.n_embd));
  c_proj = register_module("c_proj", std::make_shared<Linear>(4 * config.n_embd, config.n_embd));
  drop = register_module("drop", std::make_shared<Dropout>(config.dropout));
}

Tensor Block::forward(const Tensor& x) {
  Tensor h = x + drop->forward(attn->forward(ln_1->forward(x)));
  // c_proj(gelu(c_fc(.))) as one op: on CUDA its GEMMs apply GELU and its derivative in their
  // epilogues (Note [MLP in GEMM epilogues] in core/ops/linalg.cpp).
  Tensor m = gelu_mlp(ln_2->forward(h), c_fc->weight, c_fc->bias, c_proj->weight, c_proj->bias);
  return h + drop->forward(m);
}

GPT::GPT(GPTConfig cfg) : config(cfg) {
  config.validate();
  wte = register_module("wte", std::make_shared<Embedding>(config.vocab_size, config.n_embd));
  wpe = register_module("wpe", std::make_shared<Embedding>(config.block_size, config.n_embd));
  drop = register_module("drop", std::make_shared<Dropout>(config.dropout));
  for (std::int64_t i = 0; i < config.n_layer; ++i) {
    blocks.push_back(register_module("h." + std::to_string(i), std::make_shared<Block>(config)));
  }
  ln_f = register_module("ln_f", std::make_shared<LayerNorm>(config.n_embd));
  // GPT-2 initialization.
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config.n_layer));
  normal_(wte->weight, 0.0, 0.02);
  normal_(wpe->weight, 0.0, 0.02);
  for (auto& b : blocks) {
    normal_(b->attn->c_attn->weight, 0.0, 0.02);
    normal_(b->attn->c_proj->weight, 0.0, residual_std);
    normal_(b->c_fc->weight, 0.0, 0.02);
    normal_(b->c_proj->weight, 0.0, residual_std);
    for (Tensor* bias : {&b->attn->c_attn->bias, &b->attn->c_proj->bias, &b->c_fc->bias, &b->c_proj->bias}) {
      NoGradGuard no_grad;
      bias->zero_();
    }
  }
}

ModelOutput GPT::forward(const Tensor& inputs, const Tensor& labels) {
  MB_CHECK(inputs.dim() == 2, "[GPT] inputs must be (B, T) token ids, got {}", shape_str(inputs.shape()));
  const std::int64_t B = inputs.shape()[0], T = inputs.shape()[1];
  MB_CHECK(T <= config.block_size, "[GPT] sequence length {} exceeds block_size {}", T, config.block_size);
  Tensor pos = arange(0, static_cast<double>(T), 1, {.dtype = DType::i64, .device = inputs.device()});
  Tensor x = drop->forward(wte->forward(inputs) + wpe->forward(pos));  // (B, T, C)
  for (auto& block : blocks) {
    if (config.gradient_checkpointing && is_training()) {
      x = checkpoint([block](const Tensor& h) { return block->forward(h); }, x);
    } else {
      x = block->forward(x);
    }
  }
  x = ln_f->forward(x);
  ModelOutput out;
  out.logits = linear(x, wte->weight);  // (B, T, V), the head tied to the token embedding
  if (labels.defined()) {
    MB_CHECK(labels.shape() == inputs.shape(), "[GPT] labels {} must match inputs {}",
             shape_str(labels.shape()), shape_str(inputs.shape()));
    out.loss = cross_entropy(out.logits.reshape({B * T, config.vocab_size}), labels.reshape({B * T}),
                             loss_options(out.logits, config.ignore_index));
  }
  return out;
}

}  // namespace microbatch::nn
