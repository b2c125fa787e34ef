// A window's samples split into micro-batches: `micro` at a time, or packed by padded tokens for
// token sequences of different lengths (Note [Token-budget micro-batches] in train/windows.cpp).
// The Trainer runs them; plan_training replays them to find the shapes a run will make.
#pragma once

#include <cstdint>
#include <vector>

namespace microbatch::train {

/// The dataset indices of one micro-batch.
using Chunk = std::vector<std::int64_t>;

/// `indices` in micro-batches of `micro` (the last one smaller when micro does not divide them).
std::vector<Chunk> split_window(const std::vector<std::int64_t>& indices, std::int64_t micro);

/// `indices` (whose sequence lengths are `lengths`, in the same order) packed greedily, in order,
/// into micro-batches whose padded tokens, rows x longest row, stay within token_budget; a
/// sequence longer than the budget alone still makes a micro-batch of its own.
std::vector<Chunk> pack_window(const std::vector<std::int64_t>& indices,
                               const std::vector<std::int64_t>& lengths, std::int64_t token_budget);

}  // namespace microbatch::train
