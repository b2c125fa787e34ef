// Trained weights read back into a model: the Trainer's output_dir/model.safetensors, or the
// weights of a checkpoint folder, for evaluation (`microbatch eval`) or any later use. Both record
// the architecture they were trained with (Model::architecture): the file in its safetensors
// metadata, a checkpoint in its trainer_state.json; a model built otherwise is refused, naming the
// first setting that differs, since its weights would compute another function.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "nn/models.h"

namespace microbatch::train {

/// The safetensors metadata key under which the Trainer's model.safetensors records the model's
/// architecture (Model::architecture(), as JSON text).
inline constexpr const char* kArchitectureMetadataKey = "microbatch.architecture";

/// The metadata the Trainer writes beside the weights of model.safetensors: the model's
/// architecture under kArchitectureMetadataKey (nothing for a model that records none).
std::map<std::string, std::string> trained_weights_metadata(const nn::Model& model);

/// The first setting in which an architecture recorded in `source` ("the checkpoint", "the
/// weights file") and this model's (`now`) differ, as "n_head = 2 in the checkpoint, 4 here";
/// nullopt when they agree.
std::optional<std::string> architecture_difference(const nlohmann::json& saved,
                                                   const nlohmann::json& now,
                                                   std::string_view source);

/// Where loaded weights came from.
struct TrainedWeights {
  std::string path;
  std::int64_t checkpoint_step = -1;  // the checkpoint's step; -1 for a weights file
};

/// Loads the weights at `path` into `model`. A folder is a checkpoint, validated whole as
/// load_checkpoint validates it (its f32 master weights are loaded); anything else is a
/// safetensors file of the model's state_dict names. Refused, with the path and the fault named:
/// nothing at the path, a damaged file, an architecture other than the model's (where the file
/// records one), a missing, extra or misshapen tensor (load_state_dict, strict).
TrainedWeights load_trained_weights(nn::Model& model, const std::string& path);

}  // namespace microbatch::train
