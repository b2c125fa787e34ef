#include "nn/layers.h"

#include <algorithm>
#include <cmath>

namespace microbatch::nn {

// Values are drawn on the CPU whatever the tensor's device, so that a model is the same on every
// device; a meta tensor has no values to set.
void uniform_(Tensor& t, double lo, double hi) {
  if (t.device().is_meta()) return;
  NoGradGuard no_grad;
  Tensor u = rand(t.shape(), {.dtype = DType::f64});
  t.copy_(u * (hi - lo) + lo);
}

void normal_(Tensor& t, double mean, double std) {
  if (t.device().is_meta()) return;
  NoGradGuard no_grad;
  Tensor n = randn(t.shape(), {.dtype = DType::f64});
  t.copy_(n * std + mean);
}

namespace {
// An uninitialized parameter on the default device (DeviceScope).
Tensor parameter(const Shape& shape, DType dtype) {
  return empty(shape, {.dtype = dtype, .device = default_device()});
}

// A parameter filled with `value` on the default device: filled on the CPU, then copied, since
// devices other than the CPU need not fill with anything but zero.
Tensor filled_parameter(const Shape& shape, double value, DType dtype) {
  const Device device = default_device();
  if (device.is_meta()) return empty(shape, {.dtype = dtype, .device = device});
  Tensor t = full(shape, value, {.dtype = dtype});
  return device.is_cpu() ? t : t.to(device);
}
}  // namespace

Linear::Linear(std::int64_t in_features, std::int64_t out_features, LinearOptions options) {
  MB_CHECK(in_features > 0 && out_features > 0, "[Linear] sizes must be positive, got {} -> {}",
           in_features, out_features);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  weight = parameter({out_features, in_features}, options.dtype);
  uniform_(weight, -bound, bound);
  register_parameter("weight", &weight);
  if (options.bias) {
    bias = parameter({out_features}, options.dtype);
    uniform_(bias, -bound, bound);
    register_parameter("bias", &bias);
  }
}

Tensor Linear::forward(const Tensor& x) { return linear(x, weight, bias); }

Embedding::Embedding(std::int64_t num_embeddings, std::int64_t dim, DType dtype) {
  MB_CHECK(num_embeddings > 0 && dim > 0, "[Embedding] sizes must be positive, got ({}, {})",
           num_embeddings, dim);
  weight = parameter({num_embeddings, dim}, dtype);
  normal_(weight, 0.0, 1.0);
  register_parameter("weight", &weight);
}

Tensor Embedding::forward(const Tensor& indices) { return embedding(weight, indices); }

LayerNorm::LayerNorm(std::int64_t dim, double eps, DType dtype) : eps(eps) {
  MB_CHECK(dim > 0, "[LayerNorm] the normalized size must be positive, got {}", dim);
  weight = filled_parameter({dim}, 1.0, dtype);
  bias = filled_parameter({dim}, 0.0, dtype);
  register_parameter("weight", &weight);
  register_parameter("bias", &bias);
}

Tensor LayerNorm::forward(const Tensor& x) {
  return layer_norm(x, {weight.shape()[0]}, weight, bias, eps);
}

Dropout::Dropout(double p) : p(p) {
  // As torch.nn.Dropout: checked when made, not first in a training forward.
  MB_CHECK(p >= 0.0 && p <= 1.0, "[Dropout] p must be in [0, 1], got {}", p);
}

Tensor Dropout::forward(const Tensor& x) { return is_training() ? dropout(x, p) : x; }

Conv2d::Conv2d(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel_size,
               Conv2dLayerOptions options)
    : conv{.stride = options.stride, .padding = options.padding} {
  MB_CHECK(in_channels > 0 && out_channels > 0 && kernel_size > 0,
           "[Conv2d] sizes must be positive, got in {}, out {}, kernel {}", in_channels, out_channels,
           kernel_size);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_channels * kernel_size * kernel_size));
  weight = parameter({out_channels, in_channels, kernel_size, kernel_size}, DType::f32);
  uniform_(weight, -bound, bound);
  register_parameter("weight", &weight);
  if (options.bias) {
    bias = parameter({out_channels}, DType::f32);
    uniform_(bias, -bound, bound);
    register_parameter("bias", &bias);
  }
}

Tensor Conv2d::forward(const Tensor& x) { return conv2d(x, weight, bias, conv); }

Sequential::Sequential(std::vector<std::shared_ptr<Layer>> layers) {
  for (auto& l : layers) push_back(std::move(l));
}

void Sequential::push_back(std::shared_ptr<Layer> layer) {
  register_module(std::to_string(layers_.size()), layer);
  layers_.push_back(std::move(layer));
}

void Sequential::set_checkpoint_segments(std::int64_t segments) {
  MB_CHECK(segments >= 0, "[Sequential] checkpoint segments must be >= 0, got {}", segments);
  checkpoint_segments_ = segments;
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  const std::size_t n = layers_.size();
  if (checkpoint_segments_ <= 1 || !is_training() || n < 2) {
    for (auto& l : layers_) h = l->forward(h);
    return h;
  }
  const std::size_t per = (n + checkpoint_segments_ - 1) / checkpoint_segments_;
  for (std::size_t begin = 0; begin < n; begin += per) {
    const std::size_t end = std::min(n, begin + per);
    h = checkpoint([this, begin, end](const Tensor& in) {
      Tensor y = in;
      for (std::size_t i = begin; i < end; ++i) y = layers_[i]->forward(y);
      return y;
    }, h);
  }
  return h;
}

}  // namespace microbatch::nn
