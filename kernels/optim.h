// Optimizer kernels: each is one pass over a whole flat arena (Note [Flat arenas] in
// optim/param_store.h). Weights and optimizer state are updated in place (overwrite); gradients
// are only read. `grad_scale` folds unscaling and clipping into the same pass.
#pragma once

#include <cstdint>

#include "kernels/view.h"

namespace microbatch::kernels {

struct AdamWArgs {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  std::int64_t step = 1;          // steps taken, this one included (bias correction)
  double grad_scale = 1.0;        // g = grad * grad_scale
  std::int64_t decay_end = 0;     // elements [0, decay_end) get weight decay
};

struct SGDArgs {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool first_step = true;         // the momentum buffer starts as the first gradient
  double grad_scale = 1.0;
  std::int64_t decay_end = 0;
};

namespace cpu {
/// PyTorch AdamW per element (REFERENCE.md), f32 or f64 math; params, m, v, grads: 1-d contiguous.
/// With a working copy (data != nullptr), also writes work[i] = (16-bit) params[i] in the same pass.
void adamw(const StridedView& params, const StridedView& grads, const StridedView& exp_avg,
           const StridedView& exp_avg_sq, const AdamWArgs& args, const StridedView& work = {});
/// PyTorch SGD per element; momentum_buffer may be empty when momentum == 0.
void sgd(const StridedView& params, const StridedView& grads, const StridedView& momentum_buffer,
         const SGDArgs& args, const StridedView& work = {});
/// Sum of squares of a 1-d contiguous arena in f64, and whether any element is not finite.
struct NormResult {
  double sum_sq = 0.0;
  bool non_finite = false;
};
NormResult sum_squares(const StridedView& values);
/// values *= factor.
void scale(const StridedView& values, double factor);
}  // namespace cpu

}  // namespace microbatch::kernels
