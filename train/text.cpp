// TextDataset: strict UTF-8 decoding, the byte or code-point vocabulary, the train/val split and
// the non-overlapping next-token blocks (see train/text.h).
#include "train/text.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string_view>

#include "core/rng.h"

namespace microbatch::train {

namespace {

struct Utf8Error {
  std::size_t offset = 0;  // byte offset of the first byte of the bad sequence
  std::string reason;
};

// Decodes strict UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF).
// Returns false at the first invalid sequence and says where and why in `error`.
bool decode_utf8(std::string_view s, std::vector<char32_t>& out, Utf8Error& error) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto lead = static_cast<unsigned char>(s[i]);
    std::size_t len = 0;
    char32_t cp = 0;
    if (lead < 0x80) {
      out.push_back(lead);
      ++i;
      continue;
    } else if ((lead & 0xE0) == 0xC0) {
      len = 2, cp = lead & 0x1F;
    } else if ((lead & 0xF0) == 0xE0) {
      len = 3, cp = lead & 0x0F;
    } else if ((lead & 0xF8) == 0xF0) {
      len = 4, cp = lead & 0x07;
    } else {
      error = {i, (lead & 0xC0) == 0x80 ? fmt::format("unexpected continuation byte 0x{:02X}", lead)
                                        : fmt::format("invalid byte 0x{:02X}", lead)};
      return false;
    }
    for (std::size_t k = 1; k < len; ++k) {
      if (i + k >= s.size()) {
        error = {i, fmt::format("sequence of {} bytes cut off by the end of the input", len)};
        return false;
      }
      const auto c = static_cast<unsigned char>(s[i + k]);
      if ((c & 0xC0) != 0x80) {
        error = {i, fmt::format("byte 0x{:02X} at offset {} is not a continuation byte", c, i + k)};
        return false;
      }
      cp = (cp << 6) | (c & 0x3F);
    }
    static constexpr char32_t kMinForLength[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMinForLength[len]) {
      error = {i, fmt::format("overlong {}-byte encoding of U+{:04X}", len, static_cast<std::uint32_t>(cp))};
      return false;
    }
    if (cp >= 0xD800 && cp <= 0xDFFF) {
      error = {i, fmt::format("surrogate U+{:04X}", static_cast<std::uint32_t>(cp))};
      return false;
    }
    if (cp > 0x10FFFF) {
      error = {i, fmt::format("code point 0x{:X} above U+10FFFF", static_cast<std::uint32_t>(cp))};
      return false;
    }
    out.push_back(cp);
    i += len;
  }
  return true;
}

void append_utf8(std::string& out, char32_t cp) {
  const auto c = static_cast<std::uint32_t>(cp);
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

// The id of `cp` in the sorted vocabulary, or -1.
std::int64_t lookup(const std::vector<char32_t>& vocab, char32_t cp) {
  auto it = std::lower_bound(vocab.begin(), vocab.end(), cp);
  return it != vocab.end() && *it == cp ? it - vocab.begin() : -1;
}

}  // namespace

TextDataset::TextDataset(const std::string& path, TextOptions options)
    : path_(path), options_(options) {
  MB_CHECK(options.block_size >= 1, "[TextDataset] block_size must be at least 1, got {}",
           options.block_size);
  MB_CHECK(options.val_fraction >= 0.0 && options.val_fraction < 1.0,
           "[TextDataset] val_fraction must be in [0, 1), got {}", options.val_fraction);
  MB_CHECK(options.split == Split::Train || options.split == Split::Val,
           "[TextDataset] has no {} split; use Split::Train or Split::Val", split_name(options.split));

  // A folder opens as a stream whose first read throws, and a FIFO blocks the open until a
  // writer comes: only a regular file is read.
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  MB_CHECK(std::filesystem::exists(status), "[TextDataset] cannot open {}: {}", path,
           ec ? ec.message() : "it does not exist");
  MB_CHECK(std::filesystem::is_regular_file(status), "[TextDataset] {} is not a regular file",
           path);
  std::ifstream in(path, std::ios::binary);
  MB_CHECK(in.good(), "[TextDataset] cannot open {}", path);
  std::string text;
  try {
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::ios_base::failure& e) {  // libstdc++'s filebuf throws on a read error
    MB_CHECK(false, "[TextDataset] {}: read failed: {}", path, e.what());
  }
  MB_CHECK(!in.bad(), "[TextDataset] {}: read failed", path);
  MB_CHECK(!text.empty(), "[TextDataset] {} is empty", path);

  std::vector<std::int32_t> all;
  if (options.level == TextLevel::Byte) {
    all.reserve(text.size());
    for (char c : text) all.push_back(static_cast<unsigned char>(c));
  } else {
    std::vector<char32_t> cps;
    cps.reserve(text.size());
    Utf8Error error;
    MB_CHECK(decode_utf8(text, cps, error),
             "[TextDataset] {}: invalid UTF-8 at byte offset {}: {} (TextLevel::Byte, the command's "
             "--text-level byte, reads any file)",
             path, error.offset, error.reason);
    code_points_ = cps;
    std::sort(code_points_.begin(), code_points_.end());
    code_points_.erase(std::unique(code_points_.begin(), code_points_.end()), code_points_.end());
    all.reserve(cps.size());
    for (char32_t cp : cps) all.push_back(static_cast<std::int32_t>(lookup(code_points_, cp)));
  }

  // The same rule as nanoGPT's data[:int(n * 0.9)].
  const auto n = static_cast<std::int64_t>(all.size());
  const auto n_train = static_cast<std::int64_t>(static_cast<double>(n) * (1.0 - options.val_fraction));
  if (options.split == Split::Train) {
    tokens_.assign(all.begin(), all.begin() + n_train);
  } else {
    tokens_.assign(all.begin() + n_train, all.end());
  }
  const auto m = static_cast<std::int64_t>(tokens_.size());
  // Not m >= block_size + 1: that sum overflows for a block_size near the i64 maximum.
  MB_CHECK(m - 1 >= options.block_size,
           "[TextDataset] {}: the {} split has {} tokens, fewer than block_size + 1 = {}", path,
           split_name(options.split), m, static_cast<std::uint64_t>(options.block_size) + 1);
}

std::int64_t TextDataset::size() const {
  return (static_cast<std::int64_t>(tokens_.size()) - 1) / options_.block_size;
}

Example TextDataset::get(std::int64_t index) const {
  check_index(index, "TextDataset");
  const std::int64_t t = options_.block_size;
  Tensor input = empty({t}, {.dtype = DType::i64});  // (T)
  Tensor label = empty({t}, {.dtype = DType::i64});  // (T), input shifted left by one
  auto* x = input.data<std::int64_t>();
  auto* y = label.data<std::int64_t>();
  const std::int32_t* src = tokens_.data() + index * t;
  for (std::int64_t k = 0; k < t; ++k) {
    x[k] = src[k];
    y[k] = src[k + 1];
  }
  return {input, label};
}

std::int64_t TextDataset::vocab_size() const {
  return options_.level == TextLevel::Byte ? 256 : static_cast<std::int64_t>(code_points_.size());
}

std::vector<std::int64_t> TextDataset::encode(const std::string& text) const {
  std::vector<std::int64_t> ids;
  if (options_.level == TextLevel::Byte) {
    for (char c : text) ids.push_back(static_cast<unsigned char>(c));
    return ids;
  }
  std::vector<char32_t> cps;
  Utf8Error error;
  MB_CHECK(decode_utf8(text, cps, error), "[TextDataset] encode: invalid UTF-8 at byte offset {}: {}",
           error.offset, error.reason);
  for (std::size_t i = 0; i < cps.size(); ++i) {
    const std::int64_t id = lookup(code_points_, cps[i]);
    MB_CHECK(id >= 0, "[TextDataset] encode: character U+{:04X} (character {}) is not in the "
             "vocabulary of {}", static_cast<std::uint32_t>(cps[i]), i, path_);
    ids.push_back(id);
  }
  return ids;
}

std::string TextDataset::decode(const std::vector<std::int64_t>& tokens) const {
  const std::int64_t v = vocab_size();
  std::string out;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    MB_CHECK(tokens[i] >= 0 && tokens[i] < v, "[TextDataset] decode: token {} at position {} outside "
             "0..{}", tokens[i], i, v - 1);
    if (options_.level == TextLevel::Byte) {
      out += static_cast<char>(tokens[i]);
    } else {
      append_utf8(out, code_points_[static_cast<std::size_t>(tokens[i])]);
    }
  }
  return out;
}

SyntheticTokens::SyntheticTokens(SyntheticTokensOptions options) : options_(options) {
  MB_CHECK(options_.vocab_size >= 1 && options_.block_size >= 1 && options_.size >= 0,
           "[SyntheticTokens] vocab_size and block_size must be >= 1 and size >= 0, got {}, {} and {}",
           options_.vocab_size, options_.block_size, options_.size);
}

Example SyntheticTokens::get(std::int64_t index) const {
  check_index(index, "SyntheticTokens");
  const std::int64_t t = options_.block_size;
  // Token k of example i takes 64 bits of Philox block (i * blocks + k / 2, seed), lanes 2 (k % 2)
  // and the next; (bits * vocab) >> 64 maps them to [0, vocab) with a bias below vocab / 2^64.
  const auto blocks = static_cast<std::uint64_t>((t + 2) / 2);
  const auto vocab = static_cast<unsigned __int128>(options_.vocab_size);
  std::vector<std::int64_t> ids(static_cast<std::size_t>(t + 1));
  for (std::int64_t k = 0; k <= t; ++k) {
    const PhiloxBlock b = philox4x32(static_cast<std::uint64_t>(index) * blocks + static_cast<std::uint64_t>(k / 2),
                                     options_.seed);
    const int lane = 2 * static_cast<int>(k % 2);
    const std::uint64_t bits = (static_cast<std::uint64_t>(b.v[lane]) << 32) | b.v[lane + 1];
    ids[static_cast<std::size_t>(k)] = static_cast<std::int64_t>((bits * vocab) >> 64);
  }
  Tensor input = empty({t}, {.dtype = DType::i64});  // (T)
  Tensor label = empty({t}, {.dtype = DType::i64});  // (T), input shifted left by one
  std::copy(ids.begin(), ids.end() - 1, input.data<std::int64_t>());
  std::copy(ids.begin() + 1, ids.end(), label.data<std::int64_t>());
  return {input, label};
}

}  // namespace microbatch::train
