// Trained weights read back into a model (train/weights.h).
#include "train/weights.h"

#include <algorithm>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>

#include "core/error.h"
#include "core/json_text.h"
#include "core/safetensors.h"
#include "train/checkpoint.h"

namespace microbatch::train {

namespace {

namespace fs = std::filesystem;

// A setting of a model architecture for a message: a short list of numbers (an MLP's hidden
// widths) in full, anything else as shown_json shows a value of an untrusted file.
std::string shown_setting(const nlohmann::json& v) {
  const bool short_numbers =
      v.is_array() && v.size() <= 16 &&
      std::all_of(v.begin(), v.end(), [](const nlohmann::json& e) { return e.is_number(); });
  return short_numbers ? v.dump() : shown_json(v);
}

// The architecture a weights file records in its metadata; null where it records none.
nlohmann::json recorded_architecture(const SafetensorsFile& file, const std::string& path) {
  const auto it = file.metadata.find(kArchitectureMetadataKey);
  if (it == file.metadata.end()) return nullptr;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(it->second);
  } catch (const nlohmann::json::exception&) {
    MB_CHECK(false, "[weights] {}: its metadata '{}' is not JSON", path, kArchitectureMetadataKey);
  }
  MB_CHECK(j.is_object(), "[weights] {}: its metadata '{}' must be a JSON object, got {}", path,
           kArchitectureMetadataKey, shown_json(j));
  return j;
}

void check_architecture(const nlohmann::json& saved, const nn::Model& model,
                        const std::string& path, std::string_view source) {
  const nlohmann::json now = model.architecture();
  if (saved.is_null() || now.is_null()) return;  // the weights' shapes are checked as they load
  const std::optional<std::string> differs = architecture_difference(saved, now, source);
  MB_CHECK(!differs.has_value(),
           "[weights] {} was trained with another model: {}; its weights would compute another "
           "function (build the model as it was trained)",
           path, *differs);
}

}  // namespace

std::optional<std::string> architecture_difference(const nlohmann::json& saved,
                                                   const nlohmann::json& now,
                                                   std::string_view source) {
  // The kind first: another kind differs in every setting.
  if (saved.contains("model") && now.contains("model") && saved.at("model") != now.at("model"))
    return fmt::format("model = {} in {}, {} here", shown_setting(saved.at("model")), source,
                       shown_setting(now.at("model")));
  for (const auto& [key, value] : now.items()) {
    if (!saved.contains(key))
      return fmt::format("no {} in {}, {} here", key, source, shown_setting(value));
    if (saved.at(key) != value)
      return fmt::format("{} = {} in {}, {} here", key, shown_setting(saved.at(key)), source,
                         shown_setting(value));
  }
  for (const auto& [key, value] : saved.items()) {
    if (!now.contains(key))
      return fmt::format("{} = {} in {}, which this model does not have", key, shown_setting(value),
                         source);
  }
  return std::nullopt;
}

std::map<std::string, std::string> trained_weights_metadata(const nn::Model& model) {
  const nlohmann::json architecture = model.architecture();
  if (architecture.is_null()) return {};
  return {{kArchitectureMetadataKey, architecture.dump()}};
}

TrainedWeights load_trained_weights(nn::Model& model, const std::string& path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  MB_CHECK(fs::exists(status), "[weights] {}: no such file or folder", path);
  TrainedWeights out{.path = path};
  if (fs::is_directory(status)) {
    CheckpointData data = load_checkpoint(path);  // validated whole; throws "[checkpoint] ..."
    const nlohmann::json& st = data.trainer_state;
    if (st.contains("model")) {
      MB_CHECK(st.at("model").is_object(),
               "[weights] {}: 'model' in {} must be a JSON object, got {}", path,
               kCheckpointStateFile, shown_json(st.at("model")));
      check_architecture(st.at("model"), model, path, "the checkpoint");
    }
    if (st.contains("global_step") && st.at("global_step").is_number_integer())
      out.checkpoint_step = st.at("global_step").get<std::int64_t>();
    model.load_state_dict(data.model);
  } else {
    SafetensorsFile file = load_safetensors(path);  // validated; throws naming the path
    check_architecture(recorded_architecture(file, path), model, path, "the weights file");
    model.load_state_dict(file.tensors);
  }
  return out;
}

}  // namespace microbatch::train
