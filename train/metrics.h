// What compute_metrics sees, and how evaluation gathers it: the whole set's logits and labels as
// host rows, batches of different sequence lengths padded to the longest (Note [Padding across
// batches]), and the classification metrics over them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/ops.h"
#include "core/tensor.h"

namespace microbatch::train {

class ProcessGroup;

/// What pads the logits of shorter evaluation batches: Hugging Face's padding_index.
inline constexpr double kLogitsPadding = -100.0;

/// What compute_metrics sees: the logits of the whole evaluation set and its labels (CPU). Token
/// batches of different lengths are padded to the longest (Note [Padding across batches]).
struct EvalPrediction {
  Tensor logits;                     // (N, C) or (N, T_max, V)
  Tensor labels;                     // (N) or (N, T_max)
  std::int64_t ignore_index = -100;  // the model's: labels that carry no loss, padding among them
};
using Metrics = std::map<std::string, double>;
using ComputeMetrics = std::function<Metrics(const EvalPrediction&)>;

/// accuracy, and macro-averaged precision, recall and F1 over the classes present in the scored
/// labels or their predictions, for class logits (N, C) and labels (N). Rows labelled
/// ignore_index are not scored, as they carry no loss; with no row left to score it returns no
/// metrics (an empty map) rather than a number that would read as a score.
Metrics classification_metrics(const EvalPrediction& prediction);

/// Evaluation batches gathered row by row as plain host bytes, outside every allocator (Note
/// [Predictions outside the budget] in train/evaluation.cpp), then put together as one tensor
/// padded as Note [Padding across batches] says.
class HostRows {
 public:
  /// `what` names the rows in messages ("logits", "labels"); `padding` fills shorter batches.
  HostRows(const char* what, double padding) : what_(what), padding_(padding) {}
  /// Appends a batch (B, ...) from any device.
  void add(const Tensor& batch);
  /// The rows so far, (sum B) or (sum B, longest T, ...): allocated on the CPU.
  Tensor tensor() const;
  /// Whether any row has been added (or gathered).
  bool has_rows() const { return !parts_.empty(); }
  /// Every rank's rows, in the whole set's order, given that rank r of `group` holds one row for
  /// each of its examples r, r + W, r + 2W, ... of a set of `examples` in a world of W
  /// (DatasetShard's share): a collective, after which every rank holds all the rows (Note
  /// [Sharded predictions] in train/evaluation.cpp).
  void gather_shares(ProcessGroup& group, std::int64_t examples);

 private:
  struct Part {
    std::int64_t rows = 0;
    std::int64_t length = 0;  // the batch's second dimension (1 for a 1-d batch)
  };
  const char* what_;
  double padding_;
  DType dtype_ = DType::f32;
  Shape first_;                  // the first batch's shape
  std::size_t inner_bytes_ = 0;  // bytes of one row's element along dimension 1: dims 2.. x dtype
  std::vector<Part> parts_;
  std::vector<std::byte> bytes_;
};

}  // namespace microbatch::train
