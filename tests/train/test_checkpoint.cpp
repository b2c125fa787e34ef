// Training checkpoints: the round trip of model, optimizer and trainer state (bit for bit), the
// manifest checked against the bytes on disk, atomic saves (no scratch left behind, a crashed
// save's scratch ignored and cleaned), save_total_limit rotation, numeric step order, and the
// refusal of truncated, bit-flipped, unmarked or malformed checkpoints (FIFOs, oversized or deeply
// nested markers) with resume falling back to the previous good one.
#include <doctest/doctest.h>
#include <malloc.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include <fmt/format.h>

#include "core/safetensors.h"
#include "core/tensor.h"
#include "tests/core/harness.h"
#include "train/checkpoint.h"

using namespace microbatch;
using namespace microbatch::train;
using microbatch::testing::ChildLimits;
using microbatch::testing::run_in_child;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using Bytes = std::vector<std::uint8_t>;

// A temporary output folder, with the names checkpoints take in it.
struct CheckpointDir : testing::TempDir {
  CheckpointDir() : TempDir("mb_checkpoint") {}
  std::string str() const { return path.string(); }
  std::string checkpoint(std::int64_t step) const { return (path / fmt::format("checkpoint-{}", step)).string(); }
};

Bytes read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const fs::path& p, const Bytes& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

void flip_bit(const fs::path& p, std::size_t at, int bit = 0) {
  Bytes b = read_bytes(p);
  REQUIRE(at < b.size());
  b[at] ^= static_cast<std::uint8_t>(1u << bit);
  write_bytes(p, b);
}

// Distinct contents per step, covering every dtype class a trainer saves; the state holds values
// JSON mangles easily: a u64 RNG word above 2^63, doubles that need all 17 digits, nesting.
CheckpointData sample(std::int64_t step) {
  const double s = static_cast<double>(step);
  CheckpointData d;
  d.model["fc.weight"] = from_vector({0.1 * s, -0.2, 0.3, 1e-30, -4.5, 6.0}, {2, 3});
  d.model["fc.bias"] = from_vector({s, 1.0 / 3.0}, {2}, {.dtype = DType::f64});
  d.model["emb.weight"] = from_vector({1.5, -2.25, 3.0, s}, {2, 2}, {.dtype = DType::bf16});
  d.model["scale"] = from_vector({2.0}, {});
  d.optimizer["exp_avg.fc.weight"] = from_vector({1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3 * s}, {2, 3});
  d.optimizer["step"] = from_vector({s}, {}, {.dtype = DType::i64});
  d.trainer_state = {{"step", step},
                     {"epoch", 1.0 / 3.0},
                     {"rng", {{"state", 18446744073709551557ull}, {"inc", 6364136223846793005ull}}},
                     {"loader", {{"epoch", 2}, {"position", 17}}},
                     {"lr", 0.1 + 0.2},
                     {"args", {{"output_dir", "runs/ü"}, {"bf16", false}}}};
  return d;
}

void check_same_tensors(const NamedTensorMap& actual, const NamedTensorMap& expected, const std::string& what) {
  REQUIRE_MESSAGE(actual.size() == expected.size(), what);
  for (const auto& [name, e] : expected) {
    INFO(what, " tensor ", name);
    REQUIRE(actual.count(name) == 1);
    const Tensor& a = actual.at(name);
    CHECK(a.dtype() == e.dtype());
    CHECK(a.shape() == e.shape());
    REQUIRE(a.nbytes() == e.nbytes());
    CHECK(std::memcmp(a.raw_data(), e.raw_data(), e.nbytes()) == 0);  // bit for bit
  }
}

// Runs `body` expecting a "[checkpoint] <path>: ..." error that contains every needle.
void check_refused(const std::function<void()>& body, const std::string& path,
                   const std::vector<std::string>& needles) {
  try {
    body();
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK_MESSAGE(msg.rfind("[checkpoint] " + path + ": ", 0) == 0, msg);
    for (const auto& needle : needles)
      CHECK_MESSAGE(msg.find(needle) != std::string::npos, "'" << msg << "' lacks '" << needle << "'");
    return;
  }
  FAIL_CHECK("a damaged checkpoint was accepted; expected: " << needles.front());
}

// Saves good checkpoints 1 and 2, lets `damage` spoil checkpoint 2, then checks that loading it is
// refused with `needles` and that resume falls back to checkpoint 1 and reports the refusal.
void check_fallback(const std::function<void(const fs::path&)>& damage, const std::vector<std::string>& needles) {
  CheckpointDir dir;
  save_checkpoint(dir.str(), 1, sample(1), 0);
  save_checkpoint(dir.str(), 2, sample(2), 0);
  damage(dir.checkpoint(2));
  check_refused([&] { load_checkpoint(dir.checkpoint(2)); }, dir.checkpoint(2), needles);
  const auto resume = load_latest_checkpoint(dir.str());
  REQUIRE(resume.has_value());
  CHECK(resume->path == dir.checkpoint(1));
  CHECK(resume->data.trainer_state == sample(1).trainer_state);
  check_same_tensors(resume->data.model, sample(1).model, "fallback model");
  REQUIRE(resume->refused.size() == 1);
  CHECK(resume->refused[0].find(dir.checkpoint(2)) != std::string::npos);
  CHECK(resume->refused[0].find(needles.front()) != std::string::npos);
}

// AddressSanitizer aborts, rather than throwing std::bad_alloc, when an allocation fails.
#ifdef __SANITIZE_ADDRESS__
constexpr bool kAddressSanitizer = true;
#else
constexpr bool kAddressSanitizer = false;
#endif

// What load_latest_checkpoint(dir) resumes from and the reasons it gave, one per line.
std::string resume_report(const std::string& dir) {
  const auto resume = load_latest_checkpoint(dir);
  if (!resume) return "nothing to resume from";
  std::string out = resume->path;
  for (const auto& reason : resume->refused) out += "\n" + reason;
  return out;
}

}  // namespace

TEST_CASE("checkpoint: model, optimizer and trainer state round-trip bit for bit") {
  CheckpointDir dir;
  const CheckpointData data = sample(7);
  const std::string path = save_checkpoint(dir.str(), 7, data, 0);
  CHECK(path == dir.checkpoint(7));
  CHECK(dir.listing() == std::vector<std::string>{"checkpoint-7"});
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(path)) files.push_back(e.path().filename().string());
  std::sort(files.begin(), files.end());
  CHECK(files == std::vector<std::string>{"COMPLETE", "model.safetensors", "optimizer.safetensors",
                                          "trainer_state.json"});

  const CheckpointData back = load_checkpoint(path);
  check_same_tensors(back.model, data.model, "model");
  check_same_tensors(back.optimizer, data.optimizer, "optimizer");
  CHECK(back.trainer_state == data.trainer_state);
  CHECK(back.trainer_state["rng"]["state"].get<std::uint64_t>() == 18446744073709551557ull);
  CHECK(back.trainer_state["lr"].get<double>() == 0.1 + 0.2);  // exact, not within a tolerance
  CHECK(back.trainer_state["epoch"].get<double>() == 1.0 / 3.0);

  // The files are ordinary formats a reader without this module can open.
  check_same_tensors(load_safetensors(path + "/model.safetensors").tensors, data.model, "plain model file");
  check_same_tensors(load_safetensors(path + "/optimizer.safetensors").tensors, data.optimizer,
                     "plain optimizer file");
  const Bytes state = read_bytes(fs::path(path) / "trainer_state.json");
  CHECK(json::parse(state.begin(), state.end()) == data.trainer_state);

  // The marker's manifest records each file's size and CRC-32 as found on disk.
  const Bytes marker = read_bytes(fs::path(path) / "COMPLETE");
  const json manifest = json::parse(marker.begin(), marker.end());
  CHECK(manifest["step"] == 7);
  for (const char* name : {"model.safetensors", "optimizer.safetensors", "trainer_state.json"}) {
    INFO(name);
    const Bytes bytes = read_bytes(fs::path(path) / name);
    CHECK(manifest["files"][name]["bytes"].get<std::uint64_t>() == bytes.size());
    CHECK(manifest["files"][name]["crc32"] == fmt::format("{:08x}", checksum_crc32(bytes)));
  }
}

TEST_CASE("checkpoint: saves are atomic and leave no scratch behind") {
  CheckpointDir dir;
  const fs::path out = dir.path / "run" / "nested";  // created on demand
  save_checkpoint(out.string(), 3, sample(3), 0);

  SUBCASE("a crashed save's temporary folder is ignored by list and load, then cleaned") {
    // What a save killed before its rename leaves: a hidden folder, even with a marker inside.
    const fs::path crashed = out / ".checkpoint-5.tmp-999999-0";
    fs::copy(out / "checkpoint-3", crashed);
    const fs::path deleting = out / ".checkpoint-1.old-999999-4";
    fs::create_directories(deleting);
    CHECK(list_checkpoints(out.string()) == std::vector<std::string>{(out / "checkpoint-3").string()});
    const auto resume = load_latest_checkpoint(out.string());
    REQUIRE(resume.has_value());
    CHECK(resume->path == (out / "checkpoint-3").string());
    CHECK(resume->refused.empty());

    save_checkpoint(out.string(), 4, sample(4), 0);
    CHECK(!fs::exists(crashed));
    CHECK(!fs::exists(deleting));
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(out)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    CHECK(names == std::vector<std::string>{"checkpoint-3", "checkpoint-4"});
  }
  SUBCASE("a failed save removes its temporary folder and keeps the previous checkpoints") {
    CheckpointData bad = sample(4);
    bad.optimizer["meta"] = empty({2}, {.device = kMeta});  // has no bytes to write
    CHECK_THROWS_AS(save_checkpoint(out.string(), 4, bad, 1), Error);
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(out)) names.push_back(e.path().filename().string());
    CHECK(names == std::vector<std::string>{"checkpoint-3"});
    CHECK(load_checkpoint((out / "checkpoint-3").string()).trainer_state == sample(3).trainer_state);
  }
  SUBCASE("saving a step again replaces it whole") {
    CheckpointData again = sample(30);
    again.model.erase("scale");
    save_checkpoint(out.string(), 3, again, 0);
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(out)) names.push_back(e.path().filename().string());
    CHECK(names == std::vector<std::string>{"checkpoint-3"});
    const CheckpointData back = load_checkpoint((out / "checkpoint-3").string());
    check_same_tensors(back.model, again.model, "replaced model");
    CHECK(back.trainer_state == again.trainer_state);
  }
  SUBCASE("invalid arguments are refused before anything is written") {
    microbatch::testing::check_throws_with([&] { save_checkpoint(out.string(), -1, sample(1), 0); },
                                           "step must be >= 0");
    CheckpointData bad = sample(5);
    bad.trainer_state["note"] = std::string("\xff\xfe");  // not UTF-8: JSON cannot hold it
    microbatch::testing::check_throws_with([&] { save_checkpoint(out.string(), 5, bad, 0); },
                                           "trainer_state cannot be written as JSON");
    CHECK(list_checkpoints(out.string()).size() == 1);
    CHECK(!fs::exists(out / "checkpoint-5"));
  }
}

TEST_CASE("checkpoint: save_total_limit keeps the newest, never deleting the one just written") {
  CheckpointDir dir;
  for (std::int64_t step = 1; step <= 4; ++step) save_checkpoint(dir.str(), step, sample(step), 2);
  CHECK(list_checkpoints(dir.str()) == std::vector<std::string>{dir.checkpoint(3), dir.checkpoint(4)});
  CHECK(dir.listing() == std::vector<std::string>{"checkpoint-3", "checkpoint-4"});  // no scratch

  // An older step written last (a run resumed from it) survives its own rotation.
  save_checkpoint(dir.str(), 2, sample(2), 2);
  CHECK(list_checkpoints(dir.str()) == std::vector<std::string>{dir.checkpoint(2), dir.checkpoint(4)});

  SUBCASE("a limit of 1 keeps only the new one") {
    save_checkpoint(dir.str(), 5, sample(5), 1);
    CHECK(dir.listing() == std::vector<std::string>{"checkpoint-5"});
  }
  SUBCASE("0 or a negative limit keeps everything") {
    save_checkpoint(dir.str(), 5, sample(5), 0);
    save_checkpoint(dir.str(), 6, sample(6), -1);
    CHECK(list_checkpoints(dir.str()).size() == 4);
  }
  SUBCASE("folders without the marker are not counted or deleted") {
    fs::create_directories(dir.path / "checkpoint-1");
    save_checkpoint(dir.str(), 5, sample(5), 2);
    CHECK(dir.listing() == std::vector<std::string>{"checkpoint-1", "checkpoint-4", "checkpoint-5"});
  }
}

TEST_CASE("checkpoint: steps sort numerically, not as text") {
  CheckpointDir dir;
  for (std::int64_t step : {10, 9, 100, 2}) save_checkpoint(dir.str(), step, sample(step), 0);
  fs::create_directories(dir.path / "checkpoint-x");  // not a step: ignored
  fs::create_directories(dir.path / "checkpoint-");
  CHECK(list_checkpoints(dir.str()) ==
        std::vector<std::string>{dir.checkpoint(2), dir.checkpoint(9), dir.checkpoint(10), dir.checkpoint(100)});
  const auto resume = load_latest_checkpoint(dir.str());
  REQUIRE(resume.has_value());
  CHECK(resume->path == dir.checkpoint(100));
  CHECK(resume->data.trainer_state["step"] == 100);

  // Text order would delete checkpoint-10 and checkpoint-100 ("1..." < "2" < "9") first.
  save_checkpoint(dir.str(), 11, sample(11), 3);
  CHECK(list_checkpoints(dir.str()) ==
        std::vector<std::string>{dir.checkpoint(10), dir.checkpoint(11), dir.checkpoint(100)});
}

TEST_CASE("checkpoint: none to resume from") {
  CheckpointDir dir;
  CHECK(list_checkpoints((dir.path / "absent").string()).empty());
  CHECK(!load_latest_checkpoint((dir.path / "absent").string()).has_value());
  CHECK(!load_latest_checkpoint(dir.str()).has_value());
  check_refused([&] { load_checkpoint(dir.checkpoint(1)); }, dir.checkpoint(1), {"no such checkpoint folder"});

  // Every checkpoint damaged: nothing to resume from, and no silent acceptance.
  save_checkpoint(dir.str(), 1, sample(1), 0);
  fs::remove(dir.path / "checkpoint-1" / "COMPLETE");
  CHECK(!load_latest_checkpoint(dir.str()).has_value());
}

TEST_CASE("checkpoint: a truncated file is refused and resume falls back") {
  for (const char* name : {"model.safetensors", "optimizer.safetensors", "trainer_state.json"}) {
    INFO(name);
    check_fallback([&](const fs::path& cp) { fs::resize_file(cp / name, fs::file_size(cp / name) - 1); },
                   {name, "truncated"});
    check_fallback([&](const fs::path& cp) { fs::resize_file(cp / name, 0); }, {name, "is 0 bytes", "truncated"});
  }
  check_fallback([](const fs::path& cp) { fs::resize_file(cp / "COMPLETE", fs::file_size(cp / "COMPLETE") / 2); },
                 {"COMPLETE marker is damaged"});
}

TEST_CASE("checkpoint: a flipped byte in any file is refused and resume falls back") {
  for (const char* name : {"model.safetensors", "optimizer.safetensors", "trainer_state.json"}) {
    INFO(name);
    // In the header length, in the JSON header or state text, and in the last data byte.
    for (const std::size_t at : {std::size_t{0}, std::size_t{12}}) {
      check_fallback([&](const fs::path& cp) { flip_bit(cp / name, at, 3); }, {name, "corrupted", "CRC-32"});
    }
    check_fallback([&](const fs::path& cp) { flip_bit(cp / name, fs::file_size(cp / name) - 2, 7); },
                   {name, "corrupted"});
  }
  check_fallback([](const fs::path& cp) { fs::remove(cp / "COMPLETE"); }, {"no COMPLETE marker"});
  check_fallback([](const fs::path& cp) { fs::remove(cp / "optimizer.safetensors"); },
                 {"optimizer.safetensors", "cannot be opened"});
}

TEST_CASE("checkpoint: a folder renamed to another step is refused") {
  CheckpointDir dir;
  save_checkpoint(dir.str(), 1, sample(1), 0);
  save_checkpoint(dir.str(), 2, sample(2), 0);
  fs::rename(dir.checkpoint(2), dir.checkpoint(3));  // would resume step 2's state as step 3
  check_refused([&] { load_checkpoint(dir.checkpoint(3)); }, dir.checkpoint(3),
                {"named for step 3", "records step 2"});
  const auto resume = load_latest_checkpoint(dir.str());
  REQUIRE(resume.has_value());
  CHECK(resume->path == dir.checkpoint(1));
  REQUIRE(resume->refused.size() == 1);
  CHECK(resume->refused[0].find("named for step 3") != std::string::npos);
}

TEST_CASE("checkpoint: every single-bit flip anywhere in the COMPLETE marker is refused") {
  CheckpointDir dir;
  const std::string path = save_checkpoint(dir.str(), 12, sample(12), 0);
  const fs::path marker = fs::path(path) / "COMPLETE";
  const Bytes good = read_bytes(marker);
  REQUIRE(good.size() > 100);
  int accepted = 0;
  for (std::size_t at = 0; at < good.size(); ++at) {
    for (int bit = 0; bit < 8; ++bit) {
      Bytes bad = good;
      bad[at] ^= static_cast<std::uint8_t>(1u << bit);
      write_bytes(marker, bad);
      try {
        load_checkpoint(path);
        ++accepted;
        MESSAGE("accepted a flip of bit " << bit << " at byte " << at);
      } catch (const Error& e) {
        const std::string msg = e.what();
        CHECK_MESSAGE(msg.rfind("[checkpoint] " + path + ": ", 0) == 0, msg);
      }
    }
  }
  CHECK(accepted == 0);
  write_bytes(marker, good);
  CHECK(load_checkpoint(path).trainer_state == sample(12).trainer_state);
}

TEST_CASE("checkpoint: a FIFO where a file belongs is refused without waiting for a writer") {
  for (const std::string name : {"model.safetensors", "COMPLETE"}) {
    INFO(name);
    CheckpointDir dir;
    save_checkpoint(dir.str(), 1, sample(1), 0);
    save_checkpoint(dir.str(), 2, sample(2), 0);
    const fs::path file = fs::path(dir.checkpoint(2)) / name;
    fs::remove(file);
    REQUIRE(::mkfifo(file.c_str(), 0600) == 0);
    // In a child with a time limit: a blocking open() of the FIFO would wait for ever.
    const std::string report =
        run_in_child([&] { return resume_report(dir.str()); }, {.seconds = 5});
    const std::string what = name == "COMPLETE" ? "the COMPLETE marker" : name;
    CHECK(report == dir.checkpoint(1) + "\n[checkpoint] " + dir.checkpoint(2) + ": " + what +
                        " is not a regular file");
  }
}

TEST_CASE("checkpoint: a NUL byte in the COMPLETE marker is refused") {
  // The JSON parser stops at a NUL, which would accept the valid text before it.
  check_fallback(
      [](const fs::path& cp) {
        std::ofstream(cp / "COMPLETE", std::ios::app) << std::string("\0 garbage {{{", 13);
      },
      {"the COMPLETE marker is damaged: a NUL byte at offset"});
}

TEST_CASE("checkpoint: a COMPLETE marker too big or too deep is refused, never dumped whole") {
  // Sparse: the size alone must refuse it, before anything is read.
  check_fallback(
      [](const fs::path& cp) { fs::resize_file(cp / "COMPLETE", std::uintmax_t{64} << 20); },
      {"the COMPLETE marker is 67108864 bytes, over its limit of 1048576: it is damaged"});
  // 400,000 levels in 800 KB: printing such a value recursed once per level, past the stack.
  const std::size_t depth = 400000;
  const std::string deep = std::string(depth, '[') + std::string(depth, ']');
  check_fallback(
      [&](const fs::path& cp) { std::ofstream(cp / "COMPLETE") << R"({"format": )" + deep + "}"; },
      {"the COMPLETE marker is damaged: it nests deeper than the 3 levels of a manifest"});
  check_fallback(
      [](const fs::path& cp) {
        json manifest = json::parse(std::ifstream(cp / "COMPLETE"));
        manifest["files"]["model.safetensors"]["bytes"] = json::array({1});
        std::ofstream(cp / "COMPLETE") << manifest.dump();
      },
      {"nests deeper than the 3 levels"});

  // A long value within the limits is shown cut short, and a nested one by its type.
  CheckpointDir dir;
  const std::string path = save_checkpoint(dir.str(), 1, sample(1), 0);
  const fs::path marker = fs::path(path) / "COMPLETE";
  const json good = json::parse(std::ifstream(marker));
  const auto refusal = [&](const json& manifest) {
    std::ofstream(marker) << manifest.dump();
    try {
      load_checkpoint(path);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  json bad = good;
  bad["format"] = std::string(100000, 'x');
  const std::string long_format = refusal(bad);
  CHECK(long_format.find("not ours: format \"xxxx") != std::string::npos);
  CHECK_MESSAGE(long_format.size() < 300, long_format.size() << " characters");
  bad = good;
  bad["files"]["model.safetensors"]["crc32"] = std::string(100000, 'f');
  const std::string long_crc = refusal(bad);
  CHECK(long_crc.find("entry for model.safetensors is damaged: crc32 \"ffff") != std::string::npos);
  CHECK_MESSAGE(long_crc.size() < 300, long_crc.size() << " characters");
  bad = good;
  bad["step"] = json{{"a", {1, 2}}};
  CHECK(refusal(bad) ==
        "[checkpoint] " + path + ": the COMPLETE marker is damaged: step a JSON object");
}

TEST_CASE("checkpoint: resume skips a checkpoint whose loading fails with any exception" *
          doctest::skip(kAddressSanitizer)) {
  CheckpointDir dir;
  save_checkpoint(dir.str(), 1, sample(1), 0);
  CheckpointData big = sample(2);
  big.trainer_state["notes"] = std::string(std::size_t{48} << 20, 'x');
  save_checkpoint(dir.str(), 2, big, 0);
  // With 16 MiB to spare, reading checkpoint 2's 48 MiB of state throws std::bad_alloc, which is
  // not a microbatch::Error; resume must still fall back to checkpoint 1. The spare room is kept
  // well above what checkpoint 1 needs, as the failed read may leave some of it taken (with 8 MiB
  // beside 16 MiB of state, a change of allocation pattern elsewhere made this fail).
  const std::string report = run_in_child([&] { return resume_report(dir.str()); },
                                          {.headroom_bytes = std::size_t{16} << 20});
  CHECK(report == dir.checkpoint(1) + "\n[checkpoint] " + dir.checkpoint(2) +
                      ": cannot be read: std::bad_alloc");
}
