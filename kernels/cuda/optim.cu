// The optimizer's passes over whole arenas (Note [Flat arenas] in optim/param_store.h), one launch
// each: the gradient norm with its non-finite flag, the fused AdamW, SGD, scale, the loss-scale
// update, and the pinned-memory record through which the host learns the boundary's outcome.
// Weights and optimizer state are updated in place (overwrite); gradients are only read.
//
// A gated pass (DeviceGate) reads the norm reduction's result and the loss scale from device
// memory: every thread returns at once when the gradients were not finite (no weight, moment or
// working copy changes), and otherwise multiplies the gradients by inv_scale * clip_coef computed
// from those values (gated_grad_scale). So the boundary step needs no host synchronisation
// (Note [Boundary step on the device] in optim/boundary_step.h).
#include <cmath>
#include <type_traits>

#include "kernels/cuda/grad_stats.cuh"
#include "kernels/loss_scale.h"
#include "kernels/optim.h"

namespace microbatch::kernels::cuda {

namespace {

struct NoWork {};  // the working-copy type of a pass without one

/// AdamW's per-step constants, rounded to the compute type on the host exactly as cpu::adamw does.
template <class C>
struct AdamWCoeffs {
  C beta1, beta2, one_minus_beta1, one_minus_beta2, eps, decay, step_size, bias2_sqrt;
  double grad_scale;  // the host's factor; a gate multiplies it by its own
  std::int64_t decay_end;
};

template <class C>
AdamWCoeffs<C> adamw_coeffs(const AdamWArgs& a) {
  AdamWCoeffs<C> k;
  k.beta1 = static_cast<C>(a.beta1);
  k.beta2 = static_cast<C>(a.beta2);
  k.one_minus_beta1 = static_cast<C>(1.0 - a.beta1);  // as cpu::adamw: in double, then rounded
  k.one_minus_beta2 = static_cast<C>(1.0 - a.beta2);
  k.eps = static_cast<C>(a.eps);
  k.decay = static_cast<C>(1.0 - a.lr * a.weight_decay);
  k.step_size = static_cast<C>(a.lr / (1.0 - std::pow(a.beta1, static_cast<double>(a.step))));
  k.bias2_sqrt = static_cast<C>(std::sqrt(1.0 - std::pow(a.beta2, static_cast<double>(a.step))));
  k.grad_scale = a.grad_scale;
  k.decay_end = a.decay_end;
  return k;
}

/// The factor every gradient is multiplied by; false when a gate says the step is skipped.
template <class C>
__device__ __forceinline__ bool gated_scale(double host_scale, const DeviceGate& gate, C* scale) {
  if (gate.stats == nullptr) {
    *scale = static_cast<C>(host_scale);
    return true;
  }
  if (gate.stats->non_finite != 0) return false;
  *scale = static_cast<C>(host_scale * gated_grad_scale(gate.stats->sum_sq, gate.loss_scale, gate.max_grad_norm));
  return true;
}

/// One element of torch.optim.AdamW, operation for operation as cpu::adamw (this file is compiled
/// with --fmad=false, so that nvcc fuses no multiply-add the CPU rounds twice).
template <class C>
__device__ __forceinline__ C adamw_element(C w, C grad, C& m, C& v, bool decay, const AdamWCoeffs<C>& k) {
  if (decay) w *= k.decay;  // decoupled decay first
  m = k.beta1 * m + k.one_minus_beta1 * grad;
  v = k.beta2 * v + k.one_minus_beta2 * grad * grad;
  const C denom = sqrt(v) / k.bias2_sqrt + k.eps;
  return w - k.step_size * m / denom;
}

template <class P, class G, class W>
constexpr int adamw_pack() {
  using C = compute_t<P>;
  if constexpr (std::is_same_v<W, NoWork>) return kPackOf<P, G, C>;
  else return kPackOf<P, G, C, W>;
}

// params (n) P, grads (n) G, exp_avg and exp_avg_sq (n) in the compute type, work (n) W or none.
template <class P, class G, class W>
__global__ void adamw_kernel(P* params, const G* grads, compute_t<P>* exp_avg, compute_t<P>* exp_avg_sq,
                             W* work, PackSplit split, AdamWCoeffs<compute_t<P>> k, DeviceGate gate) {
  using C = compute_t<P>;
  constexpr int kPack = adamw_pack<P, G, W>();
  C scale;
  if (!gated_scale(k.grad_scale, gate, &scale)) return;  // skipped step: nothing changes
  auto grad_of = [&](G g) { return static_cast<C>(static_cast<compute_t<G>>(g)) * scale; };
  const std::int64_t packs = split.packs();
  const std::int64_t stride = grid_threads();
  for (std::int64_t p = global_thread(); p < packs; p += stride) {
    const std::int64_t i = split.pack_start(p);
    Pack<P, kPack> w = load_pack<P, kPack>(params + i);
    const Pack<G, kPack> g = load_pack<G, kPack>(grads + i);
    Pack<C, kPack> m = load_pack<C, kPack>(exp_avg + i);
    Pack<C, kPack> v = load_pack<C, kPack>(exp_avg_sq + i);
    [[maybe_unused]] Pack<std::conditional_t<std::is_same_v<W, NoWork>, P, W>, kPack> copy;
#pragma unroll
    for (int e = 0; e < kPack; ++e) {
      const C updated = adamw_element(static_cast<C>(static_cast<compute_t<P>>(w.v[e])), grad_of(g.v[e]),
                                      m.v[e], v.v[e], i + e < k.decay_end, k);
      w.v[e] = static_cast<P>(updated);
      if constexpr (!std::is_same_v<W, NoWork>) copy.v[e] = W(static_cast<float>(updated));
    }
    store_pack(params + i, w);
    store_pack(exp_avg + i, m);
    store_pack(exp_avg_sq + i, v);
    if constexpr (!std::is_same_v<W, NoWork>) store_pack(work + i, copy);
  }
  for (std::int64_t j = global_thread(); j < split.scalar_count(); j += stride) {  // head and tail
    const std::int64_t i = split.scalar_index(j);
    const C updated = adamw_element(static_cast<C>(static_cast<compute_t<P>>(params[i])), grad_of(grads[i]),
                                    exp_avg[i], exp_avg_sq[i], i < k.decay_end, k);
    params[i] = static_cast<P>(updated);
    if constexpr (!std::is_same_v<W, NoWork>) work[i] = W(static_cast<float>(updated));
  }
}

template <class C>
struct SGDCoeffs {
  C lr, momentum, one_minus_dampening, weight_decay;
  bool use_momentum, nesterov, first_step;
  double grad_scale;
  std::int64_t decay_end;
};

// As cpu::sgd; a plain grid-stride loop (SGD is not on the trainer's path).
template <class P, class G, class W>
__global__ void sgd_kernel(P* params, const G* grads, compute_t<P>* momentum_buffer, W* work, std::int64_t n,
                           SGDCoeffs<compute_t<P>> k, DeviceGate gate) {
  using C = compute_t<P>;
  C scale;
  if (!gated_scale(k.grad_scale, gate, &scale)) return;
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    const C w = static_cast<C>(static_cast<compute_t<P>>(params[i]));
    C d = static_cast<C>(static_cast<compute_t<G>>(grads[i])) * scale;
    if (i < k.decay_end) d += k.weight_decay * w;
    if (k.use_momentum) {
      C& buf = momentum_buffer[i];
      buf = k.first_step ? d : k.momentum * buf + k.one_minus_dampening * d;
      d = k.nesterov ? d + k.momentum * buf : buf;
    }
    params[i] = static_cast<P>(w - k.lr * d);
    if constexpr (!std::is_same_v<W, NoWork>) work[i] = W(static_cast<float>(w - k.lr * d));
  }
}

// Reads `values` once in 128-bit packs, two in flight per thread.
template <class T>
__global__ void sum_squares_kernel(const T* values, PackSplit split, GradStatsBuffer* stats) {
  constexpr int kPack = kPackOf<T>;
  StatsAccumulator acc;
  auto add_pack = [&](std::int64_t i, const Pack<T, kPack>& pack) {
#pragma unroll
    for (int e = 0; e < kPack; ++e) acc.add(static_cast<double>(static_cast<compute_t<T>>(pack.v[e])), i + e);
  };
  const std::int64_t packs = split.packs();
  const std::int64_t stride = grid_threads();
  std::int64_t p = global_thread();
  for (; p + stride < packs; p += 2 * stride) {
    const std::int64_t i = split.pack_start(p), i2 = split.pack_start(p + stride);
    const Pack<T, kPack> a = load_pack<T, kPack>(values + i);
    const Pack<T, kPack> b = load_pack<T, kPack>(values + i2);
    add_pack(i, a);
    add_pack(i2, b);
  }
  if (p < packs) add_pack(split.pack_start(p), load_pack<T, kPack>(values + split.pack_start(p)));
  for (std::int64_t j = global_thread(); j < split.scalar_count(); j += stride) {  // head and tail
    const std::int64_t i = split.scalar_index(j);
    acc.add(static_cast<double>(static_cast<compute_t<T>>(values[i])), i);
  }
  finish_stats(acc, stats);
}

template <class T>
__global__ void scale_kernel(StridedView values, std::int64_t n, compute_t<T> factor) {
  T* x = static_cast<T*>(values.data);
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    const std::int64_t o = strided_offset(values, i);
    x[o] = static_cast<T>(static_cast<compute_t<T>>(x[o]) * factor);
  }
}

__global__ void update_loss_scale_kernel(LossScaleState* state, const GradStats* stats, LossScaleRule rule) {
  LossScaleState s = *state;
  apply_loss_scale_update(s, stats->non_finite != 0, rule);
  *state = s;
}

void check_arena(const StridedView& v, std::int64_t n, const char* op, const char* what) {
  MB_CHECK(v.data != nullptr && v.numel() == n && v.is_contiguous(),
           "[{}] {} must be a contiguous arena of {} elements, got {} elements{}", op, what, n, v.numel(),
           v.is_contiguous() ? "" : " (not contiguous)");
}

/// Calls f.template operator()<W>() for the working copy's storage type (NoWork without one).
template <class F>
void dispatch_work(const StridedView& work, const char* op, F&& f) {
  if (work.data == nullptr) return f.template operator()<NoWork>();
  switch (work.dtype) {
    case DType::f16: return f.template operator()<f16>();
    case DType::bf16: return f.template operator()<bf16>();
    case DType::f32: return f.template operator()<float>();
    default: break;
  }
  MB_CHECK(false, "[{}] the working copy must be f16, bf16 or f32, got {}", op, dtype_name(work.dtype));
}

}  // namespace

void adamw(const StridedView& params, const StridedView& grads, const StridedView& exp_avg,
           const StridedView& exp_avg_sq, const AdamWArgs& args, const StridedView& work, const DeviceGate& gate) {
  const std::int64_t n = params.numel();
  check_arena(params, n, "adamw", "params");
  check_arena(grads, n, "adamw", "grads");
  check_arena(exp_avg, n, "adamw", "exp_avg");
  check_arena(exp_avg_sq, n, "adamw", "exp_avg_sq");
  if (work.data != nullptr) check_arena(work, n, "adamw", "the working copy");
  if (n == 0) return;
  cudaStream_t stream = current_stream();
  dispatch_float(params.dtype, "adamw", [&]<class P>() {
    dispatch_float(grads.dtype, "adamw", [&]<class G>() {
      using C = compute_t<P>;
      MB_CHECK(exp_avg.dtype == dtype_of<C>::value && exp_avg_sq.dtype == dtype_of<C>::value,
               "[adamw] moments must be {} for {} parameters", dtype_name(dtype_of<C>::value),
               dtype_name(params.dtype));
      dispatch_work(work, "adamw", [&]<class W>() {
        // A working copy belongs to f32 master weights (Note [Mixed precision]): other pairs are
        // not instantiated.
        if constexpr (!std::is_same_v<W, NoWork> && !std::is_same_v<P, float>) {
          MB_CHECK(false, "[adamw] a working copy needs f32 master weights, got {}", dtype_name(params.dtype));
        } else {
          // Without a working copy its address is 0, which pack_split does not check.
          const PackSplit split =
              pack_split(n, adamw_pack<P, G, W>(), address_of<P>(params.data),
                         {address_of<G>(grads.data), address_of<C>(exp_avg.data), address_of<C>(exp_avg_sq.data),
                          address_of<W>(work.data)});
          constexpr auto kernel = &adamw_kernel<P, G, W>;
          const unsigned grid = resident_grid<kernel>(split.items(), kMaxStatsBlocks);
          kernel<<<grid, kThreads, 0, stream>>>(static_cast<P*>(params.data), static_cast<const G*>(grads.data),
                                                static_cast<C*>(exp_avg.data), static_cast<C*>(exp_avg_sq.data),
                                                static_cast<W*>(work.data), split, adamw_coeffs<C>(args), gate);
          MB_CUDA_CHECK_LAUNCH("adamw");
        }
      });
    });
  });
}

void sgd(const StridedView& params, const StridedView& grads, const StridedView& momentum_buffer,
         const SGDArgs& args, const StridedView& work, const DeviceGate& gate) {
  const std::int64_t n = params.numel();
  check_arena(params, n, "sgd", "params");
  check_arena(grads, n, "sgd", "grads");
  if (args.momentum != 0.0) check_arena(momentum_buffer, n, "sgd", "momentum_buffer");
  if (work.data != nullptr) check_arena(work, n, "sgd", "the working copy");
  if (n == 0) return;
  cudaStream_t stream = current_stream();
  dispatch_float(params.dtype, "sgd", [&]<class P>() {
    dispatch_float(grads.dtype, "sgd", [&]<class G>() {
      using C = compute_t<P>;
      dispatch_work(work, "sgd", [&]<class W>() {
        if constexpr (!std::is_same_v<W, NoWork> && !std::is_same_v<P, float>) {
          MB_CHECK(false, "[sgd] a working copy needs f32 master weights, got {}", dtype_name(params.dtype));
        } else {
          SGDCoeffs<C> k{.lr = static_cast<C>(args.lr),
                         .momentum = static_cast<C>(args.momentum),
                         .one_minus_dampening = static_cast<C>(1.0 - args.dampening),
                         .weight_decay = static_cast<C>(args.weight_decay),
                         .use_momentum = args.momentum != 0.0,
                         .nesterov = args.nesterov,
                         .first_step = args.first_step,
                         .grad_scale = args.grad_scale,
                         .decay_end = args.decay_end};
          constexpr auto kernel = &sgd_kernel<P, G, W>;
          const unsigned grid = resident_grid<kernel>(n, kMaxStatsBlocks);
          kernel<<<grid, kThreads, 0, stream>>>(static_cast<P*>(params.data), static_cast<const G*>(grads.data),
                                                static_cast<C*>(momentum_buffer.data), static_cast<W*>(work.data), n,
                                                k, gate);
          MB_CUDA_CHECK_LAUNCH("sgd");
        }
      });
    });
  });
}

void sum_squares(const StridedView& values, GradStatsBuffer* stats) {
  MB_CHECK(stats != nullptr, "[sum_squares] needs a GradStatsBuffer in device memory");
  const std::int64_t n = values.numel();
  MB_CHECK(values.is_contiguous(), "[sum_squares] the arena must be contiguous");
  cudaStream_t stream = current_stream();
  dispatch_float(values.dtype, "sum_squares", [&]<class T>() {
    const PackSplit split = pack_split(n, kPackOf<T>, address_of<T>(values.data));
    constexpr auto kernel = &sum_squares_kernel<T>;
    const unsigned grid = resident_grid<kernel>(split.items(), kMaxStatsBlocks);
    kernel<<<grid, kThreads, 0, stream>>>(static_cast<const T*>(values.data), split, stats);
    MB_CUDA_CHECK_LAUNCH("sum_squares");
  });
}

void scale(const StridedView& values, double factor) {
  const std::int64_t n = values.numel();
  if (n == 0) return;
  cudaStream_t stream = current_stream();
  dispatch_float(values.dtype, "scale", [&]<class T>() {
    scale_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream>>>(values, n,
                                                                    static_cast<compute_t<T>>(factor));
    MB_CUDA_CHECK_LAUNCH("scale");
  });
}

void update_loss_scale(LossScaleState* state, const GradStats* stats, const LossScaleRule& rule) {
  MB_CHECK(state != nullptr && stats != nullptr, "[update_loss_scale] needs the state and the gradient statistics");
  update_loss_scale_kernel<<<1, 1, 0, current_stream()>>>(state, stats, rule);
  MB_CUDA_CHECK_LAUNCH("update_loss_scale");
}

// ---- the record ---------------------------------------------------------------------------------

void* host_alloc_pinned(std::size_t bytes, int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  void* ptr = nullptr;
  MB_CUDA_CHECK(cudaMallocHost(&ptr, bytes));
  return ptr;
}

void host_free_pinned(void* ptr) noexcept {
  if (ptr != nullptr) (void)cudaFreeHost(ptr);
}

void memcpy_device_to_host_async(void* dst, const void* src, std::size_t bytes, int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  MB_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, current_stream()));
}

void* event_create(int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  cudaEvent_t event = nullptr;
  MB_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event;
}

void event_destroy(void* event) noexcept {
  if (event != nullptr) (void)cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void event_record(void* event, int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  MB_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), current_stream()));
}

void event_synchronize(void* event) { MB_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event))); }

}  // namespace microbatch::kernels::cuda
