// Note [Flat arenas]: once a model is built, its parameters move into one contiguous weight arena
// and their gradients into one gradient arena, laid out in the same order, with every parameter
// that gets weight decay first (so decay is one range [0, decay_numel)). Each module's tensor
// member becomes a view of its slot, and each parameter's .grad is preset to a view of its gradient
// slot, so autograd accumulates `grad += w * g` straight into the arena (Note [Gradient writes]).
// zero_grad is one memset, the gradient norm and the optimizer update one pass each.
//
// Note [Mixed precision]: with a 16-bit compute dtype there are three arenas of the same layout:
// 16-bit working weights (what the model reads), f32 master weights (what the optimizer updates),
// and f32 gradient accumulators. The optimizer's pass reads the gradient, updates the master and
// its moments in f32, and writes the rounded working copy in the same loop.
#pragma once

#include <map>
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
  /// The dtype of the working weights the model computes with (Note [Mixed precision]); by default
  /// the parameters' own. When it is 16-bit and the parameters are f32, the f32 values become the
  /// master weights and the model's parameters become 16-bit views of a working-copy arena.
  std::optional<DType> compute_dtype;
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

  /// (numel) the working weights the model computes with, decay group first.
  const Tensor& weights() const { return weights_; }
  /// (numel) the f32 master weights the optimizer updates (the working weights when there is no
  /// separate master copy).
  const Tensor& master() const { return master_.defined() ? master_ : weights_; }
  bool has_master() const { return master_.defined(); }
  /// (numel) the gradients, same layout.
  const Tensor& grads() const { return grads_; }
  std::int64_t numel() const { return weights_.numel(); }
  /// Elements [0, decay_numel) get weight decay.
  std::int64_t decay_numel() const { return decay_numel_; }
  const std::vector<Entry>& entries() const { return entries_; }
  /// Sets every gradient to zero (one memset over the arena).
  void zero_grad();
  /// sqrt(sum of squares) of all gradients, in f64, and whether any is not finite. On CUDA this
  /// waits for the result (the trainer's boundary step does not: optim/boundary_step.h).
  struct GradNorm {
    double norm = 0.0;
    bool non_finite = false;
  };
  GradNorm grad_norm() const;
  /// The name of the first parameter (in arena order) whose gradient holds a value that is not
  /// finite; empty when every one is finite. For diagnosing an overflowing step.
  std::string first_non_finite() const;
  /// The entry whose slot holds arena element `index` (0 <= index < numel()).
  const Entry& entry_at(std::int64_t index) const;
  /// The gradient of one entry, as a view with the parameter's shape.
  Tensor grad_of(const Entry& e) const;
  Tensor weight_of(const Entry& e) const;
  Tensor master_of(const Entry& e) const;
  /// The master weights by parameter name (views), for checkpoints.
  std::map<std::string, Tensor> master_state() const;
  /// Copies master weights in by name and refreshes the working copy from them.
  void load_master_state(const std::map<std::string, Tensor>& state);
  std::size_t bytes() const {
    return weights_.nbytes() + grads_.nbytes() + (master_.defined() ? master_.nbytes() : 0);
  }

 private:
  nn::Module& model_;
  Tensor weights_;
  Tensor master_;  // f32, only with a 16-bit compute dtype
  Tensor grads_;
  std::int64_t decay_numel_ = 0;
  std::vector<Entry> entries_;
};

/// Scales the gradients so that their global norm is at most max_norm (torch's
/// clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1). Returns the norm.
double clip_grad_norm_(ParamStore& store, double max_norm);

}  // namespace microbatch::optim
