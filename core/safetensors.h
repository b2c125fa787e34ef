// safetensors reading and writing: an 8-byte little-endian header length N, N bytes of JSON
// ({"name": {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}), then the raw data.
// The reader validates every field of an untrusted file before it allocates or copies anything
// sized from it (see REFERENCE.md, "safetensors (what a reader must reject)"). The writer stores a
// CRC-32 of each tensor's bytes in __metadata__ so that bit rot is caught on load.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace microbatch {

/// Tensors by name, ordered by name.
using NamedTensorMap = std::map<std::string, Tensor>;

/// A loaded file: CPU tensors and the user's __metadata__ (without our checksum entries).
struct SafetensorsFile {
  NamedTensorMap tensors;
  std::map<std::string, std::string> metadata;
};

/// Metadata key prefix of the per-tensor checksum: "microbatch.crc32.<name>" -> 8 lowercase hex
/// digits, the CRC-32 (IEEE 802.3, the same function as zlib's crc32) of the tensor's data bytes.
/// A file carries checksums for all its tensors (ours) or for none (other writers'); a partial set
/// is rejected as a damaged header.
inline constexpr const char* kSafetensorsCrcPrefix = "microbatch.crc32.";

/// The largest header a reader accepts, in bytes (the limit of the reference implementation).
inline constexpr std::uint64_t kSafetensorsMaxHeader = 100'000'000;

/// Writes `tensors` to `path` atomically: a temporary file in the same folder is written, fsynced
/// and renamed over `path`, then the folder is fsynced. The header is padded with spaces to a
/// multiple of 8; tensors are laid out by descending dtype size, then name. Non-contiguous and
/// non-CPU tensors are copied to contiguous CPU memory first; meta tensors are refused.
void save_safetensors(const std::string& path, const NamedTensorMap& tensors,
                      const std::map<std::string, std::string>& metadata = {});

/// The bytes save_safetensors would write.
std::vector<std::uint8_t> save_safetensors_bytes(const NamedTensorMap& tensors,
                                                 const std::map<std::string, std::string>& metadata = {});

/// Reads a file into CPU tensors, validating it fully first; errors name `path` and the tensor.
SafetensorsFile load_safetensors(const std::string& path);

/// Reads safetensors bytes held in memory; `source` names them in error messages.
SafetensorsFile load_safetensors_bytes(std::span<const std::uint8_t> bytes,
                                       const std::string& source = "<memory>");

/// CRC-32 (IEEE, reflected, polynomial 0xEDB88320) of `bytes`, continuing from `crc`;
/// checksum_crc32("123456789") == 0xCBF43926.
std::uint32_t checksum_crc32(std::span<const std::uint8_t> bytes, std::uint32_t crc = 0);

}  // namespace microbatch
