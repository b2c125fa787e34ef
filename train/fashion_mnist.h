// Fashion-MNIST from its IDX files (gzip-compressed or plain), validated before any size read from
// them is trusted (REFERENCE.md, "IDX"). Example i: input (28, 28) f32 = pixel / 255 (so 255 maps
// to exactly 1.0), label an i64 scalar in 0..9.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "train/data.h"

namespace microbatch::train {

/// Where Debian's dataset-fashion-mnist package installs the four .gz files.
inline constexpr const char* kFashionMnistRoot = "/usr/share/datasets/fashion-mnist";

class FashionMNIST : public Dataset {
 public:
  static constexpr std::int64_t kRows = 28;
  static constexpr std::int64_t kCols = 28;
  static constexpr std::int64_t kNumClasses = 10;

  /// Reads `root`/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (or the same names without .gz).
  /// Split::Train has 60000 examples and Split::Test 10000 in the real files; Split::Val is refused.
  explicit FashionMNIST(const std::string& root = kFashionMnistRoot, Split split = Split::Train);

  std::int64_t size() const override { return static_cast<std::int64_t>(labels_.size()); }
  Example get(std::int64_t index) const override;

  /// The class of example `index`, 0..9.
  std::int64_t label(std::int64_t index) const;
  /// The raw pixels of example `index`, row-major, kRows * kCols bytes.
  const std::uint8_t* pixels(std::int64_t index) const;
  /// "T-shirt/top", "Trouser", ..., "Ankle boot".
  static const std::array<const char*, 10>& class_names();

  const std::string& images_path() const { return images_path_; }
  const std::string& labels_path() const { return labels_path_; }

 private:
  std::string images_path_;
  std::string labels_path_;
  std::vector<std::uint8_t> images_;  // (N, 28, 28)
  std::vector<std::uint8_t> labels_;  // (N)
};

}  // namespace microbatch::train
