// Note [Flat arenas]: once a model is built, its parameters move into one contiguous weight arena
// and their gradients into one gradient arena, laid out in the same order, with every parameter
// that gets weight decay first (so decay is one range [0, decay_numel)). Each module's tensor
// member becomes a view of its slot, and each parameter's .grad is preset to a view of its gradient
// slot, so autograd accumulates `grad += w * g` straight into the arena (Note [Gradient writes]).
// zero_grad is one memset, the gradient norm and the optimizer update one pass each.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "nn/module.h"

namespace microbatch::optim {

/// Which parameters get weight decay. Default: all with 2 or more dims (not biases, not
/// LayerNorm weights), as GPT-2 and most recipes do.
enum class DecayRule { MatricesOnly, All, None };

struct ParamStoreOptions {
  DecayRule decay = DecayRule::MatricesOnly;
  /// Gradient accumulators: f32 by default whatever the weights (f64 for f64 weights).
  std::optional<DType> grad_dtype;
};

class ParamStore {
 public:
  struct Entry {
    std::string name;
    Shape shape;
    std::int64_t offset = 0;  // in elements, same in both arenas
    std::int64_t numel = 0;
    bool decay = false;
  };

  explicit ParamStore(nn::Module& model, ParamStoreOptions options = {});

  /// (numel) the weights, decay group first.
  const Tensor& weights() const { return weights_; }
  /// (numel) the gradients, same layout.
  const Tensor& grads() const { return grads_; }
  std::int64_t numel() const { return weights_.numel(); }
  /// Elements [0, decay_numel) get weight decay.
  std::int64_t decay_numel() const { return decay_numel_; }
  const std::vector<Entry>& entries() const { return entries_; }
  /// Sets every gradient to zero (one memset over the arena).
  void zero_grad();
  /// sqrt(sum of squares) of all gradients, in f64, and whether any is not finite.
  struct GradNorm {
    double norm = 0.0;
    bool non_finite = false;
  };
  GradNorm grad_norm() const;
  /// The gradient of one entry, as a view with the parameter's shape.
  Tensor grad_of(const Entry& e) const;
  Tensor weight_of(const Entry& e) const;
  std::size_t bytes() const { return weights_.nbytes() + grads_.nbytes(); }

 private:
  nn::Module& model_;
  Tensor weights_;
  Tensor grads_;
  std::int64_t decay_numel_ = 0;
  std::vector<Entry> entries_;
};

/// Scales the gradients so that their global norm is at most max_norm (torch's
/// clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1). Returns the norm.
double clip_grad_norm_(ParamStore& store, double max_norm);

}  // namespace microbatch::optim
