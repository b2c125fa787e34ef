// Classification metrics, and the host rows evaluation gathers for them (see train/metrics.h).
#include "train/metrics.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <utility>

#include "train/distributed.h"

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

void HostRows::gather_shares(ProcessGroup& group, std::int64_t examples) {
  const int world = group.size();
  if (world == 1) return;
  // Each rank in turn sends its header, [rows, dtype, dims, shape..., each row's length...], and
  // its bytes; every rank keeps them all.
  std::vector<std::int64_t> mine{0};
  for (const Part& part : parts_) {
    mine[0] += part.rows;
  }
  if (mine[0] > 0) {
    mine.push_back(static_cast<std::int64_t>(dtype_));
    mine.push_back(static_cast<std::int64_t>(first_.size()));
    mine.insert(mine.end(), first_.begin(), first_.end());
    for (const Part& part : parts_)
      mine.insert(mine.end(), static_cast<std::size_t>(part.rows), part.length);
  }
  std::vector<std::vector<std::int64_t>> lengths(static_cast<std::size_t>(world));
  std::vector<std::vector<std::byte>> bytes(static_cast<std::size_t>(world));
  std::optional<std::pair<DType, Shape>> kind;  // the first rank's with rows
  std::int64_t total = 0;
  std::string refused;  // why the rows cannot be put together, the first reason found
  for (int r = 0; r < world; ++r) {
    const bool me = r == group.rank();
    std::vector<std::int64_t> words = me ? mine : std::vector<std::int64_t>();
    group.broadcast(words, r);
    auto& rank_bytes = bytes[static_cast<std::size_t>(r)];
    if (me) rank_bytes.swap(bytes_);  // its own rows, without a copy: bytes_ is remade below
    group.broadcast(rank_bytes, r);
    const std::int64_t rows = words.at(0);
    if (rows == 0) continue;
    const auto dims = static_cast<std::size_t>(words.at(2));
    const std::pair<DType, Shape> rank_kind{
        static_cast<DType>(words.at(1)),
        Shape(words.begin() + 3, words.begin() + 3 + static_cast<std::ptrdiff_t>(dims))};
    if (!kind) kind = rank_kind;
    const bool same =
        rank_kind.first == kind->first && rank_kind.second.size() == kind->second.size() &&
        std::equal(kind->second.begin() + std::min<std::ptrdiff_t>(2, dims), kind->second.end(),
                   rank_kind.second.begin() + std::min<std::ptrdiff_t>(2, dims));
    if (!same && refused.empty()) {
      refused = fmt::format(
          "[evaluate] rank {}'s {} are {} {}, another rank's {} {}: the ranks' models differ", r,
          what_, dtype_name(rank_kind.first), shape_str(rank_kind.second), dtype_name(kind->first),
          shape_str(kind->second));
    }
    lengths[static_cast<std::size_t>(r)].assign(
        words.begin() + 3 + static_cast<std::ptrdiff_t>(dims), words.end());
    total += rows;
  }
  for (int r = 0; r < world && refused.empty(); ++r) {
    // One row an example: a model whose rows are not its examples (flattened tokens, say) would
    // be interleaved wrongly.
    const auto held = static_cast<std::int64_t>(lengths[static_cast<std::size_t>(r)].size());
    if (held != share_size(examples, r, world)) {
      refused = fmt::format(
          "[evaluate] rank {} has {} rows of {}, not one for each of its {} of the {} examples", r,
          held, what_, share_size(examples, r, world), examples);
    }
  }
  // The same checks on every rank, of the same headers: every rank refuses alike, together.
  group.together("gathering its predictions", [&] { MB_CHECK(refused.empty(), "{}", refused); });
  if (total == 0) return;
  // Row j of the whole set is row j / W of rank j % W.
  const Shape first = kind->second;
  std::size_t inner = dtype_size(kind->first);
  for (std::size_t d = 2; d < first.size(); ++d) inner *= static_cast<std::size_t>(first[d]);
  std::vector<std::size_t> offset(static_cast<std::size_t>(world), 0);
  std::vector<Part> parts;
  std::vector<std::byte> all;
  for (std::int64_t j = 0; j < total; ++j) {
    const auto r = static_cast<std::size_t>(j % world);
    const std::int64_t length = lengths[r][static_cast<std::size_t>(j / world)];
    const std::size_t n = static_cast<std::size_t>(length) * inner;
    all.insert(all.end(), bytes[r].begin() + static_cast<std::ptrdiff_t>(offset[r]),
               bytes[r].begin() + static_cast<std::ptrdiff_t>(offset[r] + n));
    offset[r] += n;
    if (!parts.empty() && parts.back().length == length) {
      ++parts.back().rows;
    } else {
      parts.push_back({.rows = 1, .length = length});
    }
  }
  for (int r = 0; r < world; ++r)
    MB_ASSERT(offset[static_cast<std::size_t>(r)] == bytes[static_cast<std::size_t>(r)].size(),
              "HostRows: rank {} sent {} bytes, {} placed", r,
              bytes[static_cast<std::size_t>(r)].size(), offset[static_cast<std::size_t>(r)]);
  dtype_ = kind->first;
  first_ = first;
  inner_bytes_ = inner;
  parts_ = std::move(parts);
  bytes_ = std::move(all);
}

}  // namespace microbatch::train
