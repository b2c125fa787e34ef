// Optimizer kernels: each is one pass over a whole flat arena (Note [Flat arenas] in
// optim/param_store.h). Weights and optimizer state are updated in place (overwrite); gradients
// are only read. `grad_scale` folds unscaling and clipping into the same pass.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "core/half.h"
#include "kernels/view.h"

namespace microbatch::kernels {

struct AdamWArgs {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  std::int64_t step = 1;          // steps taken, this one included (bias correction)
  double grad_scale = 1.0;        // g = grad * grad_scale
  std::int64_t decay_end = 0;     // elements [0, decay_end) get weight decay
};

struct SGDArgs {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool first_step = true;         // the momentum buffer starts as the first gradient
  double grad_scale = 1.0;
  std::int64_t decay_end = 0;
};

namespace cpu {
/// PyTorch AdamW per element (REFERENCE.md), f32 or f64 math; params, m, v, grads: 1-d contiguous.
/// With a working copy (data != nullptr), also writes work[i] = (16-bit) params[i] in the same pass.
void adamw(const StridedView& params, const StridedView& grads, const StridedView& exp_avg,
           const StridedView& exp_avg_sq, const AdamWArgs& args, const StridedView& work = {});
/// PyTorch SGD per element; momentum_buffer may be empty when momentum == 0.
void sgd(const StridedView& params, const StridedView& grads, const StridedView& momentum_buffer,
         const SGDArgs& args, const StridedView& work = {});
/// Sum of squares of a 1-d contiguous arena in f64, and whether any element is not finite.
struct NormResult {
  double sum_sq = 0.0;
  bool non_finite = false;
};
NormResult sum_squares(const StridedView& values);
/// values *= factor.
void scale(const StridedView& values, double factor);
}  // namespace cpu

// ---- on the device: gradient statistics, gated steps, the boundary's record -------------------

/// What a reduction over gradients leaves in device memory (and what the host copies back).
struct GradStats {
  double sum_sq = 0.0;                 // sum of squares, each square exact in f64
  std::int64_t first_non_finite = -1;  // linear index of the first value that is not finite; -1: none
  std::uint32_t non_finite = 0;        // 1 when some value is not finite
  std::uint32_t reserved = 0;
};

/// How an arena pass splits [0, n) for 128-bit access: a scalar head [0, head) that brings the
/// arrays to a 16-byte boundary, packs of `pack` elements from there, and a scalar tail [tail, n).
/// Scalar item j in [0, scalar_count) is element scalar_index(j): the head's, then the tail's.
struct PackSplit {
  std::int64_t n = 0;
  std::int64_t head = 0;  // n when the arrays cannot share one alignment: all scalar
  std::int64_t pack = 1;

  MB_HOST_DEVICE std::int64_t packs() const { return (n - head) / pack; }
  MB_HOST_DEVICE std::int64_t pack_start(std::int64_t p) const { return head + p * pack; }
  MB_HOST_DEVICE std::int64_t tail() const { return head + packs() * pack; }
  MB_HOST_DEVICE std::int64_t scalar_count() const { return head + (n - tail()); }
  MB_HOST_DEVICE std::int64_t scalar_index(std::int64_t j) const { return j < head ? j : tail() + (j - head); }
  /// Work items of a grid-stride pass: the larger of the two loops.
  std::int64_t items() const { return packs() > scalar_count() ? packs() : scalar_count(); }
};

/// An array a pass reads or writes: its address and element size (address 0: absent).
struct ArrayAddress {
  std::uintptr_t address = 0;
  std::size_t element_size = 1;
};

/// The alignment an array's packs of `pack` elements need: the pack's own size up to 16 bytes (a
/// pack is one 64-bit access or 128-bit ones, kernels/cuda/grad_stats.cuh).
inline std::uintptr_t pack_alignment(std::int64_t pack, std::size_t element_size) {
  const std::uintptr_t bytes = static_cast<std::uintptr_t>(pack) * element_size;
  return bytes < 16 ? bytes : 16;
}

/// The split of n elements into packs of `pack` elements: the head aligns `first`'s packs
/// (pack_alignment); when that head leaves another array's packs unaligned, all is scalar.
inline PackSplit pack_split(std::int64_t n, std::int64_t pack, ArrayAddress first,
                            std::initializer_list<ArrayAddress> others = {}) {
  PackSplit split{.n = n, .head = n, .pack = pack};
  if (first.address % first.element_size != 0) return split;
  const std::uintptr_t align = pack_alignment(pack, first.element_size);
  const std::int64_t head = static_cast<std::int64_t>((align - first.address % align) % align / first.element_size);
  if (head >= n) return split;
  for (const ArrayAddress& a : others) {
    const std::uintptr_t start = a.address + static_cast<std::uintptr_t>(head) * a.element_size;
    if (a.address != 0 && start % pack_alignment(pack, a.element_size) != 0) return split;
  }
  split.head = head;
  return split;
}

/// Most blocks a one-launch reduction uses (a multiple of the resident blocks of any current GPU).
inline constexpr int kMaxStatsBlocks = 2048;

/// Note [One-launch reduction]: each block writes its partial sum and first bad index to its slot,
/// then takes a ticket (an atomic counter); the block that takes the last ticket sums the partials
/// in slot order and writes `result`, and sets the ticket back to 0. The grid depends only on the
/// device, so the result is the same bit for bit on every run. The buffer must start zeroed.
struct GradStatsBuffer {
  GradStats result;
  std::uint32_t ticket = 0;  // blocks finished in the running launch; 0 between launches
  std::uint32_t reserved = 0;
  double partial_sum_sq[kMaxStatsBlocks];
  std::int64_t partial_first[kMaxStatsBlocks];
};

/// Inputs of an optimizer pass that live on the store's device (Note [Boundary step on the
/// device] in optim/boundary_step.h): the pass does nothing when stats->non_finite, and multiplies
/// the gradients by args.grad_scale * gated_grad_scale(...). Empty: no gate.
struct DeviceGate {
  const GradStats* stats = nullptr;   // the norm reduction of the gradients being applied
  const float* loss_scale = nullptr;  // the scale the gradients carry; nullptr: none
  double max_grad_norm = 0.0;         // 0: no clipping
};

/// The trainer's unscale-and-clip factor: inv_scale * clip_coef, where inv_scale =
/// (float)(1 / (double)scale), norm = sqrt(sum_sq) * inv_scale and clip_coef =
/// min(1, max_grad_norm / (norm + 1e-6)) (torch's clip_grad_norm_). Each thread of a gated pass
/// computes it from device values; the CPU path computes the same doubles.
MB_HOST_DEVICE inline double gated_grad_scale(double sum_sq, const float* loss_scale, double max_grad_norm) {
  const double inv_scale =
      loss_scale != nullptr ? static_cast<double>(static_cast<float>(1.0 / static_cast<double>(*loss_scale))) : 1.0;
  double clip = 1.0;
  if (max_grad_norm > 0.0) {
    const double q = max_grad_norm / (std::sqrt(sum_sq) * inv_scale + 1e-6);
    clip = q < 1.0 ? q : 1.0;
  }
  return inv_scale * clip;
}

namespace cuda {
/// adamw, sgd and scale as their cpu:: namesakes, one launch over the arena each, 128-bit loads
/// where the arrays are 16-byte aligned. With a gate, the pass reads its skip flag, loss scale and
/// norm on the device, so nothing waits for the host.
void adamw(const StridedView& params, const StridedView& grads, const StridedView& exp_avg,
           const StridedView& exp_avg_sq, const AdamWArgs& args, const StridedView& work = {},
           const DeviceGate& gate = {});
void sgd(const StridedView& params, const StridedView& grads, const StridedView& momentum_buffer,
         const SGDArgs& args, const StridedView& work = {}, const DeviceGate& gate = {});
/// Sum of squares (f64) of a 1-d contiguous arena, its non-finite flag and first bad index, in
/// one launch (Note [One-launch reduction]); the result lands in stats->result (overwritten).
void sum_squares(const StridedView& values, GradStatsBuffer* stats);
void scale(const StridedView& values, double factor);

// Reading device values without stalling the stream: page-locked host memory, copies into it that
// return at once, and an event that says when they have landed.
void* host_alloc_pinned(std::size_t bytes, int device);
void host_free_pinned(void* ptr) noexcept;
/// Queues a copy of `bytes` from device memory into pinned host memory on the current stream.
void memcpy_device_to_host_async(void* dst, const void* src, std::size_t bytes, int device);
/// An event (no timing) recorded on the device's current stream, and the wait for it.
void* event_create(int device);
void event_destroy(void* event) noexcept;
void event_record(void* event, int device);
void event_synchronize(void* event);
}  // namespace cuda

}  // namespace microbatch::kernels
