// The data layer: collate (padding, ignore_index, item counts), the seeded epoch order, the
// prefetching DataLoader (coverage, determinism, resume, worker errors), Fashion-MNIST's IDX
// validation on crafted files (and the real files when installed), and the text dataset.
#include <doctest/doctest.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <set>

#include "core/rng.h"
#include "tests/core/harness.h"
#include "train/data.h"
#include "train/fashion_mnist.h"
#include "train/text.h"

using namespace microbatch;
using namespace microbatch::train;
using microbatch::testing::ChildLimits;
using microbatch::testing::run_in_child;
using microbatch::testing::check_throws_with;
namespace fs = std::filesystem;

namespace {

// A fresh folder under the system temp dir, removed with everything in it at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path = fs::temp_directory_path() /
           ("mb_data_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// Example i: input = i (f32 scalar), label = i % 3 (i64 scalar); `bad` throws instead.
class IndexDataset : public Dataset {
 public:
  explicit IndexDataset(std::int64_t n, std::int64_t bad = -1) : n_(n), bad_(bad) {}
  std::int64_t size() const override { return n_; }
  Example get(std::int64_t i) const override {
    check_index(i, "IndexDataset");
    MB_CHECK(i != bad_, "[IndexDataset] boom at {}", i);
    return {scalar_tensor(static_cast<double>(i)), scalar_tensor(i % 3, {.dtype = DType::i64})};
  }

 private:
  std::int64_t n_, bad_;
};

std::vector<std::int64_t> as_ints(const Tensor& t) {
  std::vector<std::int64_t> out;
  for (double v : t.to_vector()) out.push_back(static_cast<std::int64_t>(v));
  return out;
}

// Every batch of the loader's current epoch from its current position, as index lists; checks
// that the inputs hold the same indices as Batch::indices.
std::vector<std::vector<std::int64_t>> drain(DataLoader& loader) {
  std::vector<std::vector<std::int64_t>> batches;
  while (auto batch = loader.next()) {
    CHECK(as_ints(batch->inputs) == batch->indices);
    CHECK(batch->num_items == batch->size());
    batches.push_back(batch->indices);
  }
  return batches;
}

// body() must throw microbatch::Error whose message contains every needle.
void expect_error(const std::function<void()>& body, const std::vector<std::string>& needles) {
  std::string message;
  try {
    body();
  } catch (const Error& e) {
    message = e.what();
  }
  REQUIRE_MESSAGE(!message.empty(), "expected an error containing " << needles.front());
  for (const auto& needle : needles)
    CHECK_MESSAGE(message.find(needle) != std::string::npos, "'" << message << "' lacks '" << needle << "'");
}

}  // namespace

// ---- collate -----------------------------------------------------------------------------------

TEST_CASE("collate stacks equal shapes and counts samples") {
  std::vector<Example> ex = {
      {from_vector({1, 2, 3, 4, 5, 6}, {2, 3}), scalar_tensor(4, {.dtype = DType::i64})},
      {from_vector({7, 8, 9, 10, 11, 12}, {2, 3}).t().contiguous().t(),  // non-contiguous input
       scalar_tensor(1, {.dtype = DType::i64})}};
  Batch b = collate(ex);
  CHECK(b.inputs.shape() == Shape{2, 2, 3});
  CHECK(b.inputs.to_vector() == std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  CHECK(b.labels.shape() == Shape{2});
  CHECK(as_ints(b.labels) == std::vector<std::int64_t>{4, 1});
  CHECK(b.num_items == 2);  // class labels: one item per sample

  ex[1].input = zeros({3, 2});
  expect_error([&] { collate(ex); }, {"[collate]", "(3, 2)", "(2, 3)", "only 1-d"});
  ex[1].input = zeros({2, 3}, {.dtype = DType::f64});
  expect_error([&] { collate(ex); }, {"[collate]", "f64", "f32"});
  expect_error([&] { collate({}); }, {"[collate] no examples"});
}

TEST_CASE("collate pads token sequences and counts only loss-bearing tokens") {
  auto seq = [](std::vector<double> v) {
    const auto n = static_cast<std::int64_t>(v.size());
    return from_vector(v, {n}, {.dtype = DType::i64});
  };
  // Lengths 3, 1, 2; the first sequence already carries one ignored label.
  std::vector<Example> ex = {{seq({1, 2, 3}), seq({2, 3, -100})},
                             {seq({4}), seq({5})},
                             {seq({6, 7}), seq({7, 8})}};
  Batch b = collate(ex, {.pad_value = 9});
  CHECK(b.inputs.shape() == Shape{3, 3});
  CHECK(as_ints(b.inputs) == std::vector<std::int64_t>{1, 2, 3, 4, 9, 9, 6, 7, 9});
  CHECK(as_ints(b.labels) == std::vector<std::int64_t>{2, 3, -100, 5, -100, -100, 7, 8, -100});
  CHECK(b.num_items == 5);  // 2 + 1 + 2 real labels that are not ignored

  Batch d = collate(ex);  // defaults: pad 0, ignore -100
  CHECK(as_ints(d.inputs) == std::vector<std::int64_t>{1, 2, 3, 4, 0, 0, 6, 7, 0});
  Batch c = collate(ex, {.ignore_index = -1});  // -100 is now an ordinary label
  CHECK(as_ints(c.labels) == std::vector<std::int64_t>{2, 3, -100, 5, -1, -1, 7, 8, -1});
  CHECK(c.num_items == 6);

  // Equal-length token batches are stacked, and still count tokens, not samples.
  Batch e = collate({{seq({1, 2}), seq({2, -100})}, {seq({3, 4}), seq({4, 5})}});
  CHECK(e.labels.shape() == Shape{2, 2});
  CHECK(e.num_items == 3);
}

// ---- epoch order -------------------------------------------------------------------------------

TEST_CASE("shuffled_order is a seeded, unbiased permutation independent of the global generator") {
  const auto a = shuffled_order(50, 7, 0);
  std::vector<std::int64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::int64_t> identity(50);
  for (std::int64_t i = 0; i < 50; ++i) identity[static_cast<std::size_t>(i)] = i;
  CHECK(sorted == identity);
  CHECK(a != identity);
  manual_seed(123);  // the global generator must not matter
  CHECK(shuffled_order(50, 7, 0) == a);
  CHECK(shuffled_order(50, 8, 0) != a);
  CHECK(shuffled_order(50, 7, 1) != a);

  // Fisher–Yates with unbiased draws gives each of the 3! orders with probability 1/6:
  // over 6000 streams each count is 1000 +- 29 (one sigma); allow 5 sigma.
  std::map<std::vector<std::int64_t>, int> counts;
  for (std::uint64_t seed = 0; seed < 6000; ++seed) ++counts[shuffled_order(3, seed, 0)];
  CHECK(counts.size() == 6);
  for (const auto& [order, count] : counts) CHECK(std::abs(count - 1000) < 150);
}

// ---- DataLoader --------------------------------------------------------------------------------

TEST_CASE("DataLoader returns every sample exactly once per epoch") {
  IndexDataset data(10);
  for (bool shuffle : {false, true}) {
    for (bool drop_last : {false, true}) {
      for (std::int64_t prefetch : {0, 2}) {
        CAPTURE(shuffle);
        CAPTURE(drop_last);
        CAPTURE(prefetch);
        DataLoader loader(data, {.batch_size = 3, .shuffle = shuffle, .seed = 5,
                                 .drop_last = drop_last, .prefetch = prefetch});
        // 10 samples in batches of 3: 3, 3, 3 and a partial 1 unless it is dropped.
        CHECK(loader.num_batches() == (drop_last ? 3 : 4));
        for (std::int64_t epoch = 0; epoch < 2; ++epoch) {
          loader.set_epoch(epoch);
          const auto batches = drain(loader);
          REQUIRE(batches.size() == (drop_last ? 3u : 4u));
          std::multiset<std::int64_t> seen;
          for (std::size_t b = 0; b < batches.size(); ++b) {
            CHECK(batches[b].size() == (b < 3 ? 3u : 1u));
            seen.insert(batches[b].begin(), batches[b].end());
          }
          CHECK(seen.size() == (drop_last ? 9u : 10u));
          CHECK(std::set<std::int64_t>(seen.begin(), seen.end()).size() == seen.size());
          CHECK(*seen.rbegin() <= 9);
          if (!shuffle && !drop_last) CHECK(batches.back() == std::vector<std::int64_t>{9});
          CHECK_FALSE(loader.next().has_value());  // the epoch stays finished
        }
      }
    }
  }
  IndexDataset even(12);  // an exact multiple: drop_last drops nothing
  DataLoader loader(even, {.batch_size = 4, .drop_last = true});
  CHECK(loader.num_batches() == 3);
  CHECK(drain(loader).back() == std::vector<std::int64_t>{8, 9, 10, 11});
  expect_error([&] { DataLoader bad(even, {.batch_size = 0}); }, {"[DataLoader] batch_size", "0"});
}

TEST_CASE("DataLoader order is a function of (seed, epoch)") {
  IndexDataset data(20);
  auto epoch_order = [&](std::uint64_t seed, std::int64_t epoch, bool shuffle = true) {
    DataLoader loader(data, {.batch_size = 6, .shuffle = shuffle, .seed = seed});
    loader.set_epoch(epoch);
    std::vector<std::int64_t> flat;
    for (const auto& b : drain(loader)) flat.insert(flat.end(), b.begin(), b.end());
    return flat;
  };
  const auto base = epoch_order(1, 0);
  CHECK(base == epoch_order(1, 0));
  CHECK(base == shuffled_order(20, 1, 0));
  CHECK(base != epoch_order(2, 0));
  CHECK(base != epoch_order(1, 1));
  std::vector<std::int64_t> in_order(20);
  for (std::int64_t i = 0; i < 20; ++i) in_order[static_cast<std::size_t>(i)] = i;
  CHECK(epoch_order(1, 3, /*shuffle=*/false) == in_order);
}

TEST_CASE("DataLoader prefetch gives the same batches as no prefetch") {
  IndexDataset data(23);
  std::vector<std::vector<Batch>> runs;
  for (std::int64_t prefetch : {0, 1, 3, 50}) {
    DataLoader loader(data, {.batch_size = 4, .shuffle = true, .seed = 9, .prefetch = prefetch});
    runs.emplace_back();
    for (std::int64_t epoch : {0, 1}) {
      loader.set_epoch(epoch);
      while (auto b = loader.next()) runs.back().push_back(std::move(*b));
    }
  }
  for (std::size_t r = 1; r < runs.size(); ++r) {
    REQUIRE(runs[r].size() == runs[0].size());
    for (std::size_t i = 0; i < runs[0].size(); ++i) {
      CHECK(runs[r][i].indices == runs[0][i].indices);
      CHECK(runs[r][i].inputs.to_vector() == runs[0][i].inputs.to_vector());
      CHECK(runs[r][i].labels.to_vector() == runs[0][i].labels.to_vector());
      CHECK(runs[r][i].num_items == runs[0][i].num_items);
    }
  }
}

TEST_CASE("DataLoader set_state resumes at the exact batch") {
  IndexDataset data(30);
  for (std::int64_t prefetch : {0, 2}) {
    CAPTURE(prefetch);
    const DataLoaderOptions options{.batch_size = 4, .shuffle = true, .seed = 3, .prefetch = prefetch};
    DataLoader full(data, options);
    full.set_epoch(2);
    const auto expected = drain(full);

    DataLoader first(data, options);
    first.set_epoch(2);
    for (int i = 0; i < 3; ++i) REQUIRE(first.next().has_value());
    const LoaderState saved = first.state();
    CHECK(saved == LoaderState{.epoch = 2, .position = 3});

    DataLoader resumed(data, options);  // a fresh loader, as after a restart
    resumed.set_state(saved);
    const auto rest = drain(resumed);
    CHECK(rest == std::vector<std::vector<std::int64_t>>(expected.begin() + 3, expected.end()));
    CHECK(resumed.state() == LoaderState{.epoch = 2, .position = 8});

    first.set_state({.epoch = 2, .position = 1});  // rewinding a loader whose worker is running
    CHECK(drain(first) == std::vector<std::vector<std::int64_t>>(expected.begin() + 1, expected.end()));
    expect_error([&] { first.set_state({.epoch = 0, .position = 9}); }, {"[DataLoader] position 9"});
  }
}

TEST_CASE("DataLoader rethrows dataset errors from next() and shuts its worker down") {
  IndexDataset data(12, /*bad=*/7);
  for (std::int64_t prefetch : {0, 2}) {
    CAPTURE(prefetch);
    DataLoader loader(data, {.batch_size = 2, .prefetch = prefetch});
    for (int i = 0; i < 3; ++i) REQUIRE(loader.next().has_value());
    expect_error([&] { loader.next(); }, {"boom at 7"});  // batch 3 = samples 6, 7
    CHECK(loader.state().position == 3);
    expect_error([&] { loader.next(); }, {"boom at 7"});  // a retry meets the same sample
    loader.set_state({.epoch = 0, .position = 4});
    CHECK(drain(loader).size() == 2);
  }
  {
    // Destroyed while its worker waits on a full queue: the destructor must stop and join it.
    IndexDataset big(1000);
    DataLoader loader(big, {.batch_size = 1, .prefetch = 2});
    REQUIRE(loader.next().has_value());
  }
}

TEST_CASE("DataLoader batch_for collates an arbitrary index list") {
  IndexDataset data(10);
  DataLoader loader(data, {.batch_size = 4, .shuffle = true, .seed = 1});
  Batch b = loader.batch_for({5, 2, 2});
  CHECK(b.indices == std::vector<std::int64_t>{5, 2, 2});
  CHECK(as_ints(b.inputs) == std::vector<std::int64_t>{5, 2, 2});
  CHECK(as_ints(b.labels) == std::vector<std::int64_t>{2, 2, 2});
  CHECK(b.num_items == 3);
  const auto order = shuffled_order(10, 1, 0);
  CHECK(loader.batch_indices(0) == std::vector<std::int64_t>(order.begin(), order.begin() + 4));
  expect_error([&] { loader.batch_for({3, 10}); }, {"[IndexDataset] index 10 out of range", "10 examples"});
  expect_error([&] { loader.batch_indices(3); }, {"[DataLoader] batch 3"});
}

TEST_CASE("TensorDataset pairs rows of two tensors") {
  TensorDataset data(arange(0, 6).reshape({3, 2}), from_vector({0, 1, 0}, {3}, {.dtype = DType::i64}));
  CHECK(data.size() == 3);
  CHECK(data.get(1).input.to_vector() == std::vector<double>{2, 3});
  CHECK(data.get(1).label.item() == 1);
  expect_error([&] { data.get(3); }, {"[TensorDataset] index 3 out of range"});
  expect_error([&] { TensorDataset(zeros({3, 2}), zeros({4})); }, {"[TensorDataset]", "(3, 2)", "(4,)"});
}

// ---- Fashion-MNIST -----------------------------------------------------------------------------

namespace {

// IDX bytes: a big-endian magic, big-endian dims, then `data`.
std::string idx_file(std::uint32_t magic, const std::vector<std::uint32_t>& dims, const std::string& data) {
  std::string out;
  auto put = [&](std::uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) out += static_cast<char>((v >> shift) & 0xFF);
  };
  put(magic);
  for (std::uint32_t d : dims) put(d);
  return out + data;
}

void write_gz(const std::string& path, const std::string& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) == static_cast<int>(bytes.size()));
  REQUIRE(gzclose(f) == Z_OK);
}

void write_plain(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Three 28x28 images; image 0 starts with pixels 255, 51, 0; labels 9, 0, 4.
std::string fake_pixels() {
  std::string px(3 * 28 * 28, '\0');
  for (std::size_t k = 0; k < px.size(); ++k) px[k] = static_cast<char>((k * 7) % 256);
  px[0] = static_cast<char>(255), px[1] = 51, px[2] = 0;
  return px;
}
const std::string kFakeLabels("\x09\x00\x04", 3);

}  // namespace

TEST_CASE("FashionMNIST reads small IDX files, compressed or not") {
  const std::string px = fake_pixels();
  for (bool gz : {true, false}) {
    CAPTURE(gz);
    TempDir dir;
    auto write = gz ? write_gz : write_plain;
    write(dir.file(gz ? "t10k-images-idx3-ubyte.gz" : "t10k-images-idx3-ubyte"),
          idx_file(0x00000803, {3, 28, 28}, px));
    write(dir.file(gz ? "t10k-labels-idx1-ubyte.gz" : "t10k-labels-idx1-ubyte"),
          idx_file(0x00000801, {3}, kFakeLabels));
    FashionMNIST data(dir.path.string(), Split::Test);
    REQUIRE(data.size() == 3);
    Example e = data.get(0);
    CHECK(e.input.shape() == Shape{28, 28});
    CHECK(e.input.dtype() == DType::f32);
    CHECK(e.label.dim() == 0);
    CHECK(e.label.dtype() == DType::i64);
    CHECK(e.label.item() == 9);
    const float* p = e.input.data<float>();
    CHECK(p[0] == 1.0f);  // 255 maps to exactly one
    CHECK(p[1] == 0.2f);  // 51 / 255 = 0.2, correctly rounded
    CHECK(p[2] == 0.0f);
    CHECK(data.get(2).input.data<float>()[5] == static_cast<float>((2 * 784 + 5) * 7 % 256) / 255.0f);
    CHECK(data.label(2) == 4);
    expect_error([&] { data.get(3); }, {"[FashionMNIST] index 3 out of range"});
    expect_error([&] { FashionMNIST(dir.path.string(), Split::Train); }, {"missing", "train-images-idx3-ubyte.gz"});
  }
  expect_error([] { FashionMNIST("/nonexistent", Split::Val); }, {"[FashionMNIST] has no val split"});
}

TEST_CASE("FashionMNIST rejects malformed IDX files with a clear message") {
  const std::string px = fake_pixels();
  const std::string good_images = idx_file(0x00000803, {3, 28, 28}, px);
  const std::string good_labels = idx_file(0x00000801, {3}, kFakeLabels);
  struct Case {
    const char* what;
    std::string images, labels;
    std::vector<std::string> needles;
    bool names_labels = false;  // the message names the label file rather than the image file
  };
  const std::vector<Case> cases = {
      {"gzip header read as IDX", idx_file(0x1F8B0808, {3, 28, 28}, px), good_labels,
       {"magic 0x1F8B0808", "gzip header read as IDX"}},
      {"byte-swapped magic", idx_file(0x03080000, {3, 28, 28}, px), good_labels,
       {"magic 0x03080000", "byte-swapped"}},
      {"not IDX at all", "PK\x03\x04 and more bytes", good_labels, {"not an IDX file", "0x504B0304"}},
      {"f32 data type", idx_file(0x00000D03, {3, 28, 28}, px), good_labels, {"data type 0x0D (f32)"}},
      {"labels where images belong", good_labels, good_labels, {"has 1 dimensions, expected 3 for images"}},
      {"images where labels belong", good_images, good_images, {"has 3 dimensions, expected 1 for labels"}, true},
      {"27x28 images", idx_file(0x00000803, {3, 27, 28}, px.substr(0, 3 * 27 * 28)), good_labels,
       {"images are 27x28, expected 28x28"}},
      {"zero images", idx_file(0x00000803, {0, 28, 28}, ""), good_labels, {"item count 0 outside"}},
      {"truncated magic", std::string("\0\0", 2), good_labels, {"truncated", "got 2"}},
      {"truncated dims", idx_file(0x00000803, {3}, ""), good_labels,
       {"truncated", "expected at least 16 bytes of IDX header, got 8"}},
      // 16 header bytes + 3 * 784 pixels expected, 16 + 2 * 784 present.
      {"truncated pixels", idx_file(0x00000803, {3, 28, 28}, px.substr(0, 2 * 784)), good_labels,
       {"truncated", "expected 2368 bytes, got 1584"}},
      {"truncated labels", good_images, idx_file(0x00000801, {3}, "\x09"), {"expected 11 bytes, got 9"}, true},
      {"trailing bytes", good_images + "x", good_labels, {"trailing bytes", "2368"}},
      {"count mismatch", good_images, idx_file(0x00000801, {2}, std::string("\x09\x00", 2)),
       {"holds 3 images but", "holds 2 labels"}, true},
      {"label out of range", good_images, idx_file(0x00000801, {3}, std::string("\x09\x0A\x04", 3)),
       {"label 10 at index 1 outside 0..9"}, true},
  };
  for (const Case& c : cases) {
    CAPTURE(c.what);
    TempDir dir;
    write_gz(dir.file("train-images-idx3-ubyte.gz"), c.images);
    write_gz(dir.file("train-labels-idx1-ubyte.gz"), c.labels);
    std::vector<std::string> needles = c.needles;
    needles.push_back(dir.file(c.names_labels ? "train-labels-idx1-ubyte.gz" : "train-images-idx3-ubyte.gz"));
    expect_error([&] { FashionMNIST(dir.path.string(), Split::Train); }, needles);
  }
  {
    // A gzip stream cut in the middle is a read error naming the file, not a short IDX file.
    TempDir dir;
    const std::string path = dir.file("train-images-idx3-ubyte.gz");
    write_gz(path, good_images);
    fs::resize_file(path, fs::file_size(path) / 2);
    write_gz(dir.file("train-labels-idx1-ubyte.gz"), good_labels);
    expect_error([&] { FashionMNIST(dir.path.string(), Split::Train); }, {path, "read failed"});
  }
}

TEST_CASE("FashionMNIST reads gzip as Python's gzip does: members in a row, zero padding, nothing else") {
  // Note [Reading gzip] (train/fashion_mnist.cpp).
  const std::string images = idx_file(0x00000803, {3, 28, 28}, fake_pixels());
  const std::string labels = idx_file(0x00000801, {3}, kFakeLabels);
  auto gz_bytes = [](const std::string& bytes) {
    TempDir tmp;
    write_gz(tmp.file("x.gz"), bytes);
    std::ifstream in(tmp.file("x.gz"), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string whole = gz_bytes(images);
  auto load = [&](const std::string& image_file_bytes) {
    TempDir dir;
    write_plain(dir.file("train-images-idx3-ubyte.gz"), image_file_bytes);
    write_gz(dir.file("train-labels-idx1-ubyte.gz"), labels);
    FashionMNIST data(dir.path.string(), Split::Train);
    REQUIRE(data.size() == 3);
    CHECK(data.label(2) == 4);
    CHECK(std::memcmp(data.pixels(2), fake_pixels().data() + 2 * 784, 784) == 0);
  };
  SUBCASE("two members, split inside the pixels, read as one stream") {
    load(gz_bytes(images.substr(0, 1000)) + gz_bytes(images.substr(1000)));
  }
  SUBCASE("zero padding after the stream, and between members") {
    load(whole + std::string(100, '\0'));
    load(gz_bytes(images.substr(0, 7)) + std::string(3, '\0') + gz_bytes(images.substr(7)));
  }
  auto refused = [&](const std::string& image_file_bytes, std::vector<std::string> needles) {
    TempDir dir;
    const std::string path = dir.file("train-images-idx3-ubyte.gz");
    write_plain(path, image_file_bytes);
    write_gz(dir.file("train-labels-idx1-ubyte.gz"), labels);
    needles.push_back(path);
    expect_error([&] { FashionMNIST(dir.path.string(), Split::Train); }, needles);
  };
  SUBCASE("garbage after the stream names its offset") {
    refused(whole + "junk", {"garbage after the gzip stream",
                             fmt::format("byte {} of the file (0x6A)", whole.size())});
    // After zero padding too: the offset is the garbage's, past the zeros.
    refused(whole + std::string(5, '\0') + "\x01",
            {"garbage after the gzip stream", fmt::format("byte {} of the file (0x01)", whole.size() + 5)});
    // A lone id byte is not a member.
    refused(whole + "\x1f", {"garbage after the gzip stream", "(0x1F)"});
  }
  SUBCASE("a wrong CRC or length in the trailer") {
    std::string bad = whole;
    bad[bad.size() - 8] = static_cast<char>(bad[bad.size() - 8] ^ 0x01);  // CRC-32's first byte
    refused(bad, {"read failed", "incorrect data check"});
    bad = whole;
    bad[bad.size() - 4] = static_cast<char>(bad[bad.size() - 4] ^ 0x01);  // ISIZE's first byte
    refused(bad, {"read failed", "incorrect length check"});
  }
  SUBCASE("a stream cut short, at its trailer or in its data") {
    refused(whole.substr(0, whole.size() - 3), {"read failed", "cut short"});
    refused(whole.substr(0, whole.size() / 2), {"read failed", "cut short"});
  }
}

TEST_CASE("FashionMNIST on damaged gzip files: the right data or an error naming the file, never a crash") {
  // 300 seeded damages of one compressed image file: a byte changed, the file cut, bytes added.
  // Each load either gives back exactly the original pixels (a change the format cannot see,
  // such as one in the header's file name or time) or throws microbatch::Error naming the file.
  const std::string px = fake_pixels();
  const std::string images = idx_file(0x00000803, {3, 28, 28}, px);
  TempDir src;
  write_gz(src.file("x.gz"), images);
  std::ifstream in(src.file("x.gz"), std::ios::binary);
  const std::string whole((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TempDir dir;
  const std::string path = dir.file("train-images-idx3-ubyte.gz");
  write_gz(dir.file("train-labels-idx1-ubyte.gz"), idx_file(0x00000801, {3}, kFakeLabels));
  std::mt19937 gen(7);
  int loaded = 0, refused = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::string damaged = whole;
    const auto at = static_cast<std::size_t>(gen() % damaged.size());
    switch (trial % 3) {
      case 0: damaged[at] = static_cast<char>(damaged[at] ^ (1 + gen() % 255)); break;
      case 1: damaged.resize(at); break;
      default: {
        const auto count = static_cast<std::size_t>(1 + gen() % 8);
        damaged += std::string(count, static_cast<char>(gen() % 256));
        break;
      }
    }
    write_plain(path, damaged);
    CAPTURE(trial);
    try {
      FashionMNIST data(dir.path.string(), Split::Train);
      REQUIRE(data.size() == 3);
      CHECK(std::memcmp(data.pixels(0), px.data(), px.size()) == 0);
      ++loaded;
    } catch (const Error& e) {
      CHECK_MESSAGE(std::string(e.what()).find(path) != std::string::npos, e.what());
      ++refused;
    }
  }
  // Most damages are seen; a few land where gzip does not look (or append zero padding).
  CHECK(refused > 250);
  MESSAGE(loaded << " of 300 damaged files loaded with the original pixels, " << refused << " refused");
}

TEST_CASE("FashionMNIST finds a header's huge count truncated without allocating for it") {
  // The largest count allowed, 2^32 / 784 images of 28x28 (4 GiB), with 100 bytes present: the
  // loader must find the file truncated with memory for what is there, well within 256 MiB.
  TempDir dir;
  write_gz(dir.file("train-images-idx3-ubyte.gz"),
           idx_file(0x00000803, {5478274, 28, 28}, std::string(100, '\0')));
  write_gz(dir.file("train-labels-idx1-ubyte.gz"), idx_file(0x00000801, {3}, kFakeLabels));
  const std::string report = run_in_child(
      [&] {
        FashionMNIST(dir.path.string(), Split::Train);
        return std::string("accepted");
      },
      {.headroom_bytes = std::size_t{256} << 20});
  CHECK(report == "Error: [FashionMNIST] " + dir.file("train-images-idx3-ubyte.gz") +
                      ": truncated: expected 4294966832 bytes, got 116");
}

namespace {
bool have_fashion_mnist() {
  for (const char* name : {"train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                           "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"})
    if (!fs::exists(fs::path(kFashionMnistRoot) / name)) return false;
  return true;
}
}  // namespace

TEST_CASE("FashionMNIST real files: sizes, classes and pixel range" * doctest::skip(!have_fashion_mnist())) {
  for (auto [split, n] : {std::pair{Split::Train, 60000}, std::pair{Split::Test, 10000}}) {
    FashionMNIST data(kFashionMnistRoot, split);
    REQUIRE(data.size() == n);
    std::vector<int> per_class(10, 0);
    for (std::int64_t i = 0; i < n; ++i) ++per_class[static_cast<std::size_t>(data.label(i))];
    for (int count : per_class) CHECK(count == n / 10);  // the classes are balanced
    CHECK(data.label(0) == 9);                           // both splits open with an ankle boot
    double lo = 1.0, hi = 0.0;
    for (std::int64_t i = 0; i < 100; ++i) {
      for (double v : data.get(i).input.to_vector()) lo = std::min(lo, v), hi = std::max(hi, v);
    }
    CHECK(lo == 0.0);
    CHECK(hi == 1.0);
  }
}

// ---- text --------------------------------------------------------------------------------------

TEST_CASE("TextDataset at the byte level: split, blocks and the label shift") {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 105; ++i) text += static_cast<char>('a' + (i * 5) % 26);
  write_plain(dir.file("t.txt"), text);
  auto bytes = [&](std::size_t from, std::size_t n) {
    std::vector<double> v;
    for (std::size_t k = from; k < from + n; ++k) v.push_back(static_cast<unsigned char>(text[k]));
    return v;
  };
  // 105 tokens: train = the first int(105 * 0.9) = 94, val = the last 11.
  TextDataset train(dir.file("t.txt"), {.block_size = 4});
  TextDataset val(dir.file("t.txt"), {.block_size = 4, .split = Split::Val});
  CHECK(train.vocab_size() == 256);
  CHECK(train.tokens().size() == 94);
  CHECK(val.tokens().size() == 11);
  CHECK(train.size() == 23);  // (94 - 1) / 4 whole blocks, each with its shifted label
  CHECK(val.size() == 2);     // (11 - 1) / 4
  Example e = train.get(1);   // blocks do not overlap: block 1 starts at token 4
  CHECK(e.input.dtype() == DType::i64);
  CHECK(e.input.to_vector() == bytes(4, 4));
  CHECK(e.label.to_vector() == bytes(5, 4));
  CHECK(val.get(1).input.to_vector() == bytes(94 + 4, 4));
  CHECK(val.get(1).label.to_vector() == bytes(94 + 5, 4));
  CHECK(train.decode(train.encode("\xFF\x01 any bytes")) == "\xFF\x01 any bytes");

  DataLoader loader(train, {.batch_size = 5});
  Batch b = *loader.next();
  CHECK(b.labels.shape() == Shape{5, 4});
  CHECK(b.num_items == 20);  // every label of a full block carries loss
  expect_error([&] { TextDataset(dir.file("t.txt"), {.block_size = 11, .split = Split::Val}); },
               {"the val split has 11 tokens, fewer than block_size + 1 = 12"});
  expect_error([&] { TextDataset(dir.file("missing.txt"), {}); }, {"cannot open", "missing.txt"});
}

TEST_CASE("TextDataset at the char level: shared vocabulary, round trip, UTF-8 validation") {
  TempDir dir;
  // a b c a b é é a ✓  ->  sorted code points a, b, c, é (U+E9), ✓ (U+2713) get ids 0..4.
  write_plain(dir.file("c.txt"), "abcab\xC3\xA9\xC3\xA9" "a\xE2\x9C\x93");
  // 9 tokens, val_fraction 0.25: train = the first int(6.75) = 6, val = the last 3 (é a ✓).
  const TextOptions options{.block_size = 2, .level = TextLevel::Char, .val_fraction = 0.25};
  TextDataset train(dir.file("c.txt"), options);
  TextOptions val_options = options;
  val_options.split = Split::Val;
  TextDataset val(dir.file("c.txt"), val_options);
  CHECK(train.vocab_size() == 5);
  CHECK(val.vocab_size() == 5);
  CHECK(train.tokens() == std::vector<std::int32_t>{0, 1, 2, 0, 1, 3});
  CHECK(val.tokens() == std::vector<std::int32_t>{3, 0, 4});
  CHECK(train.size() == 2);
  CHECK(as_ints(val.get(0).input) == std::vector<std::int64_t>{3, 0});
  CHECK(as_ints(val.get(0).label) == std::vector<std::int64_t>{0, 4});
  CHECK(val.encode("\xE2\x9C\x93\xC3\xA9" "a") == std::vector<std::int64_t>{4, 3, 0});
  CHECK(val.decode({4, 3, 0, 2}) == "\xE2\x9C\x93\xC3\xA9" "ac");
  expect_error([&] { train.encode("abz"); }, {"U+007A", "not in the vocabulary"});
  expect_error([&] { train.decode({5}); }, {"token 5", "outside 0..4"});

  struct Bad {
    std::string bytes;
    std::size_t offset;
    std::string reason;
  };
  const std::vector<Bad> bad = {
      {"ab\x80", 2, "unexpected continuation byte 0x80"},
      {"a\xC3(", 1, "not a continuation byte"},
      {"ab\xC0\xAF", 2, "overlong"},
      {"\xED\xA0\x80", 0, "surrogate U+D800"},
      {"abc\xF4\x90\x80\x80", 3, "above U+10FFFF"},
      {"xy\xE2\x82", 2, "cut off by the end"},
      {"\xFF", 0, "invalid byte 0xFF"},
  };
  for (const Bad& b : bad) {
    CAPTURE(b.reason);
    write_plain(dir.file("bad.txt"), b.bytes);
    expect_error([&] { TextDataset(dir.file("bad.txt"), {.block_size = 1, .level = TextLevel::Char}); },
                 {dir.file("bad.txt"), "invalid UTF-8 at byte offset " + std::to_string(b.offset), b.reason});
    expect_error([&] { train.encode(b.bytes); }, {"byte offset " + std::to_string(b.offset)});
  }
  write_plain(dir.file("bytes.txt"), "abc\xFF\xFE" "def");
  CHECK(TextDataset(dir.file("bytes.txt"), {.block_size = 2}).size() == 3);  // (int(8 * 0.9) - 1) / 2
}

TEST_CASE("TextDataset refuses a path that is not a regular file") {
  TempDir dir;
  // A folder: the stream opens, and its first read threw std::ios_base::failure.
  fs::create_directories(dir.path / "folder.txt");
  expect_error([&] { TextDataset(dir.file("folder.txt"), {}); },
               {"[TextDataset] " + dir.file("folder.txt") + " is not a regular file"});
  // A FIFO: opening it waits for a writer, so the check runs in a child that a hang cannot stall.
  REQUIRE(::mkfifo(dir.file("fifo.txt").c_str(), 0600) == 0);
  const std::string report = run_in_child(
      [&] {
        TextDataset(dir.file("fifo.txt"), {});
        return std::string("accepted");
      },
      {.seconds = 5});
  CHECK(report == "Error: [TextDataset] " + dir.file("fifo.txt") + " is not a regular file");
}

TEST_CASE("TextDataset compares block_size + 1 with the tokens without overflow") {
  TempDir dir;
  write_plain(dir.file("t.txt"), std::string(20, 'a'));  // train 18 tokens, val 2
  CHECK(TextDataset(dir.file("t.txt"), {.block_size = 17}).size() == 1);  // exactly enough
  expect_error([&] { TextDataset(dir.file("t.txt"), {.block_size = 18}); },
               {"the train split has 18 tokens, fewer than block_size + 1 = 19"});
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max();  // + 1 overflows an i64
  expect_error([&] { TextDataset(dir.file("t.txt"), {.block_size = huge}); },
               {"the train split has 18 tokens, fewer than block_size + 1 = 9223372036854775808"});
}

namespace {
const std::string kShakespeare = std::string(MB_SHARED_DATA_DIR) + "/tinyshakespeare.txt";
}

TEST_CASE("TextDataset on tinyshakespeare" * doctest::skip(!fs::exists(kShakespeare))) {
  std::ifstream in(kShakespeare, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TextDataset train(kShakespeare, {.block_size = 256, .level = TextLevel::Char});
  TextDataset val(kShakespeare, {.block_size = 256, .level = TextLevel::Char, .split = Split::Val});
  // The figures nanoGPT's shakespeare_char preparation prints for this file.
  CHECK(train.vocab_size() == 65);
  CHECK(train.tokens().size() == 1003854);
  CHECK(val.tokens().size() == 111540);
  CHECK(train.size() == (1003854 - 1) / 256);
  std::vector<std::int64_t> all(train.tokens().begin(), train.tokens().end());
  CHECK(train.decode(all) == text.substr(0, 1003854));  // the file is ASCII: one char, one byte
  Example a = train.get(7), b = train.get(8);
  auto x = as_ints(a.input), y = as_ints(a.label);
  CHECK(std::equal(y.begin(), y.end() - 1, x.begin() + 1));  // label = input shifted by one
  CHECK(y.back() == as_ints(b.input).front());              // ... and runs into the next block
  CHECK(train.decode(x) == text.substr(7 * 256, 256));
  TextDataset bytes(kShakespeare, {.block_size = 256});
  CHECK(bytes.decode(as_ints(bytes.get(0).input)) == text.substr(0, 256));
}

TEST_CASE("collate counts only the class labels that carry loss") {
  // A sample labelled ignore_index carries no loss in cross_entropy; counting it would give its
  // micro-batch too large a share of an accumulation window (Note [Batch items]).
  std::vector<Example> ex;
  for (std::int64_t label : {3, -100, 0, -100})
    ex.push_back({zeros({2}), scalar_tensor(static_cast<double>(label), {.dtype = DType::i64})});
  CHECK(collate(ex).num_items == 2);
  CHECK(collate(ex, {.ignore_index = 3}).num_items == 3);
  // Soft labels (a distribution per sample) all carry loss.
  std::vector<Example> soft = {{zeros({2}), from_vector({0.5, 0.5}, {2})},
                               {zeros({2}), from_vector({1.0, 0.0}, {2})}};
  CHECK(collate(soft).num_items == 2);
}

TEST_CASE("DataLoader: a batch size near the int64 limit is one batch of everything") {
  // (n + b - 1) / b overflowed: 0 batches, and an evaluation that silently reported loss 0.
  IndexDataset data(10);
  for (std::int64_t b : {std::numeric_limits<std::int64_t>::max(),
                         std::numeric_limits<std::int64_t>::max() - 5}) {
    CAPTURE(b);
    DataLoader loader(data, {.batch_size = b});
    CHECK(loader.num_batches() == 1);
    const auto batches = drain(loader);
    REQUIRE(batches.size() == 1u);
    CHECK(batches[0].size() == 10u);
  }
}

TEST_CASE("collate refuses a padding value that the labels' dtype cannot hold") {
  // -100 in u8 would become 156 and count as a real label.
  std::vector<Example> ex = {{zeros({3}), from_vector({1, 2, 3}, {3}, {.dtype = DType::u8})},
                             {zeros({1}), from_vector({4}, {1}, {.dtype = DType::u8})}};
  expect_error([&] { collate(ex); },
               {"[collate] the label padding value -100 is not a value of their dtype u8"});
  CHECK(collate(ex, {.ignore_index = 255}).num_items == 4);
  for (Example& e : ex) e.label = e.label.to(DType::i32);
  expect_error([&] { collate(ex, {.ignore_index = 5000000000}); },
               {"[collate] the label padding value 5000000000 is not a value of their dtype i32"});
  CHECK(collate(ex).num_items == 4);
}

TEST_CASE("FashionMNIST refuses a folder or a FIFO where an IDX file belongs") {
  TempDir dir;
  fs::create_directories(dir.path / "train-images-idx3-ubyte.gz");
  expect_error([&] { FashionMNIST(dir.path.string(), Split::Train); },
               {"[FashionMNIST] " + dir.file("train-images-idx3-ubyte.gz") + " is not a regular file"});
  fs::remove(dir.path / "train-images-idx3-ubyte.gz");
  // gzopen waited for a writer: the check runs in a child that a hang cannot stall.
  REQUIRE(::mkfifo(dir.file("train-images-idx3-ubyte.gz").c_str(), 0600) == 0);
  const std::string report = run_in_child(
      [&] {
        FashionMNIST(dir.path.string(), Split::Train);
        return std::string("accepted");
      },
      {.seconds = 5});
  CHECK(report == "Error: [FashionMNIST] " + dir.file("train-images-idx3-ubyte.gz") +
                      " is not a regular file");
}
