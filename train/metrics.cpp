// Classification metrics, and the host rows evaluation gathers for them (see train/metrics.h).
#include "train/metrics.h"

#include <algorithm>
#include <cstring>
#include <set>

namespace microbatch::train {

Metrics classification_metrics(const EvalPrediction& p) {
  MB_CHECK(p.logits.dim() == 2 && p.labels.dim() == 1 && p.labels.shape()[0] == p.logits.shape()[0],
           "[classification_metrics] expected logits (N, C) and labels (N), got {} and {}",
           shape_str(p.logits.shape()), shape_str(p.labels.shape()));
  std::vector<double> pred = argmax(p.logits, 1).to_vector(), gold = p.labels.to_vector();
  std::set<std::int64_t> classes;
  std::map<std::int64_t, double> tp, fp, fn;
  double correct = 0, scored = 0;
  for (std::size_t i = 0; i < gold.size(); ++i) {
    const auto y = static_cast<std::int64_t>(gold[i]), yhat = static_cast<std::int64_t>(pred[i]);
    // A row labelled ignore_index carries no loss (eval_loss leaves it out): it is no class either,
    // as a Hugging Face user's compute_metrics masks -100 before scoring.
    if (y == p.ignore_index) continue;
    ++scored;
    classes.insert(y);
    classes.insert(yhat);
    if (y == yhat) {
      ++correct;
      ++tp[y];
    } else {
      ++fp[yhat];
      ++fn[y];
    }
  }
  if (scored == 0) return {};
  double precision = 0, recall = 0, f1 = 0;
  for (std::int64_t c : classes) {
    const double pc = tp[c] + fp[c] > 0 ? tp[c] / (tp[c] + fp[c]) : 0.0;
    const double rc = tp[c] + fn[c] > 0 ? tp[c] / (tp[c] + fn[c]) : 0.0;
    precision += pc;
    recall += rc;
    f1 += pc + rc > 0 ? 2 * pc * rc / (pc + rc) : 0.0;
  }
  const auto k = static_cast<double>(classes.size());
  return {{"accuracy", correct / scored},
          {"precision", precision / k},
          {"recall", recall / k},
          {"f1", f1 / k}};
}

// Note [Padding across batches]: the collator pads each evaluation batch to its own longest row
// (Note [Batch items] in train/data.h), so the logits (B, T_b, V) and token labels (B, T_b) of
// variable-length sequences differ in T_b from batch to batch. As Hugging Face's nested_concat,
// the gathered tensors are padded in their second dimension to the longest batch: logits with
// -100 (its padding_index, kLogitsPadding), labels with the model's ignore_index, as the collator
// pads them within a batch (Hugging Face pads labels with -100 too: the same for its models'
// default), so that a padded position is never scored. Their other dimensions must agree.
void HostRows::add(const Tensor& batch) {
  const Tensor c = batch.to(kCPU).contiguous();
  MB_CHECK(c.dim() >= 1, "[evaluate] the evaluation batch's {} have no batch dimension", what_);
  if (parts_.empty()) {
    first_ = c.shape();
    dtype_ = c.dtype();
    std::int64_t inner = 1;
    for (std::size_t d = 2; d < first_.size(); ++d) inner *= first_[d];
    inner_bytes_ = static_cast<std::size_t>(inner) * dtype_size(dtype_);
  }
  const bool same_kind =
      c.dtype() == dtype_ && c.dim() == static_cast<std::int64_t>(first_.size()) &&
      std::equal(first_.begin() + std::min<std::ptrdiff_t>(2, c.dim()), first_.end(),
                 c.shape().begin() + std::min<std::ptrdiff_t>(2, c.dim()));
  MB_CHECK(
      same_kind,
      "[evaluate] evaluation batch {} has {} {} {}, batch 0 had {} {}: only the second dimension "
      "(the sequence) may differ between batches",
      parts_.size(), what_, dtype_name(c.dtype()), shape_str(c.shape()), dtype_name(dtype_),
      shape_str(first_));
  parts_.push_back({.rows = c.shape()[0], .length = c.dim() >= 2 ? c.shape()[1] : 1});
  const auto* p = static_cast<const std::byte*>(c.raw_data());
  bytes_.insert(bytes_.end(), p, p + c.nbytes());
}

Tensor HostRows::tensor() const {
  MB_ASSERT(!parts_.empty(), "HostRows::tensor() with no batch");
  std::int64_t rows = 0, longest = 0;
  for (const Part& part : parts_) {
    rows += part.rows;
    longest = std::max(longest, part.length);
  }
  Shape shape = first_;
  shape[0] = rows;
  if (shape.size() >= 2) shape[1] = longest;
  const bool ragged = std::any_of(parts_.begin(), parts_.end(),
                                  [&](const Part& part) { return part.length != longest; });
  if (!ragged) {
    Tensor t = empty(shape, {.dtype = dtype_});
    if (!bytes_.empty()) std::memcpy(t.raw_data(), bytes_.data(), bytes_.size());
    return t;
  }
  // Padding a label with a value its dtype cannot hold would wrap (-100 in u8 is 156) into a class.
  MB_CHECK(
      holds_value(dtype_, padding_),
      "[evaluate] the {} of evaluation batches of different lengths are padded with {}, which is "
      "not a value of their dtype {}",
      what_, padding_, dtype_name(dtype_));
  Tensor t = full(shape, padding_, {.dtype = dtype_});
  auto* dst = static_cast<std::byte*>(t.raw_data());
  const std::byte* src = bytes_.data();
  const std::size_t dst_row = static_cast<std::size_t>(longest) * inner_bytes_;
  for (const Part& part : parts_) {
    const std::size_t src_row = static_cast<std::size_t>(part.length) * inner_bytes_;
    for (std::int64_t r = 0; r < part.rows; ++r) {
      std::memcpy(dst, src, src_row);
      dst += dst_row;
      src += src_row;
    }
  }
  MB_ASSERT(src == bytes_.data() + bytes_.size(), "HostRows: {} bytes gathered, {} placed",
            bytes_.size(), src - bytes_.data());
  return t;
}

}  // namespace microbatch::train
