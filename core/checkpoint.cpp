// Activation checkpointing: a segment's forward runs without recording, so only its inputs are
// saved; its backward re-runs the forward with recording on (and with the RNG stream rewound, so
// dropout draws the same mask) and backpropagates through the recomputed graph. Parameters used
// inside the segment receive their gradients from that inner backward, with the same weight w.
#include <memory>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/rng.h"

namespace microbatch {

std::vector<Tensor> checkpoint(const CheckpointFn& fn, const std::vector<Tensor>& inputs) {
  if (!grad_mode_enabled()) return fn(inputs);
  const GeneratorState rng = default_generator().state();
  std::vector<Tensor> outputs;
  {
    NoGradGuard no_grad;
    outputs = fn(inputs);
    // Each output gets its own handle on its memory: fn may return an input, or a tensor it
    // captured (a parameter), as is, and that tensor itself must not become this node's output
    // (a leaf would stop being one, and hold its own node: a cycle that is never freed).
    for (Tensor& o : outputs)
      if (o.defined()) o = o.detach();
  }
  std::vector<SavedTensor> saved;
  std::vector<Edge> edges;
  for (const Tensor& t : inputs) {
    saved.emplace_back(t, "checkpoint");
    edges.push_back(gradient_edge(t));
  }
  auto backward = [fn, saved = std::move(saved), rng](std::vector<Tensor> grads) {
    std::vector<Tensor> detached;
    std::vector<Tensor> wanted;  // the detached inputs whose gradient is asked for
    for (const SavedTensor& s : saved) {
      Tensor original = s.get();
      Tensor d = original.defined() ? original.detach() : Tensor();
      if (original.defined() && original.requires_grad()) {
        d.requires_grad_(true);
        wanted.push_back(d);
      }
      detached.push_back(d);
    }
    std::vector<Tensor> recomputed;
    {
      // The stream goes back to where it is now however fn exits: left at the forward's draws
      // (an OutOfMemoryError mid-recomputation), later dropout masks would repeat them.
      GeneratorStateGuard now;
      default_generator().set_state(rng);
      EnableGradGuard enable;
      recomputed = fn(detached);
    }
    // Moved, not copied: held here, the recomputed outputs and their incoming gradients would
    // outlive the inner nodes that use them and raise the peak above the plain backward's.
    std::vector<Tensor> roots, root_grads;
    for (std::size_t i = 0; i < recomputed.size() && i < grads.size(); ++i) {
      if (grads[i].defined() && recomputed[i].requires_grad()) {
        roots.push_back(std::move(recomputed[i]));
        root_grads.push_back(std::move(grads[i]));
      }
    }
    recomputed.clear();
    grads.clear();
    std::vector<Tensor> result(detached.size());
    if (roots.empty()) return result;
    std::vector<Tensor> got = grad(std::move(roots), std::move(root_grads), wanted);
    std::size_t k = 0;
    for (std::size_t i = 0; i < detached.size(); ++i) {
      if (detached[i].defined() && detached[i].requires_grad()) result[i] = got[k++];
    }
    return result;
  };
  set_history(outputs, std::make_shared<Node>("checkpoint", std::move(edges), std::move(backward),
                                              static_cast<int>(outputs.size()),
                                              input_meta(inputs)));
  return outputs;
}

Tensor checkpoint(const std::function<Tensor(const Tensor&)>& fn, const Tensor& input) {
  return checkpoint([fn](const std::vector<Tensor>& in) { return std::vector<Tensor>{fn(in[0])}; },
                    std::vector<Tensor>{input})[0];
}

}  // namespace microbatch
