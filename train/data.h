// Datasets, batches and the DataLoader: the order in which a run sees its samples, collated into
// batch tensors, with the item counts that make gradient accumulation exact.
//
// Note [Batch items]: a batch's num_items is the number of loss-bearing labels: samples whose class
// index is not ignore_index for classification batches, tokens whose label is not ignore_index
// for token batches, every sample for soft (floating) labels. A micro-batch's
// weight in an accumulation window is its share of the window's items (see REFERENCE.md,
// "Gradient accumulation"), so every split of a batch gives the full batch's gradient.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/tensor.h"

namespace microbatch::train {

/// Which part of a dataset to read. Fashion-MNIST has Train and Test; text files Train and Val.
enum class Split { Train, Val, Test };
const char* split_name(Split split);

/// One sample: its input and its label (a class index, or the shifted token sequence).
struct Example {
  Tensor input;
  Tensor label;
};

/// A random-access collection of examples. get() may be called from the DataLoader's prefetch
/// thread while the owning thread also calls it, so implementations must be safe for concurrent
/// const access (the in-memory datasets here are read-only after construction).
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::int64_t size() const = 0;
  /// The example at `index` in [0, size()); out-of-range indices throw (see check_index).
  virtual Example get(std::int64_t index) const = 0;

 protected:
  /// Throws "[name] index i out of range for a dataset of n examples" unless 0 <= index < size().
  void check_index(std::int64_t index, const char* name) const;
};

/// A dataset over two tensors that share their first dimension: example i is (inputs[i], labels[i]).
class TensorDataset : public Dataset {
 public:
  TensorDataset(Tensor inputs, Tensor labels);
  std::int64_t size() const override { return inputs_.size(0); }
  Example get(std::int64_t index) const override;

 private:
  Tensor inputs_;  // (N, ...)
  Tensor labels_;  // (N, ...)
};

/// Collated examples. Inputs and labels gain a leading batch dimension.
struct Batch {
  Tensor inputs;                      // (B, ...) or (B, T_max) for padded token sequences
  Tensor labels;                      // (B) for classes, (B, T_max) for tokens
  std::int64_t num_items = 0;         // Note [Batch items]
  std::vector<std::int64_t> indices;  // dataset index of each row (empty from a bare collate())
  std::int64_t size() const { return inputs.defined() ? inputs.size(0) : 0; }
  /// The same batch with its tensors on `device`: one copy each, none where they already are.
  Batch to(Device device) const;
};

struct CollateOptions {
  double pad_value = 0.0;             // fills padded input positions
  std::int64_t ignore_index = -100;   // fills padded label positions; such labels carry no loss
};

/// Stacks examples whose inputs (and labels) share a shape. 1-d sequences of different lengths
/// are padded on the right to the longest: inputs with pad_value, labels with ignore_index.
/// With labels of an integer dtype (a class per example, or a token sequence) num_items counts the
/// entries != ignore_index; with floating labels it is the number of examples.
Batch collate(const std::vector<Example>& examples, CollateOptions options = {});

/// A fingerprint of a dataset's labels (Note [Resuming the same run] in train/trainer.cpp): the
/// CRC-32 of the dtypes, shapes and bytes of the labels of up to 64 of its examples, evenly spaced
/// and the last among them, as 8 hex digits. Reading all of them would cost a pass over the data;
/// these 64 tell apart two sets of the same size whose labels differ in most places (another
/// file, another vocabulary, another split). Inputs are left out, so that a run stopped by a
/// poisoned sample resumes once that sample is cleaned.
std::string label_fingerprint(const Dataset& data);

/// Every example's input elements (a sequence's tokens), in order: what a plan for
/// variable-length sequences reads its longest example and its micro-batch shapes from. Reads
/// every example once.
std::vector<std::int64_t> sequence_lengths(const Dataset& data);

/// The sample order of one epoch: 0..n-1 shuffled by a Fisher–Yates pass driven by a
/// std::mt19937_64 seeded from (seed, epoch) alone, so it never touches the global generator and
/// is the same on every platform (the bounded draws are our own, not std::uniform_int_distribution).
std::vector<std::int64_t> shuffled_order(std::int64_t n, std::uint64_t seed, std::int64_t epoch);

struct DataLoaderOptions {
  std::int64_t batch_size = 1;
  bool shuffle = false;
  std::uint64_t seed = 0;
  bool drop_last = false;      // drop a last batch shorter than batch_size
  std::int64_t prefetch = 2;   // batches a background thread produces ahead; 0 = no thread
  CollateOptions collate{};
  /// Sharding for data-parallel training, as torch's DistributedSampler: each epoch's order is
  /// padded by repeating its first samples to a multiple of num_replicas, and rank r takes its
  /// samples r, r + num_replicas, ... (so every rank has as many batches). 1: no sharding.
  std::int64_t num_replicas = 1;
  std::int64_t rank = 0;
};

/// Where a loader stands: the epoch, and how many of its batches next() has already returned.
struct LoaderState {
  std::int64_t epoch = 0;
  std::int64_t position = 0;
  bool operator==(const LoaderState&) const = default;
};

/// Batches of a dataset in a seeded order. The dataset must outlive the loader.
///
///   DataLoader loader(train_set, {.batch_size = 64, .shuffle = true, .seed = 42});
///   for (std::int64_t epoch = 0; epoch < 3; ++epoch) {
///     loader.set_epoch(epoch);
///     while (auto batch = loader.next()) { ... }
///   }
///
/// With prefetch > 0 one background thread collates up to `prefetch` batches ahead; an exception
/// it meets is rethrown by the next() that would have returned that batch (a later next() retries
/// it). set_epoch / set_state / the destructor stop and join the thread first.
class DataLoader {
 public:
  DataLoader(const Dataset& dataset, DataLoaderOptions options);
  /// A temporary dataset would die before the loader reads it.
  DataLoader(const Dataset&& dataset, DataLoaderOptions options) = delete;
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  /// Samples per epoch: the dataset's, or this rank's shard of it (ceil(n / num_replicas)).
  std::int64_t samples_per_epoch() const;
  /// Batches per epoch: ceil(samples / batch_size), or floor with drop_last.
  std::int64_t num_batches() const;
  const DataLoaderOptions& options() const { return options_; }
  const Dataset& dataset() const { return dataset_; }

  /// Starts epoch `epoch` from its first batch (its order is shuffled_order(n, seed, epoch)).
  void set_epoch(std::int64_t epoch);
  std::int64_t epoch() const { return state_.epoch; }
  /// The next batch of the current epoch, or nullopt once all num_batches() have been returned.
  std::optional<Batch> next();

  LoaderState state() const { return state_; }
  /// Resumes at batch `position` of epoch `epoch`: the following next() calls return exactly the
  /// batches an uninterrupted loader would have returned from there.
  void set_state(LoaderState state);

  /// The dataset indices of batch `batch` of the current epoch.
  std::vector<std::int64_t> batch_indices(std::int64_t batch) const;
  /// Collates an arbitrary list of dataset indices (e.g. one micro-batch of a batch).
  Batch batch_for(const std::vector<std::int64_t>& indices) const;
  /// batch_for(indices).num_items (Note [Batch items]) from the examples' labels alone, without
  /// collating their inputs.
  std::int64_t items_for(const std::vector<std::int64_t>& indices) const;

 private:
  struct Item {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };
  void start_worker();
  void stop_worker() noexcept;
  void worker_loop(std::int64_t first);

  const Dataset& dataset_;
  DataLoaderOptions options_;
  LoaderState state_;
  std::vector<std::int64_t> order_;  // this epoch's sample order; fixed while the worker runs

  std::thread worker_;
  std::mutex mutex_;
  std::condition_variable cv_;  // signals both "queue has room" and "queue has an item"
  std::deque<Item> queue_;      // batches state_.position, position + 1, ... in order
  bool stop_ = false;
};

}  // namespace microbatch::train
