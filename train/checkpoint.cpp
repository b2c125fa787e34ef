// Checkpoint folders. Saving:
//   - remove scratch folders a crashed save or deletion left behind (".checkpoint-*.tmp-*",
//     ".checkpoint-*.old-*"; one process writes to an output_dir at a time);
//   - build ".checkpoint-<step>.tmp-<pid>-<n>/" beside the destination: each file written, fsynced
//     and closed, COMPLETE (the manifest: byte size and CRC-32 of every other file) last, then the
//     folder fsynced;
//   - rename it to "checkpoint-<step>" (an existing one of that step is swapped out and deleted),
//     and fsync output_dir so that the rename itself is durable;
//   - delete the oldest complete checkpoints beyond save_total_limit, each first renamed to a
//     scratch name so that a crash mid-deletion never leaves a half-deleted "complete" checkpoint.
// Loading checks the marker, the manifest, each file's size (truncation) and CRC-32 (bit rot)
// before it parses anything, so the message names the damaged file and what is wrong with it.
#include "train/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <span>
#include <string_view>
#include <system_error>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "core/json_text.h"

namespace microbatch::train {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

/// Every failure reads "[checkpoint] <checkpoint folder>: <what>".
#define CK_CHECK(cond, where, ...) \
  MB_CHECK(cond, "[checkpoint] {}: {}", where, fmt::format(__VA_ARGS__))

constexpr const char* kFormatName = "microbatch-checkpoint";
constexpr std::int64_t kFormatVersion = 1;
constexpr std::string_view kFolderPrefix = "checkpoint-";
constexpr std::string_view kScratchPrefix = ".checkpoint-";
// The files the manifest covers, in the order they are written (the marker comes after them).
constexpr const char* kManifestFiles[] = {kCheckpointModelFile, kCheckpointOptimizerFile,
                                          kCheckpointStateFile};
constexpr std::size_t kReadChunk = std::size_t{1} << 20;
// A manifest is a few hundred bytes of {"files": {name: {"bytes", "crc32"}}}: a bigger or deeper
// marker is damage, refused before it is read whole or parsed (and later recursed) to the end.
constexpr std::uint64_t kMaxMarkerBytes = std::uint64_t{1} << 20;
constexpr int kMaxMarkerDepth = 3;  // the manifest, its "files", and each file's entry

std::string errno_text() { return std::error_code(errno, std::generic_category()).message(); }

}  // namespace

std::optional<std::int64_t> checkpoint_step(std::string_view name) {
  if (!name.starts_with(kFolderPrefix)) return std::nullopt;
  const std::string_view digits = name.substr(kFolderPrefix.size());
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  std::int64_t step = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (ec != std::errc() || end != digits.data() + digits.size()) return std::nullopt;
  return step;
}

namespace {

bool is_scratch_name(std::string_view name) {
  return name.starts_with(kScratchPrefix) &&
         (name.find(".tmp-") != std::string_view::npos || name.find(".old-") != std::string_view::npos);
}

/// A unique scratch name in output_dir for `step`; `kind` is "tmp" (being built) or "old" (being deleted).
fs::path scratch_path(const fs::path& dir, std::int64_t step, const char* kind) {
  static std::atomic<std::uint64_t> counter{0};
  return dir / fmt::format("{}{}.{}-{}-{}", kScratchPrefix, step, kind, ::getpid(), counter.fetch_add(1));
}

/// Closes a file descriptor on every path out of a scope.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }
  /// Gives up ownership, so that the caller can close() and check its result.
  int release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

/// fsync of a folder, so that the entries created or renamed in it are on disk.
void fsync_folder(const fs::path& dir, const std::string& where) {
  FileDescriptor fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  CK_CHECK(fd.get() >= 0, where, "cannot open folder {} to fsync it: {}", dir.string(), errno_text());
  // Some filesystems cannot sync folders (EINVAL); there the rename is as durable as it gets.
  CK_CHECK(::fsync(fd.get()) == 0 || errno == EINVAL, where, "fsync of folder {} failed: {}", dir.string(),
           errno_text());
}

/// Creates `file` (which must not exist), writes `bytes`, fsyncs and closes it.
void write_file_synced(const fs::path& file, std::span<const std::uint8_t> bytes, const std::string& where) {
  const int raw = ::open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
  CK_CHECK(raw >= 0, where, "cannot create {}: {}", file.string(), errno_text());
  FileDescriptor fd(raw);
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ::ssize_t n = ::write(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    CK_CHECK(n > 0, where, "writing {} failed after {} of {} bytes: {}", file.string(), done, bytes.size(),
             n < 0 ? errno_text() : std::string("no progress"));
    done += static_cast<std::size_t>(n);
  }
  CK_CHECK(::fsync(fd.get()) == 0, where, "fsync of {} failed: {}", file.string(), errno_text());
  const int closed = ::close(fd.release());
  CK_CHECK(closed == 0, where, "closing {} failed: {}", file.string(), errno_text());
}

std::span<const std::uint8_t> as_bytes(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

/// Writes one file of the checkpoint and returns its manifest entry {"bytes", "crc32"}.
json write_part(const fs::path& folder, const char* name, std::span<const std::uint8_t> bytes,
                const std::string& where) {
  write_file_synced(folder / name, bytes, where);
  return json{{"bytes", bytes.size()}, {"crc32", fmt::format("{:08x}", checksum_crc32(bytes))}};
}

/// open(2) for reading that never waits: without O_NONBLOCK a FIFO where a file belongs would
/// block until a writer comes. The flag changes nothing for the reads of a regular file.
int open_for_reading(const fs::path& file) {
  return ::open(file.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
}

/// The size of the open file `fd`, which must be a regular file (`what` names it in the message).
std::uint64_t regular_file_size(int fd, const std::string& what, const std::string& where) {
  struct stat st {};
  CK_CHECK(::fstat(fd, &st) == 0, where, "cannot stat {}: {}", what, errno_text());
  CK_CHECK(S_ISREG(st.st_mode), where, "{} is not a regular file", what);
  return static_cast<std::uint64_t>(st.st_size);
}

/// The whole content of a small regular file (the marker, trainer_state.json), refused when it
/// holds more than `max_bytes`; `what` names the file in the messages.
std::string read_text(const fs::path& file, const std::string& what, std::uint64_t max_bytes,
                      const std::string& where) {
  FileDescriptor fd(open_for_reading(file));
  CK_CHECK(fd.get() >= 0, where, "cannot open {}: {}", what, errno_text());
  const std::uint64_t size = regular_file_size(fd.get(), what, where);
  const auto check_size = [&](std::uint64_t bytes) {
    CK_CHECK(bytes <= max_bytes, where, "{} is {} bytes, over its limit of {}: it is damaged", what,
             bytes, max_bytes);
  };
  check_size(size);
  std::string text;
  char buf[65536];
  for (;;) {
    const ::ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    CK_CHECK(n >= 0, where, "reading {} failed: {}", what, errno_text());
    if (n == 0) return text;
    text.append(buf, static_cast<std::size_t>(n));
    check_size(text.size());  // it may have grown since fstat
  }
}

/// Whether `value` is a CRC-32 as the writer records it: eight lowercase hex digits.
bool is_crc_text(const json& value) {
  if (!value.is_string()) return false;
  const auto& text = value.get_ref<const std::string&>();
  return text.size() == 8 && std::all_of(text.begin(), text.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

/// Checks a file against its manifest entry: the size first (a truncated file is named as such
/// without reading it), then the CRC-32 of its bytes, read in chunks.
void verify_part(const fs::path& folder, const std::string& name, const json& entry, const std::string& where) {
  CK_CHECK(entry.is_object(), where, "the {} marker's entry for {} is damaged: {}, not an object",
           kCheckpointMarkerFile, name, shown_json(entry));
  const auto member = [&](const char* key) {
    return entry.contains(key) ? shown_json(entry.at(key)) : std::string("missing");
  };
  CK_CHECK(entry.contains("bytes") && entry.at("bytes").is_number_unsigned(), where,
           "the {} marker's entry for {} is damaged: bytes {}", kCheckpointMarkerFile, name,
           member("bytes"));
  CK_CHECK(entry.contains("crc32") && is_crc_text(entry.at("crc32")), where,
           "the {} marker's entry for {} is damaged: crc32 {}", kCheckpointMarkerFile, name,
           member("crc32"));
  const auto expected_size = entry.at("bytes").get<std::uint64_t>();
  const auto expected_crc = entry.at("crc32").get<std::string>();
  const fs::path file = folder / name;
  FileDescriptor fd(open_for_reading(file));
  CK_CHECK(fd.get() >= 0, where, "{} is listed in the manifest but cannot be opened: {}", name, errno_text());
  const std::uint64_t size = regular_file_size(fd.get(), name, where);
  CK_CHECK(size >= expected_size, where, "{} is {} bytes but the manifest records {}: the file is truncated",
           name, size, expected_size);
  CK_CHECK(size == expected_size, where,
           "{} is {} bytes but the manifest records {}: the file was appended to or replaced", name, size,
           expected_size);
  std::vector<std::uint8_t> buf(std::min<std::uint64_t>(kReadChunk, std::max<std::uint64_t>(size, 1)));
  std::uint32_t crc = 0;
  std::uint64_t done = 0;
  while (done < size) {
    const ::ssize_t n = ::read(fd.get(), buf.data(), std::min<std::uint64_t>(buf.size(), size - done));
    if (n < 0 && errno == EINTR) continue;
    CK_CHECK(n > 0, where, "reading {} failed after {} of {} bytes: {}", name, done, size,
             n < 0 ? errno_text() : std::string("the file shrank"));
    crc = checksum_crc32({buf.data(), static_cast<std::size_t>(n)}, crc);
    done += static_cast<std::uint64_t>(n);
  }
  const std::string actual_crc = fmt::format("{:08x}", crc);
  CK_CHECK(actual_crc == expected_crc, where,
           "{} has CRC-32 {} but the manifest records {}: the file is corrupted", name, actual_crc, expected_crc);
}

/// Folders under `dir` named checkpoint-<step>, with or without the marker, oldest step first.
std::vector<std::pair<std::int64_t, fs::path>> step_folders(const fs::path& dir) {
  std::vector<std::pair<std::int64_t, fs::path>> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  fs::directory_iterator it(dir, ec);
  MB_CHECK(!ec, "[checkpoint] {}: cannot list the folder: {}", dir.string(), ec.message());
  for (const auto& entry : it) {
    const auto step = checkpoint_step(entry.path().filename().string());
    std::error_code type_ec;
    if (step && entry.is_directory(type_ec)) out.emplace_back(*step, entry.path());
  }
  // checkpoint-9 before checkpoint-10; the name breaks ties ("checkpoint-7" vs "checkpoint-007").
  std::sort(out.begin(), out.end());
  return out;
}

bool has_marker(const fs::path& folder) {
  std::error_code ec;
  return fs::is_regular_file(folder / kCheckpointMarkerFile, ec);
}

/// Removes the scratch folders of crashed saves and deletions (all of them but `keep`).
void remove_scratch(const fs::path& dir, const fs::path& keep) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) return;
  std::vector<fs::path> doomed;
  for (const auto& entry : it)
    if (is_scratch_name(entry.path().filename().string()) && entry.path() != keep) doomed.push_back(entry.path());
  for (const auto& p : doomed) fs::remove_all(p, ec);  // best effort: the next save tries again
}

/// Moves the finished folder `tmp` to `dest`. An existing `dest` (the same step saved again) is
/// swapped out atomically where the filesystem can exchange names, else moved aside first.
void move_into_place(const fs::path& tmp, const fs::path& dest, std::int64_t step, const std::string& where) {
  if (::rename(tmp.c_str(), dest.c_str()) == 0) return;
  CK_CHECK(errno == ENOTEMPTY || errno == EEXIST, where, "cannot rename {} to it: {}", tmp.string(),
           errno_text());
#ifdef RENAME_EXCHANGE
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, dest.c_str(), RENAME_EXCHANGE) == 0) {
    std::error_code ec;
    fs::remove_all(tmp, ec);  // now the previous checkpoint; a leftover is scratch, cleaned later
    return;
  }
#endif
  const fs::path aside = scratch_path(dest.parent_path(), step, "old");
  CK_CHECK(::rename(dest.c_str(), aside.c_str()) == 0, where, "cannot move the existing folder aside: {}",
           errno_text());
  CK_CHECK(::rename(tmp.c_str(), dest.c_str()) == 0, where, "cannot rename {} to it: {}", tmp.string(),
           errno_text());
  std::error_code ec;
  fs::remove_all(aside, ec);
}

/// Deletes the oldest complete checkpoints beyond `limit`, never the one of `keep_step`.
void rotate(const fs::path& dir, std::int64_t keep_step, std::int64_t limit) {
  if (limit <= 0) return;
  std::vector<std::pair<std::int64_t, fs::path>> complete;
  for (auto& f : step_folders(dir))
    if (has_marker(f.second)) complete.push_back(std::move(f));
  auto excess = static_cast<std::int64_t>(complete.size()) - limit;
  for (const auto& [step, folder] : complete) {
    if (excess <= 0) break;
    if (step == keep_step) continue;
    // Renamed first: a crash mid-deletion leaves scratch, never a half-deleted checkpoint.
    const fs::path doomed = scratch_path(dir, step, "old");
    std::error_code ec;
    if (::rename(folder.c_str(), doomed.c_str()) != 0) {
      fmt::print(stderr, "[checkpoint] warning: cannot delete {} (save_total_limit {}): {}\n", folder.string(),
                 limit, errno_text());
      continue;
    }
    fs::remove_all(doomed, ec);
    --excess;
  }
  try {
    fsync_folder(dir, dir.string());
  } catch (const Error&) {
    // The deletions are not needed for correctness; a lost one is redone by the next rotation.
  }
}

}  // namespace

std::string save_checkpoint(const std::string& output_dir, std::int64_t step, const CheckpointData& data,
                            std::int64_t save_total_limit) {
  MB_CHECK(!output_dir.empty(), "[checkpoint] save_checkpoint: output_dir is empty");
  MB_CHECK(step >= 0, "[checkpoint] save_checkpoint: step must be >= 0, got {}", step);
  const fs::path dir(output_dir);
  const fs::path dest = dir / fmt::format("{}{}", kFolderPrefix, step);
  const std::string where = dest.string();

  std::error_code ec;
  const bool created = fs::create_directories(dir, ec);
  CK_CHECK(!ec, where, "cannot create output_dir {}: {}", output_dir, ec.message());
  if (created) {  // the new folder's own entry must reach the disk too
    fs::path abs = fs::absolute(dir);
    if (!abs.has_filename()) abs = abs.parent_path();  // "out/" names the folder "out"
    fsync_folder(abs.parent_path(), where);
  }
  // trainer_state must be valid JSON text before anything touches the disk.
  std::string state_text;
  try {
    state_text = data.trainer_state.dump(2) + "\n";
  } catch (const json::exception& e) {
    CK_CHECK(false, where, "trainer_state cannot be written as JSON: {}", e.what());
  }

  remove_scratch(dir, {});
  const fs::path tmp = scratch_path(dir, step, "tmp");
  CK_CHECK(fs::create_directory(tmp, ec) && !ec, where, "cannot create temporary folder {}: {}", tmp.string(),
           ec ? ec.message() : std::string("it already exists"));
  try {
    json files = json::object();
    {  // one serialized file in memory at a time
      const auto bytes = save_safetensors_bytes(data.model);
      files[kCheckpointModelFile] = write_part(tmp, kCheckpointModelFile, bytes, where);
    }
    {
      const auto bytes = save_safetensors_bytes(data.optimizer);
      files[kCheckpointOptimizerFile] = write_part(tmp, kCheckpointOptimizerFile, bytes, where);
    }
    files[kCheckpointStateFile] = write_part(tmp, kCheckpointStateFile, as_bytes(state_text), where);
    const json manifest{{"format", kFormatName}, {"version", kFormatVersion}, {"step", step}, {"files", files}};
    write_file_synced(tmp / kCheckpointMarkerFile, as_bytes(manifest.dump() + "\n"), where);
    fsync_folder(tmp, where);
    move_into_place(tmp, dest, step, where);
  } catch (...) {
    fs::remove_all(tmp, ec);  // no half-written folder survives a failed save
    throw;
  }
  fsync_folder(dir, where);
  rotate(dir, step, save_total_limit);
  return where;
}

CheckpointData load_checkpoint(const std::string& path) {
  const fs::path folder(path);
  std::error_code ec;
  CK_CHECK(fs::is_directory(folder, ec), path, "no such checkpoint folder");
  // Present but not a regular file (a folder, a FIFO) is named as such by read_text.
  CK_CHECK(fs::exists(folder / kCheckpointMarkerFile, ec), path,
           "no {} marker: the save was interrupted or this folder is not a checkpoint", kCheckpointMarkerFile);

  const std::string marker_name = fmt::format("the {} marker", kCheckpointMarkerFile);
  const std::string marker_text =
      read_text(folder / kCheckpointMarkerFile, marker_name, kMaxMarkerBytes, path);
  // nlohmann's parser takes a NUL byte for the end of the input: what follows would pass unread.
  const std::size_t nul = marker_text.find('\0');
  CK_CHECK(nul == std::string::npos, path, "{} is damaged: a NUL byte at offset {}", marker_name,
           nul);
  json manifest;
  try {
    // The callback stops a deeply nested marker at the first level too many, before it is built.
    manifest = json::parse(marker_text, [&](int depth, json::parse_event_t event, json&) {
      const bool opens = event == json::parse_event_t::object_start ||
                         event == json::parse_event_t::array_start;
      CK_CHECK(!opens || depth < kMaxMarkerDepth, path,
               "{} is damaged: it nests deeper than the {} levels of a manifest", marker_name,
               kMaxMarkerDepth);
      return true;
    });
  } catch (const json::exception& e) {
    CK_CHECK(false, path, "{} is damaged, not valid JSON: {}", marker_name, e.what());
  }
  const auto field = [&](const char* key) -> const json& {
    CK_CHECK(manifest.is_object() && manifest.contains(key), path, "the {} marker is damaged: it has no \"{}\"",
             kCheckpointMarkerFile, key);
    return manifest.at(key);
  };
  CK_CHECK(field("format") == kFormatName, path, "the {} marker is damaged or not ours: format {}",
           kCheckpointMarkerFile, shown_json(field("format")));
  CK_CHECK(field("version") == kFormatVersion, path,
           "checkpoint format version {} is not supported (this build reads version {})",
           shown_json(field("version")), kFormatVersion);
  const json& step = field("step");
  CK_CHECK(step.is_number_integer(), path, "the {} marker is damaged: step {}",
           kCheckpointMarkerFile, shown_json(step));
  // A renamed folder (or a flipped digit) would sort and resume under the wrong step.
  if (const auto named = checkpoint_step(folder.filename().string()))
    CK_CHECK(step.get<std::int64_t>() == *named, path, "the folder is named for step {} but its {} records step {}",
             *named, kCheckpointMarkerFile, shown_json(step));
  const json& files = field("files");
  CK_CHECK(files.is_object(), path, "the {} marker is damaged: files {}", kCheckpointMarkerFile,
           shown_json(files));
  for (const char* name : kManifestFiles) {
    CK_CHECK(files.contains(name), path, "the {} marker is damaged: it does not list {}", kCheckpointMarkerFile,
             name);
    verify_part(folder, name, files.at(name), path);
  }

  // Every byte now matches what was written; a parse error here means the writer was wrong.
  CheckpointData out;
  const auto load_tensors = [&](const char* name) {
    try {
      return load_safetensors((folder / name).string()).tensors;
    } catch (const Error& e) {
      CK_CHECK(false, path, "{} does not load: {}", name, e.what());
      return NamedTensorMap{};
    }
  };
  out.model = load_tensors(kCheckpointModelFile);
  out.optimizer = load_tensors(kCheckpointOptimizerFile);
  try {
    // Its size already matches the manifest, so it needs no limit of its own.
    out.trainer_state = json::parse(read_text(folder / kCheckpointStateFile, kCheckpointStateFile,
                                              std::numeric_limits<std::uint64_t>::max(), path));
  } catch (const json::exception& e) {
    CK_CHECK(false, path, "{} is not valid JSON: {}", kCheckpointStateFile, e.what());
  }
  return out;
}

std::vector<std::string> list_checkpoints(const std::string& output_dir) {
  std::vector<std::string> out;
  for (const auto& [step, folder] : step_folders(output_dir))
    if (has_marker(folder)) out.push_back(folder.string());
  return out;
}

std::optional<ResumePoint> load_latest_checkpoint(const std::string& output_dir) {
  // Folders without the marker are candidates too: our saves never leave one, so a newer one
  // means damage the user should hear about rather than a silent skip.
  const auto folders = step_folders(output_dir);
  ResumePoint point;
  for (auto it = folders.rbegin(); it != folders.rend(); ++it) {
    const std::string path = it->second.string();
    std::string reason;
    try {
      point.data = load_checkpoint(path);
      point.path = path;
      return point;
    } catch (const Error& e) {
      reason = e.what();
    } catch (const std::exception& e) {
      // Whatever else stops it (memory, say) still only disqualifies this one checkpoint.
      reason = fmt::format("[checkpoint] {}: cannot be read: {}", path, e.what());
    }
    const bool last = std::next(it) == folders.rend();
    fmt::print(stderr, "warning: {}; {}\n", reason,
               last ? "no older checkpoint remains" : "trying the previous checkpoint");
    point.refused.push_back(std::move(reason));
  }
  return std::nullopt;
}

}  // namespace microbatch::train
