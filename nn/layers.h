// Layers, initialized as PyTorch initializes them by default, with their parameters on the
// default device (DeviceScope in nn/module.h).
#pragma once

#include <initializer_list>
#include <memory>
#include <vector>

#include "nn/module.h"

namespace microbatch::nn {

/// In place, not recorded: uniform in [lo, hi) / normal(mean, std), from the default generator
/// (drawn on the CPU for any device; a meta tensor is left alone and draws nothing).
void uniform_(Tensor& t, double lo, double hi);
void normal_(Tensor& t, double mean, double std);

struct LinearOptions {
  bool bias = true;
  DType dtype = DType::f32;
};

/// y = x W^T + b; W (out, in) and b (out) ~ U(-1/sqrt(in), 1/sqrt(in)) as torch.nn.Linear.
class Linear : public Layer {
 public:
  Linear(std::int64_t in_features, std::int64_t out_features, LinearOptions options = {});
  Tensor forward(const Tensor& x) override;
  Tensor weight;  // (out, in)
  Tensor bias;    // (out) or undefined
};

/// Rows of a (num_embeddings, dim) table ~ N(0, 1), as torch.nn.Embedding.
class Embedding : public Layer {
 public:
  Embedding(std::int64_t num_embeddings, std::int64_t dim, DType dtype = DType::f32);
  Tensor forward(const Tensor& indices) override;
  Tensor weight;  // (num_embeddings, dim)
};

class LayerNorm : public Layer {
 public:
  explicit LayerNorm(std::int64_t dim, double eps = 1e-5, DType dtype = DType::f32);
  Tensor forward(const Tensor& x) override;
  Tensor weight;  // (dim), ones
  Tensor bias;    // (dim), zeros
  double eps;
};

/// Active only in training mode.
class Dropout : public Layer {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& x) override;
  double p;
};

class ReLU : public Layer {
 public:
  Tensor forward(const Tensor& x) override { return relu(x); }
};
class GELU : public Layer {
 public:
  explicit GELU(GeluApproximate approximate = GeluApproximate::None) : approximate(approximate) {}
  Tensor forward(const Tensor& x) override { return gelu(x, approximate); }
  GeluApproximate approximate;
};
class Tanh : public Layer {
 public:
  Tensor forward(const Tensor& x) override { return tanh(x); }
};
class SiLU : public Layer {
 public:
  Tensor forward(const Tensor& x) override { return silu(x); }
};

/// Flattens dims start_dim.. into one (default: all but the batch dim).
class Flatten : public Layer {
 public:
  explicit Flatten(std::int64_t start_dim = 1) : start_dim(start_dim) {}
  Tensor forward(const Tensor& x) override { return x.flatten(start_dim); }
  std::int64_t start_dim;
};

struct Conv2dLayerOptions {
  std::int64_t stride = 1;
  std::int64_t padding = 0;
  bool bias = true;
};

/// 2-d convolution; weight (out, in, k, k) and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
class Conv2d : public Layer {
 public:
  Conv2d(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel_size,
         Conv2dLayerOptions options = {});
  Tensor forward(const Tensor& x) override;
  Tensor weight;  // (out, in, k, k)
  Tensor bias;    // (out) or undefined
  Conv2dOptions conv;
};

class MaxPool2d : public Layer {
 public:
  explicit MaxPool2d(MaxPool2dOptions options) : options(options) {}
  Tensor forward(const Tensor& x) override { return max_pool2d(x, options); }
  MaxPool2dOptions options;
};

/// Layers applied in order; children are named "0", "1", ...
class Sequential : public Layer {
 public:
  Sequential() = default;
  explicit Sequential(std::vector<std::shared_ptr<Layer>> layers);
  void push_back(std::shared_ptr<Layer> layer);
  Tensor forward(const Tensor& x) override;
  std::size_t size() const { return layers_.size(); }
  Layer& operator[](std::size_t i) { return *layers_.at(i); }
  /// In training, runs the layers as `segments` checkpointed segments of about equal length, so only
  /// each segment's input is kept for backward (0 or 1: no checkpointing).
  void set_checkpoint_segments(std::int64_t segments);
  std::int64_t checkpoint_segments() const { return checkpoint_segments_; }

 private:
  std::vector<std::shared_ptr<Layer>> layers_;
  std::int64_t checkpoint_segments_ = 0;
};

}  // namespace microbatch::nn
