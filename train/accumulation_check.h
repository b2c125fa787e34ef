// The accumulation certificate: one optimizer step taken on a full batch and on the same batch
// split into micro-batches (even, uneven, and token batches with different padding) must give the
// same gradients and the same updated weights to rounding (Note [Exact accumulation]).
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"

namespace microbatch::train {

struct AccumulationCheckOptions {
  DType dtype = DType::f64;
  std::uint64_t seed = 0;
};

struct TensorDifference {
  std::string name;
  double max_relative = 0.0;  // max |split - full| / max |full| over the tensor
};

struct AccumulationCase {
  std::string model;                 // "mlp" or "gpt"
  std::string split;                 // e.g. "4+4+4", "5+5+2"
  std::vector<TensorDifference> gradients;
  std::vector<TensorDifference> weights;  // after one SGD step (momentum 0.9, weight decay)
  double max_gradient = 0.0;
  double max_weight = 0.0;
  /// For padded token batches: the error of the naive rule (mean per micro-batch / N); -1 if n/a.
  double naive_max_gradient = -1.0;
};

/// max |a - b| / max |b| over two tensors of one shape (the measure every comparison here uses:
/// relative to the tensor's largest magnitude, so near-zero elements do not dominate).
double max_relative_difference(const Tensor& a, const Tensor& b);

/// Runs every case; the bound for passing is 1e-12 in f64 and 1e-6 in f32.
std::vector<AccumulationCase> check_accumulation(AccumulationCheckOptions options = {});
double accumulation_tolerance(DType dtype);

}  // namespace microbatch::train
