// The autograd engine: a dynamic graph of Nodes, run in dependency order by backward().
//
// Note [Gradient writes]: activation gradients flow between nodes as fresh tensors (overwritten);
// a leaf's gradient is accumulated in place, `grad += w * g`, where w is the current accumulation
// weight (GradWeightGuard; 1 by default). That lets a micro-batch add its exact share of a window's
// gradient without a temporary, and lets a parameter's grad be a view into a flat arena.
//
// Note [Releasing saved tensors]: once a node has run, its backward closure (and with it every
// tensor it saved) is destroyed unless retain_graph is set, so activations die during backward.
// The engine keeps no other handle: the roots and their gradients are dropped once the graph is
// seeded, and a node's incoming gradients are handed over by value, so a node that runs a long
// inner backward (checkpoint) can let them go first.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace microbatch {

/// Maps the gradients of a node's outputs to the gradients of its inputs (undefined = none).
/// Takes them by value: they belong to the node while it runs (Note [Releasing saved tensors]).
using BackwardFn = std::function<std::vector<Tensor>(std::vector<Tensor> grad_outputs)>;

struct Edge {
  std::shared_ptr<Node> fn;
  int input_nr = 0;  // which output of fn the gradient belongs to
};

/// What a node's input was when the node was recorded: the gradient it returns for that input
/// must match it (Note [Checking returned gradients]).
struct InputMeta {
  Shape shape;
  Device device = kCPU;
};
/// The InputMeta of each input (one that takes no gradient gets an empty one, never checked).
std::vector<InputMeta> input_meta(const std::vector<Tensor>& inputs);

// Note [Checking returned gradients]: as torch's engine (validate_outputs), a node's backward
// must return one gradient per input, and a defined gradient for an input that takes one must
// have the input's shape, or a shape the input broadcasts to, which is then summed back to the
// input's shape; a gradient of another shape or on another device is an error naming the node and
// the input's index. A gradient's dtype is left as returned (a 16-bit input's f32 gradient keeps
// its precision on the way to an f32 accumulator).
class Node {
 public:
  Node(std::string name, std::vector<Edge> next_edges, BackwardFn fn, int num_outputs,
       std::vector<InputMeta> inputs = {});
  virtual ~Node() = default;

  /// Gradients for next_edges(), one per edge.
  virtual std::vector<Tensor> apply(std::vector<Tensor> grad_outputs);
  /// Drops the backward closure and everything it saved.
  virtual void release();
  const std::string& name() const { return name_; }
  const std::vector<Edge>& next_edges() const { return next_edges_; }
  int num_outputs() const { return num_outputs_; }
  std::uint64_t sequence_nr() const { return sequence_nr_; }

 protected:
  std::string name_;
  std::vector<Edge> next_edges_;
  BackwardFn fn_;
  int num_outputs_;
  std::uint64_t sequence_nr_;
  std::vector<InputMeta> inputs_;  // empty: the gradients are not checked
};

/// The sink of a leaf: accumulates `grad += w * g` into the leaf's .grad (Note [Gradient writes]).
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(const std::shared_ptr<TensorImpl>& leaf);
  std::vector<Tensor> apply(std::vector<Tensor> grad_outputs) override;
  void release() override {}
  std::shared_ptr<TensorImpl> leaf() const { return leaf_.lock(); }

 private:
  std::weak_ptr<TensorImpl> leaf_;
};

/// A tensor saved for backward; unpacking checks that nobody modified it in place since.
class SavedTensor {
 public:
  SavedTensor() = default;
  SavedTensor(const Tensor& t, const char* op);
  /// Saves an op's own output. It keeps a handle without the output's history: holding the
  /// output itself would make a cycle (output -> node -> saved output) that leaks the graph
  /// whenever backward never runs.
  static SavedTensor output(const Tensor& out, const char* op) { return SavedTensor(out.detach(), op); }
  /// The saved tensor; throws if its version changed since it was saved.
  Tensor get() const;
  /// Whether this handle is the only one on the saved tensor and on its memory, in a backward
  /// that does not retain its graph: nothing else can see it (Note [Reusing an input's memory]).
  bool only_handle() const;
  /// The saved tensor, checked as get() does, and this node's handle on it let go, so that the
  /// caller's is the only one left when only_handle() was true. A later get() or take() throws.
  /// Call it last, after everything in the formula that can throw: a node whose backward failed
  /// may be run again.
  Tensor take();

 private:
  Tensor tensor_;
  std::int64_t version_ = 0;
  const char* op_ = "";
  bool taken_ = false;
};

// ---- grad mode ---------------------------------------------------------------------------------
bool grad_mode_enabled();

/// Turns graph recording off in its scope (like torch.no_grad()).
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

/// Turns graph recording on in its scope (used to recompute checkpointed segments in backward).
class EnableGradGuard {
 public:
  EnableGradGuard();
  ~EnableGradGuard();
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool previous_;
};

/// Sets the accumulation weight w of `grad += w * g` in its scope (Note [Gradient writes]).
class GradWeightGuard {
 public:
  explicit GradWeightGuard(double weight);
  ~GradWeightGuard();
  GradWeightGuard(const GradWeightGuard&) = delete;
  GradWeightGuard& operator=(const GradWeightGuard&) = delete;

 private:
  double previous_;
};
double grad_weight();

// ---- recording ops -----------------------------------------------------------------------------
/// True when grad mode is on and some input requires grad.
bool needs_grad(std::initializer_list<Tensor> inputs);
bool needs_grad(const std::vector<Tensor>& inputs);

/// Makes `out` the output of a node named `op` whose inputs are `inputs` (when needs_grad).
void record(const char* op, const std::vector<Tensor>& inputs, Tensor& out,
            std::function<std::vector<Tensor>(const Tensor& grad_output)> backward);
/// The same for several outputs; an output that received no gradient passes an undefined one.
void record_multi(const char* op, const std::vector<Tensor>& inputs, std::vector<Tensor>& outputs,
                  BackwardFn backward);

/// Whether the backward running on this thread keeps its graph (BackwardOptions::retain_graph).
/// A backward formula may drop what it saved as soon as it is done with it, within its run, only
/// when this is false (Note [Releasing saved tensors]).
bool retaining_graph();

/// Note [Reusing an input's memory]: a backward formula whose gradient has its input's shape,
/// dtype and layout, and whose kernel reads each element of the input before writing the same
/// element of the gradient (cross_entropy's), may write the gradient over the input once nothing
/// else can see it: the graph is not retained and the node's saved handle is the only one on the
/// tensor and on its memory (SavedTensor::only_handle(): no view, no caller's variable, no other
/// node). The formula then takes that handle (take()) and the gradient costs no memory of its
/// own; a caller that keeps the input (a model output's logits, say) keeps it intact and the
/// formula allocates as before.

/// Whether a backward formula may add its gradient for `t` straight into t.grad (`grad += w * g`
/// with w = grad_weight(), Note [Gradient writes]) and return no gradient for it: t is a leaf that
/// requires grad, already has a gradient buffer, and is not being captured by a grad() call.
/// linear's weight-gradient GEMM and bias sums, embedding's scatter and layer norm's sums use this
/// (through in_place_grad for all but the GEMM) to write into the gradient arena directly.
bool accumulates_in_place(const Tensor& t);

/// t itself where it is a leaf that requires grad, else undefined: the handle a backward formula
/// keeps of a parameter it does not otherwise save, to reach its gradient slot through
/// in_place_grad (holding a leaf makes no cycle and keeps no activation alive).
Tensor grad_leaf(const Tensor& t);

/// t.grad() where a backward formula adds into it in place (accumulates_in_place) and its kernels
/// can: a contiguous buffer of t's shape in t's dtype, f32 or f64 (a slot of the gradient arena);
/// undefined otherwise, and the formula returns its gradient instead.
Tensor in_place_grad(const Tensor& t);

/// Makes node the grad_fn of each floating output (output i is the node's output i).
void set_history(std::vector<Tensor>& outputs, const std::shared_ptr<Node>& node);

/// The edge along which a gradient for t flows (its grad_fn, or its leaf's AccumulateGrad).
Edge gradient_edge(const Tensor& t);

// Note [Views made under no_grad]: in-place ops are not recorded, so with grad mode on they
// refuse a tensor that requires grad. A view made under NoGradGuard of such a tensor requires no
// grad itself, yet writing it changes the base behind autograd's back; as torch ("A view was
// created in no_grad mode and is being modified inplace with grad mode enabled"), that is refused
// too while the base requires grad: write it under NoGradGuard, as it was made, or write a
// clone(). Such a view keeps its base (a view of it, made in either mode, keeps the same base),
// as torch's view keeps its ._base. Only a base that requires grad when the view is made is kept,
// so the views that backward formulas make of gradients hold no extra handle (Note [Summing
// gradients in place] counts them); a base that starts to require grad later is not seen.
// detach() makes no such view: its writes are allowed, and the version counter it shares still
// catches a saved tensor. split's pieces are marked as made in the caller's grad mode.

/// Gives `view`, just made of `base`, the base that check_inplace consults: base's own, else base
/// itself when grad mode is off and base requires grad (Note [Views made under no_grad]).
void set_view_base(const Tensor& view, const Tensor& base);

/// Refuses an in-place change of a tensor that autograd must see unchanged (Note [Views made
/// under no_grad]).
void check_inplace(const Tensor& t, const char* op);

// ---- running backward --------------------------------------------------------------------------
/// Backpropagates grad_roots from roots, accumulating into leaves (Tensor::backward).
void run_backward(std::vector<Tensor> roots, std::vector<Tensor> grad_roots,
                  BackwardOptions options = {});

/// Gradients of roots with respect to `inputs` (leaves), returned instead of accumulated (also
/// where an input is used inside a checkpointed segment); other leaves reached still accumulate.
/// Undefined where an input is not reached.
std::vector<Tensor> grad(std::vector<Tensor> roots, std::vector<Tensor> grad_roots,
                         const std::vector<Tensor>& inputs, BackwardOptions options = {});

// ---- activation checkpointing (core/checkpoint.cpp) --------------------------------------------
using CheckpointFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
/// Runs fn without saving its internals; during backward, re-runs it (with the same RNG draws)
/// and backpropagates through the recomputed graph.
std::vector<Tensor> checkpoint(const CheckpointFn& fn, const std::vector<Tensor>& inputs);
Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input);

}  // namespace microbatch
