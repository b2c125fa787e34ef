// A text file as next-token examples (and, for benchmarks, random tokens of the same shape): the
// file is encoded once (bytes or Unicode code points), split into train (the first
// 1 - val_fraction of the tokens) and val (the rest), and cut into blocks.
//
// Blocks do not overlap: block i starts at token i * block_size of its split, with
// input = tokens[s : s + block_size] and label = tokens[s + 1 : s + 1 + block_size] (both i64),
// so an epoch reads each token of the split once as an input.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "train/data.h"

namespace microbatch::train {

/// Byte: 256 tokens, any file. Char: one token per Unicode code point of a valid UTF-8 file.
enum class TextLevel { Byte, Char };

struct TextOptions {
  std::int64_t block_size = 64;
  TextLevel level = TextLevel::Byte;
  Split split = Split::Train;     // Train or Val
  double val_fraction = 0.1;      // train = the first floor(n * (1 - val_fraction)) tokens
};

class TextDataset : public Dataset {
 public:
  TextDataset(const std::string& path, TextOptions options);

  /// Number of blocks in the split: floor((split tokens - 1) / block_size).
  std::int64_t size() const override;
  Example get(std::int64_t index) const override;

  /// 256 at the byte level; at the char level, the distinct code points of the whole file (so the
  /// train and val splits of one file share it).
  std::int64_t vocab_size() const;
  /// Token ids of `text`; at the char level, `text` must be UTF-8 of code points in the vocabulary.
  std::vector<std::int64_t> encode(const std::string& text) const;
  /// The text of `tokens` (ids in 0..vocab_size()-1).
  std::string decode(const std::vector<std::int64_t>& tokens) const;

  /// The tokens of this split, in file order.
  const std::vector<std::int32_t>& tokens() const { return tokens_; }
  /// Sorted code points of the char vocabulary (token id = position); empty at the byte level.
  const std::vector<char32_t>& code_points() const { return code_points_; }
  const TextOptions& options() const { return options_; }

 private:
  std::string path_;
  TextOptions options_;
  std::vector<char32_t> code_points_;  // char level: id -> code point, sorted
  std::vector<std::int32_t> tokens_;   // this split's tokens
};

struct SyntheticTokensOptions {
  std::int64_t vocab_size = 50257;
  std::int64_t block_size = 1024;  // tokens per example
  std::int64_t size = 10000;       // examples
  std::uint64_t seed = 0;
};

/// Seeded uniform random tokens, for speed and memory benchmarks only: there is nothing in them to
/// learn (the loss stays near ln(vocab_size)). Example i depends on (seed, i) alone and is made on
/// demand, so a dataset of any size holds no memory; input and label are shaped as TextDataset's
/// (T) next-token pairs.
class SyntheticTokens : public Dataset {
 public:
  explicit SyntheticTokens(SyntheticTokensOptions options = {});
  std::int64_t size() const override { return options_.size; }
  Example get(std::int64_t index) const override;
  std::int64_t vocab_size() const { return options_.vocab_size; }
  const SyntheticTokensOptions& options() const { return options_; }

 private:
  SyntheticTokensOptions options_;
};

}  // namespace microbatch::train
