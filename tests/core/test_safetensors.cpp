// safetensors: the CRC-32 against its published check value, round trips in every dtype (bit
// for bit, 0-d, empty and non-contiguous inputs), the writer's layout read back by hand, the
// atomic write, a file written by PyTorch plus hand-rolled Python, and every rejection of
// REFERENCE.md "safetensors (what a reader must reject)" on bytes built here.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/safetensors.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;
namespace fs = std::filesystem;

namespace {

using Bytes = std::vector<std::uint8_t>;

// Bit-at-a-time CRC-32 (reflected 0xEDB88320), the textbook definition, as a reference for the
// table-driven one.
std::uint32_t crc32_bitwise(const std::uint8_t* p, std::size_t n) {
  std::uint32_t crc = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc & 1u) ? (crc >> 1) ^ 0xEDB88320u : crc >> 1;
  }
  return ~crc;
}

std::uint64_t splitmix(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A tensor whose bytes are arbitrary bit patterns (NaN payloads, subnormals, -0 included);
// BOOL gets 0 or 1, the only bytes a bool may hold.
Tensor random_bits(const Shape& shape, DType dt, std::uint64_t seed) {
  Tensor t = empty(shape, {.dtype = dt});
  auto* p = static_cast<std::uint8_t*>(t.raw_data());
  for (std::size_t i = 0; i < t.nbytes(); ++i) {
    const auto r = static_cast<std::uint8_t>(splitmix(seed));
    p[i] = dt == DType::boolean ? (r & 1u) : r;
  }
  return t;
}

Bytes tensor_bytes(const Tensor& t) {
  Tensor c = t.contiguous();
  const auto* p = static_cast<const std::uint8_t*>(c.raw_data());
  return p ? Bytes(p, p + c.nbytes()) : Bytes{};
}

Bytes u64_le(std::uint64_t v) {
  Bytes out(8);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::uint8_t>(v >> (8 * i));
  return out;
}

// A file with the given header length field, header text and `data` zero bytes of data.
Bytes raw_file(std::uint64_t header_len, const std::string& header, std::size_t data = 0) {
  Bytes out = u64_le(header_len);
  for (char c : header) out.push_back(static_cast<std::uint8_t>(c));
  out.resize(out.size() + data, 0);
  return out;
}

// A well-formed framing of `header` (true length) followed by `data` zero bytes.
Bytes file_with(const std::string& header, std::size_t data = 0) {
  return raw_file(header.size(), header, data);
}

// "name":{"dtype":..,"shape":..,"data_offsets":[begin,end]}
std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":" + offsets + "}";
}

// Expects load_safetensors_bytes to throw an Error that starts with "[safetensors] <source>:"
// and contains every needle.
void check_rejected(const Bytes& bytes, const std::vector<std::string>& needles) {
  try {
    load_safetensors_bytes(bytes, "bad.safetensors");
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK_MESSAGE(msg.rfind("[safetensors] bad.safetensors: ", 0) == 0, msg);
    for (const auto& needle : needles)
      CHECK_MESSAGE(msg.find(needle) != std::string::npos, "'" << msg << "' lacks '" << needle << "'");
    return;
  }
  FAIL_CHECK("a malformed file was accepted; expected: " << needles.front());
}


Bytes read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

void write_file(const fs::path& p, const Bytes& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

}  // namespace

TEST_CASE("safetensors: CRC-32 matches the check value and a bitwise reference") {
  const std::string check = "123456789";
  CHECK(checksum_crc32({reinterpret_cast<const std::uint8_t*>(check.data()), check.size()}) ==
        0xCBF43926u);
  CHECK(checksum_crc32({}) == 0u);
  std::uint64_t seed = 7;
  Bytes buf(1031);
  for (auto& b : buf) b = static_cast<std::uint8_t>(splitmix(seed));
  for (std::size_t n : {1, 7, 8, 9, 63, 64, 1031}) {
    CAPTURE(n);
    CHECK(checksum_crc32({buf.data(), n}) == crc32_bitwise(buf.data(), n));
    // Continuing from a prefix's CRC gives the CRC of the whole.
    if (n >= 3)
      CHECK(checksum_crc32({buf.data() + 3, n - 3}, checksum_crc32({buf.data(), 3})) ==
            crc32_bitwise(buf.data(), n));
  }
}

TEST_CASE("safetensors: round trip in every dtype is bit-exact, incl. 0-d, empty, non-contiguous") {
  NamedTensorMap in;
  std::uint64_t seed = 1;
  for (DType dt : kAllDTypes) {
    const std::string d = dtype_name(dt);
    in[d + "_mat"] = random_bits({3, 5}, dt, seed++);
    in[d + "_scalar"] = random_bits({}, dt, seed++);
    in[d + "_empty"] = empty({0, 4}, {.dtype = dt});
    in[d + "_transposed"] = random_bits({4, 3}, dt, seed++).t();  // (3, 4), not contiguous
  }
  REQUIRE_FALSE(in["f32_transposed"].is_contiguous());
  const SafetensorsFile out = load_safetensors_bytes(save_safetensors_bytes(in));
  REQUIRE(out.tensors.size() == in.size());
  for (const auto& [name, t] : in) {
    CAPTURE(name);
    REQUIRE(out.tensors.count(name) == 1);
    const Tensor& r = out.tensors.at(name);
    CHECK(r.dtype() == t.dtype());
    CHECK(r.shape() == t.shape());
    CHECK(r.device().is_cpu());
    CHECK(r.is_contiguous());
    CHECK(tensor_bytes(r) == tensor_bytes(t));
  }
  // The transposed view was written in its logical (row-major) order: compare element by element
  // through the view's own strides.
  const Tensor& src = in["i64_transposed"];
  const Tensor& got = out.tensors.at("i64_transposed");
  for (std::int64_t i = 0; i < 3; ++i)
    for (std::int64_t j = 0; j < 4; ++j)
      CHECK(got.data<std::int64_t>()[i * 4 + j] ==
            static_cast<const std::int64_t*>(src.raw_data())[i * src.strides()[0] + j * src.strides()[1]]);
}

TEST_CASE("safetensors: special float values survive bit for bit") {
  const std::uint32_t bits[] = {0x7FC00001u, 0xFFBADBEEu, 0x80000000u, 0x00000001u,
                                0x7F800000u, 0xFF800000u, 0x3F800000u};
  Tensor t = empty({7}, {.dtype = DType::f32});
  std::memcpy(t.raw_data(), bits, sizeof bits);
  const Tensor r = load_safetensors_bytes(save_safetensors_bytes({{"x", t}})).tensors.at("x");
  CHECK(std::memcmp(r.raw_data(), bits, sizeof bits) == 0);
}

TEST_CASE("safetensors: metadata round trip; checksum keys are ours and hidden") {
  const std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"step", "1200"}, {"note", "caf\xC3\xA9, \"quoted\"\n"}, {"", "empty key"}};
  const auto out = load_safetensors_bytes(save_safetensors_bytes({{"w", zeros({2})}}, meta));
  CHECK(out.metadata == meta);
  const auto empty_file = load_safetensors_bytes(save_safetensors_bytes({}, {{"only", "metadata"}}));
  CHECK(empty_file.tensors.empty());
  CHECK(empty_file.metadata == std::map<std::string, std::string>{{"only", "metadata"}});
  check_throws_with([] { save_safetensors_bytes({}, {{"microbatch.crc32.w", "00000000"}}); },
                    "reserved prefix");
  check_throws_with([] { save_safetensors_bytes({}, {{"k", "\xFF"}}); }, "not valid UTF-8");
  check_throws_with([] { save_safetensors_bytes({{"__metadata__", zeros({1})}}); }, "reserved");
  check_throws_with([] { save_safetensors_bytes({{"m", empty({2}, {.device = kMeta})}}); },
                    "tensor 'm' is on meta");
}

TEST_CASE("safetensors: writer pads the header, orders by alignment then name, little-endian") {
  Tensor i32 = from_vector({16909060.0}, {1}, {.dtype = DType::i32});  // 0x01020304
  NamedTensorMap in = {{"a_u8", zeros({3}, {.dtype = DType::u8})},
                       {"b_f16", zeros({1}, {.dtype = DType::f16})},
                       {"c_i32", i32},
                       {"d_f64", zeros({2}, {.dtype = DType::f64})},
                       {"e_bool", zeros({1}, {.dtype = DType::boolean})},
                       {"f_f32", zeros({1})},
                       {"g_i64", zeros({1}, {.dtype = DType::i64})}};
  const Bytes file = save_safetensors_bytes(in);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | file[i];
  CHECK(n % 8 == 0);
  const std::string text(file.begin() + 8, file.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  const auto header = nlohmann::json::parse(text);
  CHECK(text.find_first_not_of(' ', text.rfind('}') + 1) == std::string::npos);  // padding: spaces
  // Expected order: 8-byte dtypes (d_f64, g_i64), 4 (c_i32, f_f32), 2 (b_f16), 1 (a_u8, e_bool).
  const std::vector<std::pair<std::string, std::uint64_t>> expected = {
      {"d_f64", 16}, {"g_i64", 8}, {"c_i32", 4}, {"f_f32", 4}, {"b_f16", 2}, {"a_u8", 3}, {"e_bool", 1}};
  std::uint64_t pos = 0;
  for (const auto& [name, size] : expected) {
    CAPTURE(name);
    CHECK(header[name]["data_offsets"] == nlohmann::json({pos, pos + size}));
    // The stored checksum is the CRC-32 of exactly these data bytes.
    const auto* data = file.data() + 8 + n + pos;
    CHECK(header["__metadata__"]["microbatch.crc32." + name] ==
          fmt::format("{:08x}", crc32_bitwise(data, size)));
    pos += size;
  }
  CHECK(file.size() == 8 + n + pos);
  const std::size_t at = 8 + n + 16 + 8;  // c_i32's bytes
  CHECK(Bytes(file.begin() + at, file.begin() + at + 4) == Bytes{0x04, 0x03, 0x02, 0x01});
  CHECK(header["c_i32"]["dtype"] == "I32");
  CHECK(header["b_f16"]["shape"] == nlohmann::json::array({1}));
  // As the reference writer lays it out: "__metadata__" first, then the tensors in data order,
  // each entry's fields in the order dtype, shape, data_offsets.
  CHECK(text.rfind("{\"__metadata__\":{\"microbatch.crc32.a_u8\":", 0) == 0);
  CHECK(text.find("},\"d_f64\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[0,16]},"
                  "\"g_i64\":{") != std::string::npos);
  CHECK(text.find("\"e_bool\":{\"dtype\":\"BOOL\",\"shape\":[1],\"data_offsets\":[37,38]}}") !=
        std::string::npos);
  // No tensors, no metadata: an empty object.
  const Bytes empty_file = save_safetensors_bytes({});
  CHECK(std::string(empty_file.begin() + 8, empty_file.end()) == "{}      ");
}

TEST_CASE("safetensors: atomic save replaces the destination and leaves no temporary") {
  TempDir dir("mb_safetensors");
  const std::string path = (dir.path / "model.safetensors").string();
  save_safetensors(path, {{"w", full({2}, 1.0)}});
  CHECK(dir.listing() == std::vector<std::string>{"model.safetensors"});
  save_safetensors(path, {{"w", full({3}, 2.0)}, {"b", zeros({1})}}, {{"epoch", "2"}});
  CHECK(dir.listing() == std::vector<std::string>{"model.safetensors"});
  const auto loaded = load_safetensors(path);
  CHECK(loaded.tensors.size() == 2);
  CHECK(loaded.tensors.at("w").to_vector() == std::vector<double>{2.0, 2.0, 2.0});
  CHECK(loaded.metadata.at("epoch") == "2");

  // A refused save touches nothing: the previous file stays, no temporary appears.
  check_throws_with([&] { save_safetensors(path, {{"m", empty({2}, {.device = kMeta})}}); }, "meta");
  CHECK(dir.listing() == std::vector<std::string>{"model.safetensors"});
  CHECK(load_safetensors(path).tensors.at("w").numel() == 3);
  // A failed rename (the destination is a folder) removes the temporary.
  fs::create_directories(dir.path / "sub.safetensors" / "x");
  check_throws_with([&] { save_safetensors((dir.path / "sub.safetensors").string(), {{"w", zeros({1})}}); },
                    "cannot rename");
  CHECK(dir.listing() == std::vector<std::string>{"model.safetensors", "sub.safetensors"});
  check_throws_with([&] { save_safetensors((dir.path / "no/such/dir/f.st").string(), {}); },
                    "no/such/dir/f.st");
}

TEST_CASE("safetensors: file errors name the file") {
  TempDir dir("mb_safetensors");
  const fs::path missing = dir.path / "missing.safetensors";
  check_throws_with([&] { load_safetensors(missing.string()); }, missing.string() + ": cannot open");
  const fs::path empty_file = dir.path / "empty.safetensors";
  write_file(empty_file, {});
  check_throws_with([&] { load_safetensors(empty_file.string()); },
                    "[safetensors] " + empty_file.string() + ": file is 0 bytes");
  const fs::path bad = dir.path / "bad.safetensors";
  write_file(bad, file_with("{" + entry("w", "F32", "[2]", "[0,8]") + "}", 4));
  check_throws_with([&] { load_safetensors(bad.string()); },
                    "[safetensors] " + bad.string() + ": tensor 'w' ends at data byte 8");
  check_throws_with([&] { load_safetensors(dir.path.string()); }, "not a regular file");
}

TEST_CASE("safetensors: a FIFO is refused at once, not waited on for a writer") {
  TempDir dir("mb_safetensors");
  const fs::path fifo = dir.path / "pipe.safetensors";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto load = std::async(std::launch::async, [&] { load_safetensors(fifo.string()); });
  if (load.wait_for(std::chrono::seconds(2)) != std::future_status::ready) {
    FAIL_CHECK("load_safetensors blocked on a FIFO");
    // Connect a writer so that the blocked open() returns and the test can finish.
    while (load.wait_for(std::chrono::milliseconds(10)) != std::future_status::ready) {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);
    }
  }
  check_throws_with([&] { load.get(); }, fifo.string() + ": not a regular file");
}

TEST_CASE("safetensors: a header of 20000 tensors loads (the parse is linear in the tensors)") {
  // A count at which a parse quadratic in the tensor count takes seconds.
  constexpr int kCount = 20000;
  std::string header = "{";
  for (int i = 0; i < kCount; ++i)
    header += (i ? "," : "") +
              entry(fmt::format("layer.{}.w", i), "U8", "[1]", fmt::format("[{},{}]", i, i + 1));
  Bytes bytes = file_with(header + "}", kCount);
  for (int i = 0; i < kCount; ++i)
    bytes[bytes.size() - kCount + i] = static_cast<std::uint8_t>(i % 251);
  const SafetensorsFile f = load_safetensors_bytes(bytes);
  CHECK(f.tensors.size() == kCount);
  CHECK(f.tensors.at("layer.12345.w").to_vector() == std::vector<double>{12345 % 251});
}

TEST_CASE("safetensors: 20000 tensors save and load back (the header is built linearly)") {
  // A count at which a header built by looking each name up in the entries so far takes seconds.
  constexpr int kCount = 20000;
  NamedTensorMap in;
  for (int i = 0; i < kCount; ++i)
    in[fmt::format("layer.{}.w", i)] =
        from_vector({static_cast<double>(i % 251)}, {1}, {.dtype = DType::u8});
  const SafetensorsFile f = load_safetensors_bytes(save_safetensors_bytes(in));
  CHECK(f.tensors.size() == kCount);
  CHECK(f.tensors.at("layer.12345.w").to_vector() == std::vector<double>{12345 % 251});
}

TEST_CASE("safetensors: a flipped data byte fails the checksum") {
  TempDir dir("mb_safetensors");
  const fs::path path = dir.path / "ckpt.safetensors";
  save_safetensors(path.string(), {{"a", arange(0, 8)}, {"b", arange(0, 4, 1, {.dtype = DType::i64})}});
  Bytes bytes = read_file(path);
  bytes[bytes.size() - 5] ^= 0x10;  // inside a (f32, laid out after b's 8-byte elements)
  write_file(path, bytes);
  check_throws_with([&] { load_safetensors(path.string()); },
                    "[safetensors] " + path.string() + ": checksum mismatch for tensor 'a'");
  bytes[bytes.size() - 5] ^= 0x10;
  CHECK(load_safetensors_bytes(bytes).tensors.at("a").to_vector()[7] == 7.0);
}

TEST_CASE("safetensors: reads a file written by PyTorch and plain Python") {
  // tests/fixtures/interop.safetensors comes from scripts/make_safetensors_fixture.py.
  const std::string path = std::string(MB_FIXTURES_DIR) + "/interop.safetensors";
  const SafetensorsFile f = load_safetensors(path);
  CHECK(f.tensors.size() == 11);
  CHECK(f.metadata == std::map<std::string, std::string>{{"format", "pt"},
                                                          {"source", "make_safetensors_fixture.py"}});
  auto check = [&](const std::string& name, DType dt, const Shape& shape, const std::vector<double>& v) {
    CAPTURE(name);
    REQUIRE(f.tensors.count(name) == 1);
    const Tensor& t = f.tensors.at(name);
    CHECK(t.dtype() == dt);
    CHECK(t.shape() == shape);
    CHECK(t.to_vector() == v);
  };
  check("a_f32", DType::f32, {2, 3}, {0, 1, 2, 3, 4, 5});
  check("b_f64", DType::f64, {4}, {0, 0.5, 1, 1.5});
  check("c_f16", DType::f16, {4}, {1, -2, 0.5, 65504});
  check("d_bf16", DType::bf16, {3}, {1, -3, 0.25});
  check("e_i64", DType::i64, {6}, {-3, -2, -1, 0, 1, 2});
  check("f_i32", DType::i32, {2, 2}, {1, -2, 2147483647, -2147483648.0});
  check("g_u8", DType::u8, {6}, {250, 251, 252, 253, 254, 255});
  check("h_bool", DType::boolean, {3}, {1, 0, 1});
  check("i_scalar", DType::f32, {}, {7.5});
  check("j_empty", DType::f32, {0, 3}, {});
  check("k_transposed", DType::i32, {3, 2}, {0, 3, 1, 4, 2, 5});
  // The fixture carries checksums from Python's zlib.crc32, verified by the load above; a flipped
  // byte inside a_f32 (data bytes 0..23) must now be caught.
  Bytes bytes = read_file(path);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  bytes[8 + n + 5] ^= 0x01;
  check_rejected(bytes, {"checksum mismatch for tensor 'a_f32'"});
}

MB_CUDA_TEST_CASE("safetensors: CUDA tensors are saved from a CPU copy") {
  Tensor t = arange(0, 6, 1, {.device = test_gpu()}).reshape({2, 3}).t();
  const auto out = load_safetensors_bytes(save_safetensors_bytes({{"x", t}}));
  CHECK(out.tensors.at("x").device().is_cpu());
  CHECK(out.tensors.at("x").to_vector() == std::vector<double>{0, 3, 1, 4, 2, 5});
}

// ---- rejections (REFERENCE.md "safetensors (what a reader must reject)") -----------------------

TEST_CASE("safetensors rejects: bad framing") {
  check_rejected({1, 2, 3, 4, 5}, {"file is 5 bytes, shorter than the 8-byte header length"});
  check_rejected(raw_file(100'000'001, "{}"), {"header length 100000001 exceeds the limit"});
  check_rejected(raw_file(~0ull, "{}"), {"exceeds the limit"});
  check_rejected(raw_file(100, "{}", 10), {"header length 100 runs past the end of the 20-byte file"});
  check_rejected(raw_file(0, ""), {"header does not start with '{'"});
  check_rejected(file_with(" {}"), {"header does not start with '{'"});
  check_rejected(file_with("[]"), {"header does not start with '{'"});
}

TEST_CASE("safetensors rejects: header that is not UTF-8 JSON or has duplicate keys") {
  check_rejected(file_with("{\"a\xFF\":1}"), {"not valid UTF-8 (byte 3 of the header)"});
  check_rejected(file_with("{\"\xC0\x80\":1}"), {"not valid UTF-8"});      // overlong NUL
  check_rejected(file_with("{\"\xED\xA0\x80\":1}"), {"not valid UTF-8"});  // a surrogate
  check_rejected(file_with("{\"caf\xC3"), {"not valid UTF-8"});            // cut mid-character
  check_rejected(file_with("{\"a\": "), {"header is not valid JSON"});
  check_rejected(file_with("{} {}"), {"header is not valid JSON"});
  check_rejected(file_with("{\"a\":1,} "), {"header is not valid JSON"});
  const std::string w = entry("w", "F32", "[1]", "[0,4]");
  check_rejected(file_with("{" + w + "," + w + "}", 4), {"duplicate key 'w'"});
  check_rejected(file_with(R"({"w":{"dtype":"F32","dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4),
                 {"duplicate key 'dtype'"});
  check_rejected(file_with(R"({"__metadata__":{"k":"a","k":"b"}})"), {"duplicate key 'k'"});
  check_rejected(file_with(R"({"__metadata__":{"k":"a"},"__metadata__":{}})"),
                 {"duplicate key '__metadata__'"});
  check_rejected(file_with(R"({"x":[[[[1]]]]})"), {"deeper than a safetensors header"});
}

TEST_CASE("safetensors rejects: nesting too deep at its first level, reading no further") {
  // Both headers are broken JSON past the first level too deep: naming the depth rather than the
  // syntax error shows that the check stops there instead of reading (and building) the rest.
  check_rejected(file_with("{\"x\":" + std::string(100'000, '[') + "not json"),
                 {"deeper than a safetensors header"});
  check_rejected(file_with(R"({"__metadata__":{"k":{"a":{}}}, oops)"),
                 {"deeper than a safetensors header"});
}

TEST_CASE("safetensors rejects: a NUL byte in the header") {
  // nlohmann's lexer takes 0x00 for the end of its input: unchecked, whatever follows a NUL
  // would be ignored and the file would load.
  const std::string w = "{" + entry("w", "U8", "[1]", "[0,1]") + "}";
  check_rejected(file_with(w + std::string("\0 garbage {{{", 13), 1),
                 {fmt::format("header holds a NUL byte (byte {} of the header)", w.size())});
  check_rejected(file_with(w + std::string(1, '\0') + "  ", 1), {"NUL byte"});
  check_rejected(file_with(R"({"w\u0000":)" + std::string(1, '\0')), {"NUL byte (byte 11 "});
}

TEST_CASE("safetensors rejects: entries with bad dtype, fields or shape") {
  check_rejected(file_with("{" + entry("w", "F8_E4M3", "[1]", "[0,1]") + "}", 1),
                 {"tensor 'w'", "unsupported dtype 'F8_E4M3'"});
  check_rejected(file_with("{" + entry("w", "f32", "[1]", "[0,4]") + "}", 4),
                 {"tensor 'w'", "unsupported dtype 'f32'"});
  check_rejected(file_with(R"({"w":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", 4),
                 {"tensor 'w': dtype is a JSON number"});
  check_rejected(file_with(R"({"w":{"dtype":"F32","shape":[1]}})"),
                 {"tensor 'w': entry needs dtype, shape and data_offsets"});
  check_rejected(file_with(R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":0}})", 4),
                 {"tensor 'w': unknown field 'x'"});
  check_rejected(file_with(R"({"w":[1]})"), {"tensor 'w': entry is a JSON array"});
  check_rejected(file_with("{" + entry("w", "F32", "[2,-1]", "[0,0]") + "}"),
                 {"tensor 'w'", "shape entry 1 (-1) is not a non-negative integer"});
  check_rejected(file_with("{" + entry("w", "F32", "[2.0]", "[0,8]") + "}", 8),
                 {"tensor 'w'", "shape entry 0 (2.0) is not a non-negative integer"});
  check_rejected(file_with("{" + entry("w", "F32", "[\"2\"]", "[0,8]") + "}", 8),
                 {"shape entry 0 (\"2\") is not a non-negative integer"});
  check_rejected(file_with("{" + entry("w", "F32", "[1e2]", "[0,400]") + "}", 400),
                 {"shape entry 0 (100.0) is not a non-negative integer"});
  check_rejected(file_with("{" + entry("w", "F32", "2", "[0,8]") + "}", 8), {"shape is a JSON number"});
}

TEST_CASE("safetensors rejects: element and byte counts that overflow") {
  // 2^32 * 2^32 = 2^64 wraps to 0 in unchecked arithmetic; with offsets [0,0] a naive reader
  // would accept it.
  check_rejected(file_with("{" + entry("w", "U8", "[4294967296,4294967296]", "[0,0]") + "}"),
                 {"tensor 'w'", "element count of shape [4294967296,4294967296] overflows"});
  check_rejected(file_with("{" + entry("w", "U8", "[4611686018427387904,2]", "[0,0]") + "}"),
                 {"element count", "overflows"});  // 2^63 does not fit in int64
  check_rejected(file_with("{" + entry("w", "U8", "[18446744073709551615]", "[0,0]") + "}"),
                 {"element count", "overflows"});
  // 2^62 F32 elements are 2^64 bytes, which wraps to 0.
  check_rejected(file_with("{" + entry("w", "F32", "[4611686018427387904]", "[0,0]") + "}"),
                 {"tensor 'w'", "byte count of shape [4611686018427387904] in F32 overflows"});
  check_rejected(file_with("{" + entry("w", "F64", "[2305843009213693952]", "[0,0]") + "}"),
                 {"byte count", "overflows"});  // 2^61 * 8 = 2^64
  check_rejected(file_with("{" + entry("w", "I32", "[2305843009213693952]", "[0,0]") + "}"),
                 {"byte count", "overflows"});  // 2^63 > int64 max
}

TEST_CASE("safetensors rejects: a shape of more than 8 dims, naming the tensor") {
  check_rejected(file_with("{" + entry("w", "F32", "[1,1,1,1,1,1,1,1,4]", "[0,16]") + "}", 16),
                 {"tensor 'w': shape has 9 dims; at most 8 are supported"});
  // Refused by its length, before its entries are read.
  std::string long_shape = "[";
  for (int i = 0; i < 100'000; ++i) long_shape += "0,";
  check_rejected(file_with("{" + entry("w", "F32", long_shape + "\"x\"]", "[0,0]") + "}"),
                 {"tensor 'w': shape has 100001 dims"});
  const auto ok = load_safetensors_bytes(
      file_with("{" + entry("w", "F32", "[1,1,1,1,1,1,1,4]", "[0,16]") + "}", 16));
  CHECK(ok.tensors.at("w").dim() == 8);
}

TEST_CASE("safetensors rejects: a zero-element shape whose other dims overflow int64 strides") {
  // 0 elements, but the strides are products of the other dims: 2^62 * 4 = 2^64 wraps.
  check_rejected(file_with("{" + entry("w", "F32", "[0,4611686018427387904,4]", "[0,0]") + "}"),
                 {"tensor 'w'", "shape [0,4611686018427387904,4] has no elements but its other "
                                "dims multiply past 2^63 - 1"});
  check_rejected(
      file_with("{" + entry("w", "U8", "[1099511627776,0,1099511627776]", "[0,0]") + "}"),
      {"tensor 'w'", "multiply past 2^63 - 1"});
  // The largest that fits loads, with strides in range.
  const auto ok = load_safetensors_bytes(
      file_with("{" + entry("w", "F32", "[0,9223372036854775807]", "[0,0]") + "}"));
  CHECK(ok.tensors.at("w").numel() == 0);
  CHECK(ok.tensors.at("w").strides() == Shape{std::numeric_limits<std::int64_t>::max(), 1});
}

TEST_CASE("safetensors rejects: data_offsets malformed or not matching the shape") {
  for (const char* bad : {"[0]", "[0,4,8]", "[-1,3]", "[0,4.0]", "\"0,4\"", "[0,\"4\"]", "{}", "[]"}) {
    CAPTURE(bad);
    check_rejected(file_with("{" + entry("w", "F32", "[1]", bad) + "}", 4),
                   {"tensor 'w'", "must be two non-negative integers"});
  }
  check_rejected(file_with("{" + entry("w", "F32", "[0]", "[4,0]") + "}", 4),
                 {"tensor 'w'", "data_offsets [4, 0] begin after they end"});
  check_rejected(file_with("{" + entry("w", "F32", "[2]", "[0,4]") + "}", 4),
                 {"tensor 'w'", "data_offsets [0, 4] hold 4 bytes but shape [2] of F32 needs 8"});
  check_rejected(file_with("{" + entry("w", "BF16", "[3]", "[0,8]") + "}", 8),
                 {"hold 8 bytes but shape [3] of BF16 needs 6"});
}

TEST_CASE("safetensors rejects: offsets that do not tile the data buffer") {
  // The known attack: ten tensors aliasing the same 16 bytes.
  std::string ten = "{";
  for (int i = 0; i < 10; ++i) ten += (i ? "," : "") + entry(fmt::format("t{}", i), "F32", "[4]", "[0,16]");
  check_rejected(file_with(ten + "}", 16), {"at data bytes [0, 16] overlaps tensor 't", "at [0, 16]"});
  check_rejected(file_with("{" + entry("a", "F32", "[2]", "[0,8]") + "," +
                           entry("b", "F32", "[2]", "[4,12]") + "}", 12),
                 {"tensor 'b' at data bytes [4, 12] overlaps tensor 'a' at [0, 8]"});
  check_rejected(file_with("{" + entry("a", "F32", "[1]", "[0,4]") + "," +
                           entry("b", "F32", "[1]", "[8,12]") + "}", 12),
                 {"tensor 'b' at data bytes [8, 12] leaves a gap of 4 bytes"});
  check_rejected(file_with("{" + entry("a", "F32", "[1]", "[4,8]") + "}", 8),
                 {"tensor 'a'", "gap of 4 bytes"});
  check_rejected(file_with("{" + entry("a", "F32", "[1]", "[0,4]") + "}", 6),
                 {"2 trailing bytes after the last tensor 'a' (data ends at 4)"});
  check_rejected(file_with("{}", 3), {"3 trailing bytes after the last tensor '<none>'"});
  check_rejected(file_with("{" + entry("a", "F32", "[2]", "[0,8]") + "}", 4),
                 {"tensor 'a' ends at data byte 8 but the file holds only 4 data bytes", "missing bytes"});
  // Empty tensors take no bytes and may share an offset; out of order is fine.
  const auto ok = load_safetensors_bytes(file_with(
      "{" + entry("b", "U8", "[2]", "[0,2]") + "," + entry("a", "F32", "[0]", "[2,2]") + "," +
          entry("c", "F32", "[1,0]", "[2,2]") + "}  ",
      2));
  CHECK(ok.tensors.size() == 3);
}

TEST_CASE("safetensors rejects: metadata that is not a string map, bad checksums, bad BOOL bytes") {
  check_rejected(file_with(R"({"__metadata__":"pt"})"), {"__metadata__ is a JSON string, not a map"});
  check_rejected(file_with(R"({"__metadata__":["a"]})"), {"__metadata__ is a JSON array"});
  check_rejected(file_with(R"({"__metadata__":{"step":12}})"),
                 {"__metadata__ entry 'step' is a JSON number, not a string"});
  check_rejected(file_with(R"({"__metadata__":{"k":{}}})"), {"entry 'k' is a JSON object"});
  const std::string w = entry("w", "U8", "[4]", "[0,4]");
  check_rejected(file_with(R"({"__metadata__":{"microbatch.crc32.w":"2144DF1C"},)" + w + "}", 4),
                 {"'microbatch.crc32.w' is '2144DF1C', not 8 lowercase hex digits"});
  check_rejected(file_with(R"({"__metadata__":{"microbatch.crc32.v":"2144df1c"},)" + w + "}", 4),
                 {"checksum for tensor 'v', which the file lacks"});
  const std::string v = entry("v", "U8", "[0]", "[4,4]");
  check_rejected(file_with(R"({"__metadata__":{"microbatch.crc32.w":"2144df1c"},)" + w + "," + v + "}", 4),
                 {"checksums for some tensors but not for tensor 'v'"});
  // CRC-32 of four zero bytes is 0x2144df1c; claim otherwise.
  CHECK(load_safetensors_bytes(file_with(R"({"__metadata__":{"microbatch.crc32.w":"2144df1c"},)" + w + "}", 4))
            .tensors.size() == 1);
  check_rejected(file_with(R"({"__metadata__":{"microbatch.crc32.w":"2144df1d"},)" + w + "}", 4),
                 {"checksum mismatch for tensor 'w' (stored crc32 2144df1d, data has 2144df1c)"});
  Bytes b = file_with("{" + entry("flags", "BOOL", "[3]", "[0,3]") + "}", 3);
  b[b.size() - 2] = 2;
  check_rejected(b, {"tensor 'flags' (BOOL) holds byte 2 at element 1"});
}

TEST_CASE("safetensors: corrupted files raise only [safetensors] errors") {
  // One random bit flip, a truncation or a random header-length byte per trial (the bit-rot
  // model): each load either throws microbatch::Error from the validator or returns the original
  // tensors (the flip hit metadata text or padding). Under MB_SANITIZE this also shows that no
  // read leaves the buffer.
  const Bytes good = save_safetensors_bytes(
      {{"a", arange(0, 6).reshape({2, 3})}, {"b", zeros({2}, {.dtype = DType::boolean})}}, {{"k", "v"}});
  const SafetensorsFile reference = load_safetensors_bytes(good);
  std::uint64_t seed = 11;
  int rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    Bytes b = good;
    const std::uint64_t r = splitmix(seed) % 4;
    if (r == 0) b.resize(splitmix(seed) % b.size());
    else if (r == 1) b[splitmix(seed) % 8] = static_cast<std::uint8_t>(splitmix(seed));
    else b[splitmix(seed) % b.size()] ^= static_cast<std::uint8_t>(1u << (splitmix(seed) % 8));
    try {
      const SafetensorsFile f = load_safetensors_bytes(b);
      CHECK(f.tensors.size() == 2);
      for (const auto& [name, t] : f.tensors)
        CHECK(tensor_bytes(t) == tensor_bytes(reference.tensors.at(name)));
    } catch (const Error& e) {
      ++rejected;
      CHECK_MESSAGE(std::string(e.what()).rfind("[safetensors] <memory>: ", 0) == 0, e.what());
    }
  }
  CHECK(rejected > 2900);  // 2981 with this seed
}
