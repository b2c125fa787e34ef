// Training checkpoints on disk: output_dir/checkpoint-<step>/ holds model.safetensors,
// optimizer.safetensors, trainer_state.json and the COMPLETE marker, whose JSON manifest records
// each file's byte size and CRC-32. A checkpoint is built in a hidden temporary sibling folder,
// every file and the folder fsynced, then renamed into place and the parent fsynced: a crash
// leaves either the whole checkpoint or none of it (see REFERENCE.md, "Checkpoints and resume").
// Loading checks the marker, the manifest, every file's size and checksum, then parses the files;
// a damaged checkpoint is refused with the file and the fault named, and resume falls back to the
// newest one that loads.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/safetensors.h"

namespace microbatch::train {

/// Everything a resumed run needs to continue exactly where the saved one stopped.
struct CheckpointData {
  NamedTensorMap model;          // parameter and buffer tensors by name
  NamedTensorMap optimizer;      // optimizer state tensors by name
  nlohmann::json trainer_state;  // step, epoch, loader position, RNG state, scheduler, args, plan...
};

/// Names of the files inside a checkpoint folder; the marker is written last.
inline constexpr const char* kCheckpointModelFile = "model.safetensors";
inline constexpr const char* kCheckpointOptimizerFile = "optimizer.safetensors";
inline constexpr const char* kCheckpointStateFile = "trainer_state.json";
inline constexpr const char* kCheckpointMarkerFile = "COMPLETE";

/// Writes output_dir/checkpoint-<step>/ {model.safetensors, optimizer.safetensors,
/// trainer_state.json, COMPLETE} atomically (built in a temporary sibling folder, every file fsynced,
/// renamed into place, parent fsynced); then deletes the oldest complete checkpoints beyond
/// save_total_limit (0 or negative = keep all). Returns the checkpoint's path.
std::string save_checkpoint(const std::string& output_dir, std::int64_t step, const CheckpointData& data,
                            std::int64_t save_total_limit);

/// Reads and validates one checkpoint folder (marker present, manifest parses, every file's size and
/// checksum as recorded in trainer_state.json / the COMPLETE marker, safetensors validation). A file
/// that is not a regular one, or a marker over 1 MiB or nested deeper than a manifest, is refused
/// before it is read. Throws microbatch::Error "[checkpoint] <path>: <what is wrong>".
CheckpointData load_checkpoint(const std::string& path);

/// The complete checkpoints under output_dir, oldest step first (folders named checkpoint-<step>
/// with the marker; temporary and incomplete folders are ignored).
std::vector<std::string> list_checkpoints(const std::string& output_dir);

/// The step of a folder named checkpoint-<decimal digits>, or nullopt for any other name.
std::optional<std::int64_t> checkpoint_step(std::string_view name);

/// A checkpoint to resume from, and the newer ones that were refused ("<path>: <reason>").
struct ResumePoint {
  std::string path;
  CheckpointData data;
  std::vector<std::string> refused;
};

/// The newest checkpoint that loads; each newer one refused, whatever the exception, is reported in
/// `refused` with its reason (and a warning line on stderr). nullopt when there is none.
std::optional<ResumePoint> load_latest_checkpoint(const std::string& output_dir);

}  // namespace microbatch::train
