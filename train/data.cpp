// Collation, the seeded epoch order and the prefetching DataLoader (see train/data.h).
#include "train/data.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <type_traits>

#include "core/safetensors.h"

namespace microbatch::train {

const char* split_name(Split split) {
  switch (split) {
    case Split::Train: return "train";
    case Split::Val: return "val";
    case Split::Test: return "test";
  }
  return "?";
}

void Dataset::check_index(std::int64_t index, const char* name) const {
  const std::int64_t n = size();
  MB_CHECK(index >= 0 && index < n, "[{}] index {} out of range for a dataset of {} examples", name,
           index, n);
}

// ---- TensorDataset -----------------------------------------------------------------------------

TensorDataset::TensorDataset(Tensor inputs, Tensor labels)
    : inputs_(inputs.detach()), labels_(labels.detach()) {
  MB_CHECK(inputs_.defined() && labels_.defined(), "[TensorDataset] inputs and labels must be defined");
  MB_CHECK(inputs_.dim() >= 1 && labels_.dim() >= 1,
           "[TensorDataset] inputs {} and labels {} need a leading sample dimension",
           shape_str(inputs_.shape()), shape_str(labels_.shape()));
  MB_CHECK(inputs_.size(0) == labels_.size(0),
           "[TensorDataset] inputs {} and labels {} differ in their number of samples",
           shape_str(inputs_.shape()), shape_str(labels_.shape()));
}

Example TensorDataset::get(std::int64_t index) const {
  check_index(index, "TensorDataset");
  return {inputs_.select(0, index), labels_.select(0, index)};
}

// ---- collate -----------------------------------------------------------------------------------

namespace {


// Stacks one field (input or label) of every example into (B, ...); 1-d fields of different
// lengths become (B, L_max) with the tail of each row set to `fill`.
Tensor collate_field(const std::vector<Example>& examples, Tensor Example::*field, double fill,
                     const char* what) {
  const Tensor& first = examples.front().*field;
  MB_CHECK(first.defined(), "[collate] example 0 has no {}", what);
  bool same_shape = true;
  bool all_1d = true;
  std::int64_t longest = 0;
  for (std::size_t i = 0; i < examples.size(); ++i) {
    const Tensor& t = examples[i].*field;
    MB_CHECK(t.defined(), "[collate] example {} has no {}", i, what);
    // Meta examples collate to a meta batch (shapes and allocations only), for the memory planner.
    MB_CHECK(t.device() == first.device() && (t.device().is_cpu() || t.device().is_meta()),
             "[collate] example {} {} is on {}, expected cpu (or meta like example 0)", i, what,
             t.device().str());
    MB_CHECK(t.dtype() == first.dtype(), "[collate] example {} {} has dtype {}, example 0 has {}", i,
             what, dtype_name(t.dtype()), dtype_name(first.dtype()));
    same_shape = same_shape && t.shape() == first.shape();
    all_1d = all_1d && t.dim() == 1;
    if (t.dim() == 1) longest = std::max(longest, t.size(0));
  }
  const auto batch = static_cast<std::int64_t>(examples.size());
  Tensor out;
  if (same_shape) {
    Shape shape = first.shape();
    shape.insert(shape.begin(), batch);
    out = empty(shape, {.dtype = first.dtype(), .device = first.device()});
  } else {
    for (std::size_t i = 0; i < examples.size() && !all_1d; ++i) {
      const Tensor& t = examples[i].*field;
      MB_CHECK(t.shape() == first.shape(),
               "[collate] example {} {} has shape {}, example 0 has {}; only 1-d sequences are padded",
               i, what, shape_str(t.shape()), shape_str(first.shape()));
    }
    // A fill the dtype cannot hold would wrap (-100 in u8 is 156) and count as a real label.
    MB_CHECK(holds_value(first.dtype(), fill),
             "[collate] the {} padding value {} is not a value of their dtype {}", what, fill,
             dtype_name(first.dtype()));
    out = full({batch, longest}, fill, {.dtype = first.dtype(), .device = first.device()});
  }
  if (out.device().is_meta()) return out;
  const std::size_t row_bytes = out.nbytes() / static_cast<std::size_t>(batch);
  auto* dst = static_cast<char*>(out.raw_data());
  for (std::size_t i = 0; i < examples.size(); ++i) {
    const Tensor src = (examples[i].*field).contiguous();
    if (src.nbytes() > 0) std::memcpy(dst + i * row_bytes, src.raw_data(), src.nbytes());
  }
  return out;
}

std::int64_t count_not_equal(const Tensor& labels, std::int64_t ignore_index) {
  return dispatch_all(labels.dtype(), [&]<class T>() -> std::int64_t {
    if constexpr (std::is_integral_v<T>) {
      const T* p = labels.data<T>();
      std::int64_t count = 0;
      for (std::int64_t i = 0; i < labels.numel(); ++i)
        count += static_cast<std::int64_t>(p[i]) != ignore_index ? 1 : 0;
      return count;
    } else {
      MB_ASSERT(false, "token labels must have an integer dtype");
      return 0;
    }
  });
}

}  // namespace

Batch Batch::to(Device device) const {
  Batch out = *this;
  if (inputs.defined()) out.inputs = inputs.to(device);
  if (labels.defined()) out.labels = labels.to(device);
  return out;
}

Batch collate(const std::vector<Example>& examples, CollateOptions options) {
  MB_CHECK(!examples.empty(), "[collate] no examples to collate");
  Batch batch;
  batch.inputs = collate_field(examples, &Example::input, options.pad_value, "input");
  batch.labels =
      collate_field(examples, &Example::label, static_cast<double>(options.ignore_index), "label");
  // Integer labels (a class per example, or per token) equal to ignore_index carry no loss;
  // soft (floating) labels all do. A meta batch has no label values: every label counts.
  const Tensor& label0 = examples.front().label;
  batch.num_items = !is_integer(label0.dtype())       ? static_cast<std::int64_t>(examples.size())
                    : batch.labels.device().is_meta() ? batch.labels.numel()
                                                      : count_not_equal(batch.labels, options.ignore_index);
  return batch;
}

std::vector<std::int64_t> sequence_lengths(const Dataset& data) {
  std::vector<std::int64_t> lengths;
  lengths.reserve(static_cast<std::size_t>(data.size()));
  for (std::int64_t i = 0; i < data.size(); ++i) lengths.push_back(data.get(i).input.numel());
  return lengths;
}

std::string label_fingerprint(const Dataset& data) {
  std::uint32_t crc = 0;
  auto mix = [&](const void* p, std::size_t n) {
    crc = checksum_crc32({static_cast<const std::uint8_t*>(p), n}, crc);
  };
  const std::int64_t n = data.size();
  const std::int64_t picks = std::min<std::int64_t>(n, 64);
  for (std::int64_t k = 0; k < picks; ++k) {
    // Index k * (n - 1) / (picks - 1) without overflow: 0 first, n - 1 last.
    const std::int64_t i =
        picks == 1 ? 0
                   : static_cast<std::int64_t>(static_cast<long double>(k) *
                                               static_cast<long double>(n - 1) /
                                               static_cast<long double>(picks - 1));
    const Tensor label = data.get(i).label;
    if (!label.defined()) continue;
    const Tensor c = label.to(kCPU).contiguous();
    const auto dtype = static_cast<int>(c.dtype());
    mix(&dtype, sizeof dtype);
    for (std::int64_t d : c.shape()) mix(&d, sizeof d);
    if (c.nbytes() > 0) mix(c.raw_data(), c.nbytes());
  }
  return fmt::format("{:08x}", crc);
}

// ---- epoch order -------------------------------------------------------------------------------

namespace {

// A uniform draw in [0, bound) without modulo bias: reject the lowest 2^64 mod bound values.
std::uint64_t draw_below(std::mt19937_64& rng, std::uint64_t bound) {
  const std::uint64_t threshold = (0 - bound) % bound;
  for (;;) {
    const std::uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

}  // namespace

std::vector<std::int64_t> shuffled_order(std::int64_t n, std::uint64_t seed, std::int64_t epoch) {
  MB_CHECK(n >= 0, "[shuffled_order] negative size {}", n);
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  // seed_seq's mixing is specified by the standard, so (seed, epoch) names one stream everywhere.
  const auto e = static_cast<std::uint64_t>(epoch);
  std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                    static_cast<std::uint32_t>(e), static_cast<std::uint32_t>(e >> 32)};
  std::mt19937_64 rng(seq);
  for (std::int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<std::int64_t>(draw_below(rng, static_cast<std::uint64_t>(i) + 1));
    std::swap(order[static_cast<std::size_t>(i)], order[static_cast<std::size_t>(j)]);
  }
  return order;
}

// ---- DataLoader --------------------------------------------------------------------------------

DataLoader::DataLoader(const Dataset& dataset, DataLoaderOptions options)
    : dataset_(dataset), options_(options) {
  MB_CHECK(options_.batch_size >= 1, "[DataLoader] batch_size must be at least 1, got {}",
           options_.batch_size);
  MB_CHECK(options_.prefetch >= 0, "[DataLoader] prefetch must be >= 0, got {}", options_.prefetch);
  MB_CHECK(
      options_.num_replicas >= 1 && options_.rank >= 0 && options_.rank < options_.num_replicas,
      "[DataLoader] rank {} of num_replicas {}: need num_replicas >= 1 and 0 <= rank < "
      "num_replicas",
      options_.rank, options_.num_replicas);
  set_state({});
}

DataLoader::~DataLoader() { stop_worker(); }

std::int64_t DataLoader::samples_per_epoch() const {
  const std::int64_t n = dataset_.size(), r = options_.num_replicas;
  return n / r + (n % r != 0 ? 1 : 0);
}

std::int64_t DataLoader::num_batches() const {
  const std::int64_t n = samples_per_epoch();
  const std::int64_t b = options_.batch_size;
  return options_.drop_last ? n / b : n / b + (n % b != 0 ? 1 : 0);  // n + b - 1 could overflow
}

void DataLoader::set_epoch(std::int64_t epoch) { set_state({.epoch = epoch, .position = 0}); }

void DataLoader::set_state(LoaderState state) {
  MB_CHECK(state.epoch >= 0, "[DataLoader] epoch must be >= 0, got {}", state.epoch);
  MB_CHECK(state.position >= 0 && state.position <= num_batches(),
           "[DataLoader] position {} outside 0..{} (batches per epoch)", state.position,
           num_batches());
  stop_worker();
  state_ = state;
  const std::int64_t n = dataset_.size();
  try {
    if (options_.shuffle) {
      order_ = shuffled_order(n, options_.seed, state.epoch);
    } else {
      order_.resize(static_cast<std::size_t>(n));
      std::iota(order_.begin(), order_.end(), 0);
    }
    if (options_.num_replicas > 1 && n > 0) {
      // This rank's shard of the order padded with its own first samples (DistributedSampler).
      const std::int64_t per_rank = samples_per_epoch();
      std::vector<std::int64_t> shard(static_cast<std::size_t>(per_rank));
      for (std::int64_t i = 0; i < per_rank; ++i) {
        const std::int64_t at = options_.rank + i * options_.num_replicas;
        shard[static_cast<std::size_t>(i)] = order_[static_cast<std::size_t>(at % n)];
      }
      order_ = std::move(shard);
    }
  } catch (const std::exception& e) {  // std::bad_alloc, or std::length_error past max_size()
    MB_CHECK(false, "[DataLoader] no memory for the order of {} examples ({} bytes of indices): {}",
             n, static_cast<double>(n) * sizeof(std::int64_t), e.what());
  }
}

std::vector<std::int64_t> DataLoader::batch_indices(std::int64_t batch) const {
  MB_CHECK(batch >= 0 && batch < num_batches(), "[DataLoader] batch {} outside 0..{}", batch,
           num_batches() - 1);
  const auto begin = static_cast<std::size_t>(batch * options_.batch_size);
  const std::size_t end = std::min(order_.size(), begin + static_cast<std::size_t>(options_.batch_size));
  return {order_.begin() + static_cast<std::ptrdiff_t>(begin),
          order_.begin() + static_cast<std::ptrdiff_t>(end)};
}

Batch DataLoader::batch_for(const std::vector<std::int64_t>& indices) const {
  MB_CHECK(!indices.empty(), "[DataLoader] batch_for needs at least one index");
  std::vector<Example> examples;
  examples.reserve(indices.size());
  for (std::int64_t index : indices) examples.push_back(dataset_.get(index));
  Batch batch = collate(examples, options_.collate);
  batch.indices = indices;
  return batch;
}

std::int64_t DataLoader::items_for(const std::vector<std::int64_t>& indices) const {
  MB_CHECK(!indices.empty(), "[DataLoader] items_for needs at least one index");
  // As collate counts: padding adds only ignore_index labels, which carry no loss.
  std::int64_t items = 0;
  for (std::int64_t index : indices) {
    const Tensor label = dataset_.get(index).label;
    items += !is_integer(label.dtype())  ? 1
             : label.device().is_meta() ? label.numel()
                                        : count_not_equal(label.contiguous(), options_.collate.ignore_index);
  }
  return items;
}

std::optional<Batch> DataLoader::next() {
  if (state_.position >= num_batches()) return std::nullopt;
  if (options_.prefetch == 0) {
    Batch batch = batch_for(batch_indices(state_.position));
    ++state_.position;
    return batch;
  }
  if (!worker_.joinable()) start_worker();
  Item item;
  {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return !queue_.empty(); });
    item = std::move(queue_.front());
    queue_.pop_front();
  }
  cv_.notify_all();
  if (item.error) {
    // The worker stopped at this batch; the next call starts a fresh one that retries it.
    stop_worker();
    std::rethrow_exception(item.error);
  }
  ++state_.position;
  return std::move(item.batch);
}

void DataLoader::start_worker() {
  stop_ = false;
  worker_ = std::thread(&DataLoader::worker_loop, this, state_.position);
}

void DataLoader::stop_worker() noexcept {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) {
    try {
      worker_.join();
    } catch (...) {
      // join only fails for a thread that is not joinable or is this thread; neither happens here.
    }
  }
  queue_.clear();
  stop_ = false;
}

void DataLoader::worker_loop(std::int64_t first) {
  const std::int64_t count = num_batches();
  const auto capacity = static_cast<std::size_t>(options_.prefetch);
  for (std::int64_t b = first; b < count; ++b) {
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stop_ || queue_.size() < capacity; });
      if (stop_) return;
    }
    Item item;
    try {
      item.batch = batch_for(batch_indices(b));
    } catch (...) {
      item.error = std::current_exception();
    }
    const bool failed = item.error != nullptr;
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(item));
    }
    cv_.notify_all();
    if (failed) return;
  }
}

}  // namespace microbatch::train
