#include "train/windows.h"

#include <algorithm>
#include <cstddef>

namespace microbatch::train {

std::vector<Chunk> split_window(const std::vector<std::int64_t>& indices, std::int64_t micro) {
  std::vector<Chunk> chunks;
  for (std::size_t i = 0; i < indices.size(); i += static_cast<std::size_t>(micro)) {
    chunks.emplace_back(
        indices.begin() + static_cast<std::ptrdiff_t>(i),
        indices.begin() + static_cast<std::ptrdiff_t>(std::min(indices.size(), i + micro)));
  }
  return chunks;
}

// Note [Token-budget micro-batches]: with variable-length sequences a micro-batch's memory follows
// its padded tokens (rows x longest row), not its row count. The plan is measured with every row
// as long as the training set's longest sequence (T_max), so that a micro-batch of any of its
// sequences, one sample alone included, is within what was measured; micro x T_max is the token
// count known to fit. Each window is packed greedily, in order, into micro-batches that stay
// within it. Packing by tokens keeps attention's T^2 scores within the plan too: rows x T <=
// micro x T_max with T <= T_max gives rows x T^2 <= micro x T_max^2. The micro-batches' many shapes
// leave the allocator more cache than a window at T_max does (blocks cached for one size do not
// serve a much smaller one), and the plan's predicted peak counts it: the planner measures the
// shapes of the run's own micro-batches first (run_shapes; Note [Mixed lengths] in
// train/planner.cpp), stretch by stretch between the evaluations, saves and resume that hand the
// cache back, and that is the run's peak to within 0.2%. Where that passes the budget the plan
// says so, and the run keeps within the budget, as the allocator hands its cache back before it
// takes a block past it.
std::vector<Chunk> pack_window(const std::vector<std::int64_t>& indices,
                               const std::vector<std::int64_t>& lengths,
                               std::int64_t token_budget) {
  std::vector<Chunk> chunks;
  Chunk current;
  std::int64_t longest = 0;
  for (std::size_t i = 0; i < indices.size(); ++i) {
    const std::int64_t l = lengths[i];
    const std::int64_t rows = static_cast<std::int64_t>(current.size()) + 1;
    if (!current.empty() && rows * std::max(longest, l) > token_budget) {
      chunks.push_back(std::move(current));
      current.clear();
      longest = 0;
    }
    current.push_back(indices[i]);
    longest = std::max(longest, l);
  }
  if (!current.empty()) chunks.push_back(std::move(current));
  return chunks;
}

}  // namespace microbatch::train
