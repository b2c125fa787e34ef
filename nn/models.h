// Models that return a loss and logits, as Hugging Face models do: MLP and CNN for 28x28 images,
// and a GPT (GPT-2 architecture) for text.
#pragma once

#include <memory>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "nn/layers.h"

namespace microbatch::nn {

/// What a model's forward returns; loss is undefined when no labels were given.
struct ModelOutput {
  Tensor loss;    // () mean over the loss-bearing items of the batch
  Tensor logits;  // (N, classes) or (B, T, vocab)
};

/// A model trained by the framework: forward with optional labels, and a loss-item count.
class Model : public Module {
 public:
  virtual ModelOutput forward(const Tensor& inputs, const Tensor& labels = {}) = 0;
  ModelOutput operator()(const Tensor& inputs, const Tensor& labels = {}) { return forward(inputs, labels); }
  /// The label that carries no loss (torch's ignore_index): -100 unless the model says otherwise.
  /// The Trainer pads token labels with it and counts every other label as a loss-bearing item.
  virtual std::int64_t ignore_index() const { return -100; }
  /// Items that carry loss in `labels` (samples or tokens != ignore_index()): the weight of a
  /// micro-batch in an accumulation window is its share of these.
  virtual std::int64_t count_loss_items(const Tensor& labels) const;
  /// Recompute activations in backward instead of keeping them (trades compute for memory).
  virtual void set_gradient_checkpointing(bool on) = 0;
  virtual bool gradient_checkpointing() const = 0;
  /// What makes the model's weights mean what they mean, beyond their shapes: its kind and the
  /// settings that change the function the weights compute or the loss they were trained on
  /// ({"model": "gpt", "n_head": 12, ...}; not dropout or checkpointing). The Trainer records it
  /// in every checkpoint and refuses to resume a model that says otherwise. Null for a model that
  /// does not say (the default): such a checkpoint is resumed on the weights' shapes alone.
  virtual nlohmann::json architecture() const;

 protected:
  /// The entries of integer `labels` other than ignore_index.
  static std::int64_t count_not_ignored(const Tensor& labels, std::int64_t ignore_index);
};

struct MLPConfig {
  std::int64_t in_features = 784;
  std::vector<std::int64_t> hidden = {256, 128};
  std::int64_t num_classes = 10;
  double dropout = 0.0;
  /// Throws microbatch::Error naming the first size < 1 or a dropout outside [0, 1).
  void validate() const;
};

/// Flatten -> [Linear -> ReLU -> Dropout] per hidden width -> Linear; cross-entropy loss.
class MLP : public Model {
 public:
  explicit MLP(MLPConfig config = {});
  ModelOutput forward(const Tensor& inputs, const Tensor& labels = {}) override;
  /// Runs the layers as checkpointed segments of about sqrt(layers) layers each.
  void set_gradient_checkpointing(bool on) override;
  bool gradient_checkpointing() const override { return net->checkpoint_segments() > 1; }
  nlohmann::json architecture() const override;
  MLPConfig config;
  std::shared_ptr<Sequential> net;
};

struct CNNConfig {
  std::int64_t in_channels = 1;
  std::int64_t channels1 = 32;
  std::int64_t channels2 = 64;
  std::int64_t hidden = 128;
  std::int64_t num_classes = 10;
  std::int64_t image_size = 28;  // at least 4: two 2x2 poolings
  double dropout = 0.0;
  /// Throws microbatch::Error naming the first size out of range or a dropout outside [0, 1).
  void validate() const;
};

/// conv3x3 -> ReLU -> pool2 -> conv3x3 -> ReLU -> pool2 -> Linear -> ReLU -> Linear.
class CNN : public Model {
 public:
  explicit CNN(CNNConfig config = {});
  ModelOutput forward(const Tensor& inputs, const Tensor& labels = {}) override;
  /// Runs the layers as four checkpointed segments.
  void set_gradient_checkpointing(bool on) override;
  bool gradient_checkpointing() const override { return net->checkpoint_segments() > 1; }
  nlohmann::json architecture() const override;
  CNNConfig config;
  std::shared_ptr<Sequential> net;
};

struct GPTConfig {
  std::int64_t vocab_size = 65;
  std::int64_t block_size = 128;  // longest sequence
  std::int64_t n_layer = 4;
  std::int64_t n_head = 4;
  std::int64_t n_embd = 128;
  double dropout = 0.0;
  bool gradient_checkpointing = false;  // recompute each block in backward
  std::int64_t ignore_index = -100;

  /// GPT-2 small (124M): the 50257-token vocabulary, 1024 positions, 12 layers of 12 heads, 768 wide,
  /// the head tied to the token embedding: 124,439,808 parameters.
  static GPTConfig gpt2_small();
  /// Throws microbatch::Error naming the first size < 1, an n_embd not divisible by n_head, or a
  /// dropout outside [0, 1).
  void validate() const;
  /// The parameters GPT(config) has, computed in double (no overflow for any sizes):
  /// V C + T C + L (12 C^2 + 13 C) + 2 C, the head tied to the token embedding.
  double parameter_count() const;
};

class CausalSelfAttention : public Module {
 public:
  explicit CausalSelfAttention(const GPTConfig& config);
  Tensor forward(const Tensor& x);  // (B, T, C) -> (B, T, C)
  std::shared_ptr<Linear> c_attn;  // (3C, C)
  std::shared_ptr<Linear> c_proj;  // (C, C)
  std::int64_t n_head;
  double dropout;
};

class Block : public Module {
 public:
  explicit Block(const GPTConfig& config);
  Tensor forward(const Tensor& x);  // (B, T, C) -> (B, T, C)
  std::shared_ptr<LayerNorm> ln_1, ln_2;
  std::shared_ptr<CausalSelfAttention> attn;
  std::shared_ptr<Linear> c_fc;    // (4C, C)
  std::shared_ptr<Linear> c_proj;  // (C, 4C)
  std::shared_ptr<Dropout> drop;
};

/// GPT-2: token + position embeddings, pre-LayerNorm blocks, final LayerNorm, head tied to wte.
/// Initialized as GPT-2 (normal 0.02, residual projections 0.02 / sqrt(2 n_layer), zero biases).
class GPT : public Model {
 public:
  explicit GPT(GPTConfig config = {});
  /// inputs (B, T) token ids; labels (B, T) next-token ids or ignore_index.
  ModelOutput forward(const Tensor& inputs, const Tensor& labels = {}) override;
  std::int64_t ignore_index() const override { return config.ignore_index; }
  /// Recomputes each block in backward.
  void set_gradient_checkpointing(bool on) override { config.gradient_checkpointing = on; }
  bool gradient_checkpointing() const override { return config.gradient_checkpointing; }
  nlohmann::json architecture() const override;
  GPTConfig config;
  std::shared_ptr<Embedding> wte, wpe;
  std::vector<std::shared_ptr<Block>> blocks;
  std::shared_ptr<LayerNorm> ln_f;
  std::shared_ptr<Dropout> drop;
};

}  // namespace microbatch::nn
