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
//
// Note [Frozen parameters]: a parameter that does not require grad when the store is built stays
// frozen, as torch's optimizers skip a parameter whose grad is None. The arenas hold three
// ranges, [decay | no decay | frozen]: the frozen weights sit last, in the working arena (in the
// compute dtype, so the forward reads them like any other) and in the master arena (f32, so
// checkpoints keep them unrounded), but the gradient arena and the optimizer's moments stop at
// trainable_numel(). Every pass (zero_grad, the norm, the non-finite check, clipping, AdamW, SGD
// and their decay) runs over [0, trainable_numel()) and so never reads or writes a frozen weight,
// with no per-element test in any kernel. A frozen parameter gets no .grad. Unfreezing one later
// is refused at the next optimizer step (check_frozen): it needs a new store and optimizer, as it
// needs a new optimizer in torch.
//
// Note [Parameters owned by a store]: the model's parameters are views of the store's arenas and
// their .grad views of its gradient arena, which the module must not swap out from under it. The
// store registers itself (through a small link object it owns) as the ParameterOwner of every
// module in the tree, held weakly, so neither has to outlive the other: the link dies with
// the store, after which the module is free again (its tensors keep the arena storage alive), and
// the store never touches the module after construction, so a module destroyed first is harmless.
// While the link lives, Module::to refuses to move or cast a parameter the store owns, zero_grad
// refuses SetToNone for one, and load_state_dict hands each parameter's value to
// load_parameter(), which writes the master at full precision and refreshes the working copy from
// it (a value that is the working copy itself changes nothing). These guards hold when called on
// the store's module or on any module above it, and a second store on an owned tree is refused.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
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
    bool frozen = false;  // no gradient slot, never updated (Note [Frozen parameters])
  };

  explicit ParamStore(nn::Module& model, ParamStoreOptions options = {});
  ~ParamStore();
  // The model's parameters and the ParameterOwner link point at this object and its arenas.
  ParamStore(const ParamStore&) = delete;
  ParamStore& operator=(const ParamStore&) = delete;

  /// (numel) the working weights the model computes with, decay group first.
  const Tensor& weights() const { return weights_; }
  /// (numel) the f32 master weights the optimizer updates (the working weights when there is no
  /// separate master copy).
  const Tensor& master() const { return master_.defined() ? master_ : weights_; }
  bool has_master() const { return master_.defined(); }
  /// (trainable_numel) the gradients, same layout; the frozen range has none.
  const Tensor& grads() const { return grads_; }
  /// Every weight, frozen ones included.
  std::int64_t numel() const { return weights_.numel(); }
  /// Elements [0, trainable_numel) are the ones optimizers update (Note [Frozen parameters]).
  std::int64_t trainable_numel() const { return grads_.numel(); }
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
  /// The gradient of one entry, as a view with the parameter's shape (not of a frozen entry).
  Tensor grad_of(const Entry& e) const;
  Tensor weight_of(const Entry& e) const;
  Tensor master_of(const Entry& e) const;
  /// The master weights by parameter name (views), for checkpoints.
  std::map<std::string, Tensor> master_state() const;
  /// Copies master weights in by name and refreshes the working copy from them.
  void load_master_state(const std::map<std::string, Tensor>& state);
  /// The arena's layout, a line per entry ("name offset numel decay|no_decay|frozen"): optimizer
  /// states are flat arenas in this order, and are loaded only into the same layout.
  std::string layout() const;
  /// Refuses a parameter frozen when the store was built that now requires grad: the store has no
  /// gradient slot for it, and no optimizer would ever update it (Note [Frozen parameters]).
  void check_frozen(const char* op) const;
  /// Loads one value into the entry whose working weights `param` is (a view the store made):
  /// into the master unrounded, then the working copy from it. False when `param` is not one.
  bool load_parameter(const Tensor& param, const Tensor& value);
  std::size_t bytes() const {
    return weights_.nbytes() + grads_.nbytes() + (master_.defined() ? master_.nbytes() : 0);
  }

 private:
  class Owner;
  // The entry whose working weights `param` is, or none.
  const Entry* entry_of(const Tensor& param) const;

  std::shared_ptr<Owner> owner_;  // the modules hold it weakly (Note [Parameters owned by a store])
  Tensor weights_;
  Tensor master_;  // f32, only with a 16-bit compute dtype
  Tensor grads_;   // (trainable_numel)
  std::vector<std::pair<std::string, Tensor>> frozen_;  // the frozen parameters the model holds
  std::int64_t decay_numel_ = 0;
  std::vector<Entry> entries_;
};

/// What clip_grad_norm_ does with a norm that is not finite: torch's error_if_nonfinite = False
/// (Scale) or True (Error).
enum class NonFiniteNorm { Scale, Error };

/// Scales the gradients so that their global norm is at most max_norm (torch's
/// clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1). Returns the norm. With a
/// norm that is not finite it does what torch does: Scale (the default) scales every gradient by
/// the coefficient, so an infinite norm turns finite gradients to 0 (an infinite one to NaN) and a
/// NaN norm makes every gradient NaN; Error throws, naming the first parameter whose gradient is
/// not finite (or saying that the sum of squares overflowed), and leaves the gradients alone.
double clip_grad_norm_(ParamStore& store, double max_norm,
                       NonFiniteNorm non_finite = NonFiniteNorm::Scale);

}  // namespace microbatch::optim
