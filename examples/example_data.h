// The examples' data: Fashion-MNIST's training set where Debian's dataset-fashion-mnist is
// installed, else a small synthetic stand-in of the same shape (said on stderr).
#pragma once

#include <filesystem>
#include <iostream>
#include <memory>

#include "core/ops.h"
#include "train/data.h"
#include "train/fashion_mnist.h"

namespace microbatch::examples {

inline std::unique_ptr<train::Dataset> example_dataset() {
  if (std::filesystem::exists(std::string(train::kFashionMnistRoot) + "/train-images-idx3-ubyte.gz")) {
    return std::make_unique<train::FashionMNIST>();
  }
  std::cerr << "Fashion-MNIST not found under " << train::kFashionMnistRoot
            << "; using 512 synthetic images\n";
  Tensor images = rand({512, 28, 28});
  Tensor labels = (rand({512}) * 10.0).to(DType::i64);
  return std::make_unique<train::TensorDataset>(images, labels);
}

/// The matching test set (Fashion-MNIST's 10000 test images, or another synthetic set).
inline std::unique_ptr<train::Dataset> example_test_dataset() {
  if (std::filesystem::exists(std::string(train::kFashionMnistRoot) + "/t10k-images-idx3-ubyte.gz")) {
    return std::make_unique<train::FashionMNIST>(train::kFashionMnistRoot, train::Split::Test);
  }
  Tensor images = rand({256, 28, 28});
  Tensor labels = (rand({256}) * 10.0).to(DType::i64);
  return std::make_unique<train::TensorDataset>(images, labels);
}

}  // namespace microbatch::examples
