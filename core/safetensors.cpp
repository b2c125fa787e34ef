// safetensors I/O. Loading validates in this order, touching nothing sized from the file until
// every check has passed: file length, header length N (<= 100 MB, inside the file), the header
// bytes (starts with '{', UTF-8, no NUL byte, JSON, no duplicate keys, no deeper nesting than the
// format has), each entry (dtype, shape of at most 8 dims whose element count and strides fit in
// int64, checked byte count, data_offsets), the tiling of the data buffer by the offsets, the
// checksums we wrote, the BOOL bytes; only then are tensors allocated and filled.
#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>

#include <nlohmann/json.hpp>

namespace microbatch {

// Tensors are copied byte for byte; the format is little-endian, and so must the host be.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

using nlohmann::json;

/// Every failure reads "[safetensors] <file>: <what>".
#define ST_CHECK(cond, src, ...) \
  MB_CHECK(cond, "[safetensors] {}: {}", src, fmt::format(__VA_ARGS__))

std::string errno_text() { return std::error_code(errno, std::generic_category()).message(); }

struct DTypeName {
  const char* name;
  DType dtype;
};
constexpr std::array<DTypeName, 8> kDTypeNames{{{"F64", DType::f64}, {"F32", DType::f32},
                                                {"F16", DType::f16}, {"BF16", DType::bf16},
                                                {"I64", DType::i64}, {"I32", DType::i32},
                                                {"U8", DType::u8}, {"BOOL", DType::boolean}}};

const char* format_dtype_name(DType dt) {
  for (const auto& d : kDTypeNames)
    if (d.dtype == dt) return d.name;
  MB_ASSERT(false, "dtype {} has no safetensors name", dtype_name(dt));
  return "";
}

std::optional<DType> parse_format_dtype(const std::string& name) {
  for (const auto& d : kDTypeNames)
    if (name == d.name) return d.dtype;
  return std::nullopt;
}

/// Offset of the first byte that is not part of valid UTF-8 (overlong forms, surrogates and code
/// points past U+10FFFF are invalid), or npos when all of `s` is valid.
std::size_t invalid_utf8_at(std::string_view s) {
  static constexpr std::uint32_t kMinCodePoint[5] = {0, 0, 0x80, 0x800, 0x10000};
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<std::uint8_t>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    std::uint32_t cp = 0;
    if ((c & 0xE0) == 0xC0) len = 2, cp = c & 0x1Fu;
    else if ((c & 0xF0) == 0xE0) len = 3, cp = c & 0x0Fu;
    else if ((c & 0xF8) == 0xF0) len = 4, cp = c & 0x07u;
    else return i;
    if (len > s.size() - i) return i;
    for (std::size_t k = 1; k < len; ++k) {
      const auto d = static_cast<std::uint8_t>(s[i + k]);
      if ((d & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (d & 0x3Fu);
    }
    if (cp < kMinCodePoint[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += len;
  }
  return std::string_view::npos;
}

// ---- CRC-32 (slicing by 8) ---------------------------------------------------------------------

struct CrcTables {
  std::uint32_t t[8][256];
};

constexpr CrcTables make_crc_tables() {
  CrcTables c{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t r = i;
    for (int k = 0; k < 8; ++k) r = (r >> 1) ^ (0xEDB88320u & (0u - (r & 1u)));
    c.t[0][i] = r;
  }
  for (int s = 1; s < 8; ++s)
    for (int i = 0; i < 256; ++i) c.t[s][i] = (c.t[s - 1][i] >> 8) ^ c.t[0][c.t[s - 1][i] & 0xFFu];
  return c;
}

constexpr CrcTables kCrc = make_crc_tables();

// ---- the header --------------------------------------------------------------------------------

/// A validated header entry. Offsets are relative to the start of the data buffer.
struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

/// A JSON non-negative integer, or nullopt for negatives, fractions, exponents and non-numbers.
std::optional<std::uint64_t> as_count(const json& v) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0)
    return static_cast<std::uint64_t>(v.get<std::int64_t>());
  return std::nullopt;
}

/// Scans the header text without building anything, stopping at the first syntax error, key
/// repeated within an object (nlohmann keeps the last one silently) or object or array nested
/// deeper than a safetensors header has (objects of objects of arrays: depth 3).
/// A callback on the DOM parse could check the same, but nlohmann's callback parser walks the
/// parent object's entries each time a child object closes: quadratic in the tensor count.
class HeaderScan {
 public:
  std::string error;  // why the scan stopped; empty while the header is acceptable

  bool null() { return true; }
  bool boolean(bool) { return true; }
  bool number_integer(json::number_integer_t) { return true; }
  bool number_unsigned(json::number_unsigned_t) { return true; }
  bool number_float(json::number_float_t, const json::string_t&) { return true; }
  bool string(json::string_t&) { return true; }
  bool binary(json::binary_t&) { return true; }
  bool start_object(std::size_t) {
    if (!open()) return false;
    keys_.emplace_back();
    return true;
  }
  bool key(json::string_t& k) {
    if (keys_.back().insert(k).second) return true;
    error = fmt::format("duplicate key '{}' in header", k);
    return false;
  }
  bool end_object() {
    keys_.pop_back();
    --depth_;
    return true;
  }
  bool start_array(std::size_t) { return open(); }
  bool end_array() {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const json::exception& e) {
    error = fmt::format("header is not valid JSON: {}", e.what());
    return false;
  }

 private:
  static constexpr int kMaxDepth = 3;

  bool open() {
    if (depth_ == kMaxDepth) {
      error = "header nests objects or arrays deeper than a safetensors header";
      return false;
    }
    ++depth_;
    return true;
  }

  int depth_ = 0;                            // objects and arrays open
  std::vector<std::set<std::string>> keys_;  // the keys seen so far in each open object
};

/// Parses the header text once HeaderScan has accepted it, so the plain parse cannot fail.
json parse_header_json(std::string_view text, const std::string& src) {
  HeaderScan scan;
  json::sax_parse(text.begin(), text.end(), &scan);
  ST_CHECK(scan.error.empty(), src, "{}", scan.error);
  json header = json::parse(text.begin(), text.end());
  ST_CHECK(header.is_object(), src, "header is a JSON {}, not an object", header.type_name());
  return header;
}

Entry parse_entry(const std::string& src, const std::string& name, const json& info) {
  ST_CHECK(info.is_object(), src, "tensor '{}': entry is a JSON {}, not an object", name,
           info.type_name());
  for (const auto& [key, value] : info.items())
    ST_CHECK(key == "dtype" || key == "shape" || key == "data_offsets", src,
             "tensor '{}': unknown field '{}'", name, key);
  ST_CHECK(info.contains("dtype") && info.contains("shape") && info.contains("data_offsets"), src,
           "tensor '{}': entry needs dtype, shape and data_offsets", name);

  Entry e;
  e.name = name;
  const json& dtype = info["dtype"];
  ST_CHECK(dtype.is_string(), src, "tensor '{}': dtype is a JSON {}, not a string", name,
           dtype.type_name());
  const auto dt = parse_format_dtype(dtype.get<std::string>());
  ST_CHECK(dt.has_value(), src,
           "tensor '{}': unsupported dtype '{}' (supported: F64 F32 F16 BF16 I64 I32 U8 BOOL)", name,
           dtype.get<std::string>());
  e.dtype = *dt;

  // Element and byte counts are multiplied with overflow checks: a shape like [2^62, 8] must not
  // wrap around to a small size that happens to match the offsets.
  // A zero dim makes the element count 0 whatever the other dims are, but the strides are still
  // products of the other dims (contiguous_strides), so the product of max(d, 1) must fit too.
  const json& shape = info["shape"];
  ST_CHECK(shape.is_array(), src, "tensor '{}': shape is a JSON {}, not an array", name,
           shape.type_name());
  ST_CHECK(shape.size() <= static_cast<std::size_t>(kernels::kMaxDims), src,
           "tensor '{}': shape has {} dims; at most {} are supported", name, shape.size(),
           kernels::kMaxDims);
  constexpr auto kMaxCount = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::uint64_t numel = 1;
  std::uint64_t extent = 1;  // product of max(d, 1)
  for (std::size_t i = 0; i < shape.size(); ++i) {
    const auto d = as_count(shape[i]);
    ST_CHECK(d.has_value(), src, "tensor '{}': shape entry {} ({}) is not a non-negative integer",
             name, i, shape[i].dump());
    ST_CHECK(!__builtin_mul_overflow(numel, *d, &numel) && numel <= kMaxCount && *d <= kMaxCount, src,
             "tensor '{}': element count of shape {} overflows", name, shape.dump());
    // Past the check above, extent > numel only for a shape with a zero dim.
    ST_CHECK(!__builtin_mul_overflow(extent, std::max<std::uint64_t>(*d, 1), &extent) &&
                 extent <= kMaxCount,
             src,
             "tensor '{}': shape {} has no elements but its other dims multiply past 2^63 - 1 "
             "(its strides would overflow)",
             name, shape.dump());
    e.shape.push_back(static_cast<std::int64_t>(*d));
  }
  std::uint64_t nbytes = 0;
  ST_CHECK(!__builtin_mul_overflow(numel, std::uint64_t{dtype_size(e.dtype)}, &nbytes) &&
               nbytes <= kMaxCount,
           src, "tensor '{}': byte count of shape {} in {} overflows", name, shape.dump(),
           dtype.get<std::string>());

  const json& offsets = info["data_offsets"];
  const bool pair = offsets.is_array() && offsets.size() == 2;
  const auto begin = pair ? as_count(offsets[0]) : std::nullopt;
  const auto end = pair ? as_count(offsets[1]) : std::nullopt;
  ST_CHECK(begin && end, src, "tensor '{}': data_offsets {} must be two non-negative integers", name,
           offsets.dump());
  ST_CHECK(*begin <= *end, src, "tensor '{}': data_offsets [{}, {}] begin after they end", name,
           *begin, *end);
  ST_CHECK(*end - *begin == nbytes, src,
           "tensor '{}': data_offsets [{}, {}] hold {} bytes but shape {} of {} needs {}", name,
           *begin, *end, *end - *begin, shape.dump(), dtype.get<std::string>(), nbytes);
  e.begin = *begin;
  e.end = *end;
  return e;
}

/// Offsets must cover [0, data_size) exactly once, in some order: no gap, no overlap, nothing
/// after the last tensor and nothing missing. Two tensors at the same bytes would alias.
void check_tiling(const std::string& src, const std::vector<Entry>& entries, std::uint64_t data_size) {
  std::vector<const Entry*> order;
  for (const auto& e : entries) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::uint64_t pos = 0;
  const Entry* prev = nullptr;
  for (const Entry* e : order) {
    ST_CHECK(e->begin >= pos, src,
             "tensor '{}' at data bytes [{}, {}] overlaps tensor '{}' at [{}, {}]", e->name,
             e->begin, e->end, prev ? prev->name : "", prev ? prev->begin : 0, pos);
    ST_CHECK(e->begin == pos, src,
             "tensor '{}' at data bytes [{}, {}] leaves a gap of {} bytes before it (offsets must "
             "tile the data buffer from 0)",
             e->name, e->begin, e->end, e->begin - pos);
    pos = e->end;
    prev = e;
  }
  ST_CHECK(pos <= data_size, src,
           "tensor '{}' ends at data byte {} but the file holds only {} data bytes (missing bytes; "
           "truncated file?)",
           prev ? prev->name : "", pos, data_size);
  ST_CHECK(pos == data_size, src, "{} trailing bytes after the last tensor '{}' (data ends at {})",
           data_size - pos, prev ? prev->name : "<none>", pos);
}

std::uint32_t parse_crc(const std::string& src, const std::string& key, const std::string& text) {
  std::uint32_t value = 0;
  const bool hex = text.size() == 8 && std::all_of(text.begin(), text.end(), [](char c) {
                     return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
                   });
  ST_CHECK(hex, src, "__metadata__ entry '{}' is '{}', not 8 lowercase hex digits", key, text);
  std::from_chars(text.data(), text.data() + text.size(), value, 16);
  return value;
}

// ---- writing -----------------------------------------------------------------------------------

/// What a writer puts on disk: the padded header and the tensors (contiguous, CPU) in file order.
struct SavePlan {
  std::string header;
  std::vector<Tensor> data;
};

SavePlan plan_save(const NamedTensorMap& tensors, const std::map<std::string, std::string>& metadata) {
  const std::string prefix = kSafetensorsCrcPrefix;
  json meta = json::object();
  for (const auto& [key, value] : metadata) {
    MB_CHECK(invalid_utf8_at(key) == std::string_view::npos &&
                 invalid_utf8_at(value) == std::string_view::npos,
             "[safetensors] metadata entry '{}' is not valid UTF-8", key);
    MB_CHECK(key.rfind(prefix, 0) != 0,
             "[safetensors] metadata key '{}' uses the reserved prefix '{}' (checksums)", key, prefix);
    meta[key] = value;
  }

  std::vector<std::pair<std::string, Tensor>> items;  // (name, contiguous CPU copy)
  for (const auto& [name, t] : tensors) {
    MB_CHECK(!name.empty() && name != "__metadata__",
             "[safetensors] invalid tensor name '{}' (empty or reserved)", name);
    MB_CHECK(invalid_utf8_at(name) == std::string_view::npos,
             "[safetensors] tensor name '{}' is not valid UTF-8", name);
    MB_CHECK(t.defined(), "[safetensors] tensor '{}' is undefined", name);
    MB_CHECK(!t.device().is_meta(), "[safetensors] tensor '{}' is on meta (no data to save)", name);
    Tensor c = t.detach();
    if (!c.device().is_cpu()) c = c.to(kCPU);
    items.emplace_back(name, c.contiguous());
  }
  // Descending element size keeps every tensor aligned to its dtype once the header is padded to
  // 8; a stable sort keeps name order (the map's) within a size.
  std::stable_sort(items.begin(), items.end(), [](const auto& a, const auto& b) {
    return dtype_size(a.second.dtype()) > dtype_size(b.second.dtype());
  });

  // The header is written entry by entry, "__metadata__" first as the reference writer does:
  // building it as one ordered_json looked each name up by a linear search, which made saving
  // quadratic in the tensor count.
  SavePlan plan;
  std::string entries;
  std::uint64_t pos = 0;
  for (auto& [name, t] : items) {
    const auto* bytes = static_cast<const std::uint8_t*>(t.raw_data());
    meta[prefix + name] = fmt::format("{:08x}", checksum_crc32({bytes, bytes ? t.nbytes() : 0}));
    const nlohmann::ordered_json entry = {{"dtype", format_dtype_name(t.dtype())},
                                          {"shape", t.shape()},
                                          {"data_offsets", {pos, pos + t.nbytes()}}};
    entries += ',' + json(name).dump() + ':' + entry.dump();
    pos += t.nbytes();
    plan.data.push_back(std::move(t));
  }
  if (!meta.empty()) entries.insert(0, ",\"__metadata__\":" + meta.dump());
  if (!entries.empty()) entries[0] = '{';
  plan.header = entries.empty() ? "{}" : entries + '}';
  plan.header.resize((plan.header.size() + 7) / 8 * 8, ' ');
  return plan;
}

/// Feeds the file's bytes, in order, to sink(pointer, count).
template <class Sink>
void emit(const SavePlan& plan, Sink&& sink) {
  std::array<std::uint8_t, 8> len{};  // little-endian header length
  for (int i = 0; i < 8; ++i) len[i] = static_cast<std::uint8_t>(plan.header.size() >> (8 * i));
  sink(len.data(), len.size());
  sink(plan.header.data(), plan.header.size());
  for (const auto& t : plan.data)
    if (t.nbytes() > 0) sink(t.raw_data(), t.nbytes());
}

void write_all(int fd, const void* data, std::size_t n, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    MB_CHECK(w > 0, "[safetensors] {}: write failed: {}", path, errno_text());
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

/// A read-only mapping of a whole file (empty files map to an empty span).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    // O_NONBLOCK: opening a FIFO would otherwise wait for a writer; the S_ISREG check below
    // refuses it. It changes nothing for a regular file.
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    MB_CHECK(fd >= 0, "[safetensors] {}: cannot open: {}", path, errno_text());
    struct stat st {};
    const bool stat_ok = ::fstat(fd, &st) == 0;
    const std::string stat_error = stat_ok ? "" : errno_text();
    if (stat_ok && S_ISREG(st.st_mode) && st.st_size > 0) {
      size_ = static_cast<std::size_t>(st.st_size);
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      data_ = p == MAP_FAILED ? nullptr : static_cast<const std::uint8_t*>(p);
    }
    const std::string map_error = size_ > 0 && !data_ ? errno_text() : "";
    ::close(fd);
    MB_CHECK(stat_ok, "[safetensors] {}: cannot stat: {}", path, stat_error);
    MB_CHECK(S_ISREG(st.st_mode), "[safetensors] {}: not a regular file", path);
    MB_CHECK(size_ == 0 || data_, "[safetensors] {}: cannot map: {}", path, map_error);
    if (data_) ::madvise(const_cast<std::uint8_t*>(data_), size_, MADV_SEQUENTIAL);
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<std::uint8_t*>(data_), size_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  std::span<const std::uint8_t> bytes() const { return {data_, data_ ? size_ : 0}; }

 private:
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace

std::uint32_t checksum_crc32(std::span<const std::uint8_t> bytes, std::uint32_t crc) {
  const auto& t = kCrc.t;
  crc = ~crc;
  const std::uint8_t* p = bytes.data();
  std::size_t n = bytes.size();
  for (; n >= 8; p += 8, n -= 8) {
    std::uint32_t lo = 0, hi = 0;
    std::memcpy(&lo, p, 4);  // little-endian host (asserted above)
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
          t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
  }
  for (; n > 0; ++p, --n) crc = (crc >> 8) ^ t[0][(crc ^ *p) & 0xFF];
  return ~crc;
}

SafetensorsFile load_safetensors_bytes(std::span<const std::uint8_t> bytes, const std::string& src) {
  ST_CHECK(bytes.size() >= 8, src, "file is {} bytes, shorter than the 8-byte header length",
           bytes.size());
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  ST_CHECK(n <= kSafetensorsMaxHeader, src, "header length {} exceeds the limit of {} bytes", n,
           kSafetensorsMaxHeader);
  ST_CHECK(n <= bytes.size() - 8, src, "header length {} runs past the end of the {}-byte file", n,
           bytes.size());
  const std::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), n);
  ST_CHECK(!text.empty() && text.front() == '{', src, "header does not start with '{{'");
  const std::size_t bad = invalid_utf8_at(text);
  ST_CHECK(bad == std::string_view::npos, src, "header is not valid UTF-8 (byte {} of the header)",
           bad);
  // nlohmann's lexer takes a 0x00 byte for the end of its input: whatever follows one would be
  // ignored without a word.
  const std::size_t nul = text.find('\0');
  ST_CHECK(nul == std::string_view::npos, src, "header holds a NUL byte (byte {} of the header)",
           nul);
  const json header = parse_header_json(text, src);

  SafetensorsFile out;
  std::map<std::string, std::uint32_t> crcs;  // tensor name -> stored checksum
  std::vector<Entry> entries;
  const std::string prefix = kSafetensorsCrcPrefix;
  for (const auto& [key, value] : header.items()) {
    if (key != "__metadata__") {
      entries.push_back(parse_entry(src, key, value));
      continue;
    }
    ST_CHECK(value.is_object(), src, "__metadata__ is a JSON {}, not a map of strings to strings",
             value.type_name());
    for (const auto& [mkey, mvalue] : value.items()) {
      ST_CHECK(mvalue.is_string(), src,
               "__metadata__ entry '{}' is a JSON {}, not a string (metadata must map strings to "
               "strings)",
               mkey, mvalue.type_name());
      if (mkey.rfind(prefix, 0) == 0)
        crcs[mkey.substr(prefix.size())] = parse_crc(src, mkey, mvalue.get<std::string>());
      else
        out.metadata[mkey] = mvalue.get<std::string>();
    }
  }
  const std::span<const std::uint8_t> data = bytes.subspan(8 + n);
  check_tiling(src, entries, data.size());

  // Everything below reads only bytes the offsets were proven to cover.
  std::map<std::string, const Entry*> by_name;
  for (const auto& e : entries) by_name[e.name] = &e;
  for (const auto& [name, stored] : crcs)
    ST_CHECK(by_name.count(name), src, "__metadata__ holds a checksum for tensor '{}', which the file lacks",
             name);
  // Our writer checksums every tensor, so a partial set means a damaged checksum key.
  for (const auto& e : entries)
    ST_CHECK(crcs.empty() || crcs.count(e.name), src,
             "__metadata__ holds checksums for some tensors but not for tensor '{}'", e.name);
  for (const auto& [name, stored] : crcs) {
    const Entry& e = *by_name.at(name);
    const std::uint32_t actual = checksum_crc32(data.subspan(e.begin, e.end - e.begin));
    ST_CHECK(actual == stored, src,
             "checksum mismatch for tensor '{}' (stored crc32 {:08x}, data has {:08x}): the file is "
             "corrupt",
             name, stored, actual);
  }
  for (const auto& e : entries) {
    if (e.dtype != DType::boolean) continue;
    for (std::uint64_t i = e.begin; i < e.end; ++i)
      ST_CHECK(data[i] <= 1, src, "tensor '{}' (BOOL) holds byte {} at element {}; BOOL must be 0 or 1",
               e.name, data[i], i - e.begin);
  }

  for (const auto& e : entries) {
    Tensor t = empty(e.shape, TensorOptions{.dtype = e.dtype});
    if (e.end > e.begin) std::memcpy(t.raw_data(), data.data() + e.begin, e.end - e.begin);
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

SafetensorsFile load_safetensors(const std::string& path) {
  const MappedFile file(path);
  return load_safetensors_bytes(file.bytes(), path);
}

std::vector<std::uint8_t> save_safetensors_bytes(const NamedTensorMap& tensors,
                                                 const std::map<std::string, std::string>& metadata) {
  const SavePlan plan = plan_save(tensors, metadata);
  std::size_t total = 8 + plan.header.size();
  for (const auto& t : plan.data) total += t.nbytes();
  std::vector<std::uint8_t> out;
  out.reserve(total);
  emit(plan, [&](const void* p, std::size_t n) {
    out.insert(out.end(), static_cast<const std::uint8_t*>(p), static_cast<const std::uint8_t*>(p) + n);
  });
  return out;
}

void save_safetensors(const std::string& path, const NamedTensorMap& tensors,
                      const std::map<std::string, std::string>& metadata) {
  namespace fs = std::filesystem;
  const SavePlan plan = plan_save(tensors, metadata);  // refuse bad input before touching the disk
  const fs::path dest(path);
  MB_CHECK(dest.has_filename(), "[safetensors] {}: the path names no file", path);
  const fs::path dir = dest.has_parent_path() ? dest.parent_path() : fs::path(".");

  // The temporary lives beside the destination so that rename() replaces it atomically.
  static std::atomic<std::uint64_t> counter{0};
  const fs::path tmp = dir / fmt::format(".{}.tmp-{}-{}", dest.filename().string(), ::getpid(),
                                         counter.fetch_add(1));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  MB_CHECK(fd >= 0, "[safetensors] {}: cannot create temporary file {}: {}", path, tmp.string(),
           errno_text());
  try {
    emit(plan, [&](const void* p, std::size_t n) { write_all(fd, p, n, path); });
    MB_CHECK(::fsync(fd) == 0, "[safetensors] {}: fsync failed: {}", path, errno_text());
    const int closed = ::close(fd);
    fd = -1;
    MB_CHECK(closed == 0, "[safetensors] {}: close failed: {}", path, errno_text());
    MB_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "[safetensors] {}: cannot rename {} over it: {}",
             path, tmp.string(), errno_text());
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  // The rename is durable only once the folder's entry is on disk.
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  MB_CHECK(dfd >= 0, "[safetensors] {}: cannot open folder {} to fsync it: {}", path, dir.string(),
           errno_text());
  const bool synced = ::fsync(dfd) == 0 || errno == EINVAL;  // some filesystems cannot sync folders
  const std::string sync_error = synced ? "" : errno_text();
  ::close(dfd);
  MB_CHECK(synced, "[safetensors] {}: fsync of folder {} failed: {}", path, dir.string(), sync_error);
}

}  // namespace microbatch
