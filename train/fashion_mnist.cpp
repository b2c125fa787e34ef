// Fashion-MNIST reader: IDX files through zlib, every header field checked before it sizes a read.
//
// IDX layout (big-endian): magic = 0, 0, type (0x08 = u8), ndim; ndim u32 dims; then the data.
// Images are (N, 28, 28) with magic 0x00000803, labels (N) with magic 0x00000801.
#include "train/fashion_mnist.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>

#include <zlib.h>

namespace microbatch::train {

namespace {

constexpr std::uint32_t kGzipMagic = 0x1F8B0808;  // gzip id bytes, deflate, FNAME flag
// Images and labels together stay below 4 GiB, and no count read from a file sizes more than that.
constexpr std::uint64_t kMaxItems = (std::uint64_t{1} << 32) / (28 * 28);
// Decompressed bytes read per step; the whole training set is about three of them.
constexpr std::size_t kReadChunk = std::size_t{16} << 20;

std::uint32_t read_be32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}

std::uint32_t byte_swap(std::uint32_t x) {
  return (x >> 24) | ((x >> 8) & 0xFF00u) | ((x << 8) & 0xFF0000u) | (x << 24);
}

const char* idx_type_name(std::uint8_t type) {
  switch (type) {
    case 0x08: return "u8";
    case 0x09: return "i8";
    case 0x0B: return "i16";
    case 0x0C: return "i32";
    case 0x0D: return "f32";
    case 0x0E: return "f64";
    default: return "unknown";
  }
}

// Note [Reading gzip]: a gzip-compressed or plain file, told apart by gzip's two id bytes and
// decompressed as it is read. A gzip file may hold several members, read as one stream (as gzip(1)
// and Python's gzip module read them); after a member only zero bytes (padding) or another member
// may follow, as Python's gzip rules: any other byte is an error naming its offset, where zlib's
// gzread would stop there in silence and the garbage would go unnoticed. A stream cut short, a
// corrupt block or a wrong CRC is an error naming how far the data got.
class GzReader {
 public:
  explicit GzReader(const std::string& path)
      : path_(path), file_(std::fopen(path.c_str(), "rb")) {
    MB_CHECK(file_ != nullptr, "[FashionMNIST] cannot open {}: {}", path, std::strerror(errno));
    in_.resize(kRawChunk);
    while (avail_ < 2 && refill()) {
    }
    if (avail_ >= 2 && in_[0] == kGzipId[0] && in_[1] == kGzipId[1]) {
      format_ = Format::Gzip;
      // 16 + MAX_WBITS: a gzip wrapper, its header and trailer (CRC-32, length) checked.
      MB_CHECK(inflateInit2(&z_, 16 + MAX_WBITS) == Z_OK, "[FashionMNIST] {}: zlib could not start",
               path);
    }
  }
  ~GzReader() {
    if (format_ == Format::Gzip) inflateEnd(&z_);
  }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  /// Reads up to n bytes into dst; fewer only at the end of the data.
  std::size_t read(void* dst, std::size_t n) {
    const std::size_t total = format_ == Format::Gzip ? inflate_into(dst, n) : copy_into(dst, n);
    offset_ += total;
    return total;
  }

 private:
  enum class Format { Plain, Gzip };
  enum class Stream { InMember, Ended };
  static constexpr unsigned char kGzipId[2] = {0x1F, 0x8B};
  static constexpr std::size_t kRawChunk = std::size_t{1} << 17;

  // Moves the unread bytes to the front of in_ and reads more after them. False at the end of the
  // file (or a read error, reported here).
  bool refill() {
    std::memmove(in_.data(), in_.data() + pos_, avail_);
    pos_ = 0;
    const std::size_t got = std::fread(in_.data() + avail_, 1, in_.size() - avail_, file_.get());
    MB_CHECK(!std::ferror(file_.get()), "[FashionMNIST] {}: read failed at byte {} of the file: {}",
             path_, std::ftell(file_.get()), std::strerror(errno));
    avail_ += got;
    return got > 0;
  }

  std::size_t copy_into(void* dst, std::size_t n) {
    auto* out = static_cast<unsigned char*>(dst);
    std::size_t total = 0;
    while (total < n && (avail_ > 0 || refill())) {
      const std::size_t take = std::min(avail_, n - total);
      std::memcpy(out + total, in_.data() + pos_, take);
      pos_ += take;
      avail_ -= take;
      total += take;
    }
    return total;
  }

  // The file offset of the next unread byte.
  std::uint64_t raw_offset() const {
    return static_cast<std::uint64_t>(std::ftell(file_.get())) - avail_;
  }

  std::size_t inflate_into(void* dst, std::size_t n) {
    auto* out = static_cast<unsigned char*>(dst);
    std::size_t total = 0;
    while (total < n && stream_ == Stream::InMember) {
      if (avail_ == 0) {
        MB_CHECK(refill(),
                 "[FashionMNIST] {}: read failed after {} bytes: the gzip stream ends before its "
                 "last block (the file is cut short)", path_, offset_ + total);
      }
      z_.next_in = in_.data() + pos_;
      z_.avail_in = static_cast<uInt>(avail_);
      z_.next_out = out + total;
      z_.avail_out = static_cast<uInt>(std::min<std::size_t>(n - total, std::size_t{1} << 30));
      const uInt out_before = z_.avail_out;
      const int rc = inflate(&z_, Z_NO_FLUSH);
      total += out_before - z_.avail_out;
      pos_ += avail_ - z_.avail_in;
      avail_ = z_.avail_in;
      if (rc == Z_STREAM_END) {
        after_member();
        continue;
      }
      // Z_BUF_ERROR (no progress without more input) cannot come with input left and room to
      // write; it is let through only where the next turn reads more input.
      MB_CHECK(rc == Z_OK || (rc == Z_BUF_ERROR && avail_ == 0),
               "[FashionMNIST] {}: read failed after {} bytes: {}", path_, offset_ + total,
               z_.msg != nullptr ? z_.msg : zError(rc));
    }
    return total;
  }

  // At a member's end: zero padding is skipped; then the file ends, or another member begins.
  void after_member() {
    for (;;) {
      if (avail_ == 0 && !refill()) {
        stream_ = Stream::Ended;
        return;
      }
      if (in_[pos_] != 0) break;
      ++pos_;
      --avail_;
    }
    while (avail_ < 2 && refill()) {
    }
    MB_CHECK(avail_ >= 2 && in_[pos_] == kGzipId[0] && in_[pos_ + 1] == kGzipId[1],
             "[FashionMNIST] {}: garbage after the gzip stream: byte {} of the file (0x{:02X}) is "
             "neither zero padding nor the start of another gzip member",
             path_, raw_offset(), in_[pos_]);
    MB_CHECK(inflateReset(&z_) == Z_OK, "[FashionMNIST] {}: zlib could not restart", path_);
  }

  std::string path_;
  struct Close {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, Close> file_;  // closed however the reader ends
  std::vector<unsigned char> in_;  // raw bytes read from the file: [pos_, pos_ + avail_) unread
  std::size_t pos_ = 0;
  std::size_t avail_ = 0;
  Format format_ = Format::Plain;
  Stream stream_ = Stream::InMember;
  z_stream z_{};
  std::size_t offset_ = 0;  // decompressed bytes read so far
};

struct IdxData {
  std::vector<std::uint32_t> dims;
  std::vector<std::uint8_t> bytes;
};

// Reads a u8 IDX file of `ndim` dimensions, rejecting anything that is not exactly that.
IdxData read_idx_u8(const std::string& path, std::uint8_t ndim, const char* kind) {
  GzReader in(path);
  const std::uint32_t expected_magic = 0x00000800u | ndim;
  std::uint8_t head[4] = {};
  std::size_t got = in.read(head, 4);
  MB_CHECK(got == 4, "[FashionMNIST] {}: truncated: expected at least 4 bytes of IDX magic, got {}",
           path, got);
  const std::uint32_t magic = read_be32(head);
  MB_CHECK((magic >> 16) != (kGzipMagic >> 16),
           "[FashionMNIST] {}: magic 0x{:08X} is a gzip header read as IDX data (the file is "
           "compressed twice)", path, magic);
  MB_CHECK(magic == expected_magic || byte_swap(magic) != expected_magic,
           "[FashionMNIST] {}: magic 0x{:08X} is the IDX magic 0x{:08X} byte-swapped (written "
           "little-endian); such files are rejected, not reinterpreted", path, magic, expected_magic);
  MB_CHECK(head[0] == 0 && head[1] == 0,
           "[FashionMNIST] {}: not an IDX file: magic 0x{:08X}, expected 0x{:08X} ({})", path, magic,
           expected_magic, kind);
  MB_CHECK(head[2] == 0x08,
           "[FashionMNIST] {}: IDX data type 0x{:02X} ({}), expected 0x08 (u8) for {}", path, head[2],
           idx_type_name(head[2]), kind);
  MB_CHECK(head[3] == ndim, "[FashionMNIST] {}: magic 0x{:08X} has {} dimensions, expected {} for {}",
           path, magic, head[3], ndim, kind);

  const std::size_t header_bytes = 4 + 4 * std::size_t{ndim};
  std::uint8_t raw_dims[16] = {};
  got = in.read(raw_dims, 4 * std::size_t{ndim});
  MB_CHECK(got == 4 * std::size_t{ndim},
           "[FashionMNIST] {}: truncated: expected at least {} bytes of IDX header, got {}", path,
           header_bytes, 4 + got);
  IdxData idx;
  for (std::uint8_t d = 0; d < ndim; ++d) idx.dims.push_back(read_be32(raw_dims + 4 * d));
  MB_CHECK(idx.dims[0] >= 1 && idx.dims[0] <= kMaxItems,
           "[FashionMNIST] {}: item count {} outside 1..{}", path, idx.dims[0], kMaxItems);
  if (ndim == 3) {
    MB_CHECK(idx.dims[1] == FashionMNIST::kRows && idx.dims[2] == FashionMNIST::kCols,
             "[FashionMNIST] {}: images are {}x{}, expected {}x{}", path, idx.dims[1], idx.dims[2],
             FashionMNIST::kRows, FashionMNIST::kCols);
  }
  // Every dim is now bounded (count <= kMaxItems, 28 x 28), so the product cannot wrap.
  std::uint64_t numel = 1;
  for (std::uint32_t dim : idx.dims) numel *= dim;

  // The buffer grows as the data arrives rather than to the header's claim up front: a header
  // claiming 4 GiB in a file of a few bytes is found truncated with memory for what is there.
  while (idx.bytes.size() < numel) {
    const std::size_t have = idx.bytes.size();
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(numel - have, kReadChunk));
    idx.bytes.resize(have + want);
    got = in.read(idx.bytes.data() + have, want);
    idx.bytes.resize(have + got);
    if (got < want) break;
  }
  MB_CHECK(idx.bytes.size() == numel, "[FashionMNIST] {}: truncated: expected {} bytes, got {}",
           path, header_bytes + numel, header_bytes + idx.bytes.size());
  std::uint8_t extra = 0;
  MB_CHECK(in.read(&extra, 1) == 0,
           "[FashionMNIST] {}: trailing bytes after the {} bytes that the IDX header describes", path,
           header_bytes + numel);
  idx.bytes.shrink_to_fit();  // the doubling growth may have reserved up to twice the data
  return idx;
}

// `name`.gz if it exists, else `name` uncompressed.
std::string find_file(const std::string& root, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path gz = fs::path(root) / (name + ".gz");
  const fs::path plain = fs::path(root) / name;
  std::error_code ec;
  for (const fs::path& p : {gz, plain}) {
    if (!fs::exists(p, ec)) continue;
    // A FIFO would block fopen until a writer came, and a folder fails only at the first read.
    MB_CHECK(fs::is_regular_file(p, ec), "[FashionMNIST] {} is not a regular file", p.string());
    return p.string();
  }
  MB_CHECK(false,
           "[FashionMNIST] missing {} (or {} uncompressed); install Debian's dataset-fashion-mnist "
           "or pass the folder that holds the IDX files", gz.string(), plain.string());
  return {};
}

}  // namespace

FashionMNIST::FashionMNIST(const std::string& root, Split split) {
  MB_CHECK(split == Split::Train || split == Split::Test,
           "[FashionMNIST] has no {} split; use Split::Train or Split::Test", split_name(split));
  const std::string prefix = split == Split::Train ? "train" : "t10k";
  images_path_ = find_file(root, prefix + "-images-idx3-ubyte");
  labels_path_ = find_file(root, prefix + "-labels-idx1-ubyte");

  IdxData images = read_idx_u8(images_path_, 3, "images");
  IdxData labels = read_idx_u8(labels_path_, 1, "labels");
  MB_CHECK(images.dims[0] == labels.dims[0],
           "[FashionMNIST] {} holds {} images but {} holds {} labels", images_path_, images.dims[0],
           labels_path_, labels.dims[0]);
  for (std::size_t i = 0; i < labels.bytes.size(); ++i) {
    MB_CHECK(labels.bytes[i] < kNumClasses, "[FashionMNIST] {}: label {} at index {} outside 0..{}",
             labels_path_, labels.bytes[i], i, kNumClasses - 1);
  }
  images_ = std::move(images.bytes);
  labels_ = std::move(labels.bytes);
}

Example FashionMNIST::get(std::int64_t index) const {
  check_index(index, "FashionMNIST");
  Tensor input = empty({kRows, kCols});  // (28, 28) f32
  float* dst = input.data<float>();
  const std::uint8_t* src = pixels(index);
  // A division, not a multiplication by 1/255, so that 255 maps to exactly 1.0f.
  for (std::int64_t i = 0; i < kRows * kCols; ++i) dst[i] = static_cast<float>(src[i]) / 255.0f;
  return {input, scalar_tensor(static_cast<double>(labels_[static_cast<std::size_t>(index)]),
                               {.dtype = DType::i64})};
}

std::int64_t FashionMNIST::label(std::int64_t index) const {
  check_index(index, "FashionMNIST");
  return labels_[static_cast<std::size_t>(index)];
}

const std::uint8_t* FashionMNIST::pixels(std::int64_t index) const {
  check_index(index, "FashionMNIST");
  return images_.data() + static_cast<std::size_t>(index * kRows * kCols);
}

const std::array<const char*, 10>& FashionMNIST::class_names() {
  static const std::array<const char*, 10> names = {"T-shirt/top", "Trouser", "Pullover", "Dress",
                                                    "Coat",        "Sandal",  "Shirt",    "Sneaker",
                                                    "Bag",         "Ankle boot"};
  return names;
}

}  // namespace microbatch::train
