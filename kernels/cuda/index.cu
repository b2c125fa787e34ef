// CUDA indexing kernels: gather (overwrites its output) and scatter_add (accumulates into dst), and
// the asynchronous index range check of Note [Deferred index errors] (kernels/index.h).
//
// gather runs one thread per output element. scatter_add runs one thread per destination line,
// all coordinates but `dim`: source line c only ever writes destination line c, so the thread that
// owns it walks `dim` in order and adds without atomics, in the order the CPU adds; repeated
// indices therefore give the CPU's bits, on every run. Both skip indices outside the valid range
// rather than touch memory out of bounds; check_index_range reports them.
//
// scatter_add_sorted (Note [Sorted scatter_add] in kernels/index.h) serves the embedding backward,
// where few lines each walk many positions: it writes (index, position) pairs, sorts them by index
// with CUB's stable radix sort (out-of-range indices become one key past the end, a run that is
// skipped), and scatter_add_runs gives each run of equal indices to a block, a thread per column,
// adding in position order as the CPU does.
#include <cuda_runtime.h>

#include <bit>
#include <climits>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <mutex>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/device.h"
#include "kernels/index.h"
#include "kernels/indexer.h"

namespace microbatch::kernels::cuda {

namespace {

constexpr unsigned long long kNoPosition = ULLONG_MAX;

// One per device, in device memory. A check's kernels lower `scan` to the first bad position, then
// record_bad_index moves it into the record (unless one is already held) and resets `scan`.
struct IndexErrorSlot {
  unsigned long long scan;
  int recorded;  // 1: position, value, size and op describe an error not yet raised
  long long position;
  long long value;
  long long size;
  const char* op;  // a string literal on the host, carried through
};

struct SlotState {
  IndexErrorSlot* slot = nullptr;
  bool checked = false;  // a check ran since the last raise_pending_index_error
};

std::mutex g_slots_mutex;

// Slots live for the whole process, like the device's library handles.
SlotState& slot_state(int device) {
  static std::vector<SlotState>* all = new std::vector<SlotState>();
  if (all->size() <= static_cast<std::size_t>(device)) all->resize(device + 1);
  return (*all)[device];
}

template <class I>
__global__ void find_bad_index(IndexErrorSlot* slot, const I* index, Indexer<1> ix, std::int64_t n,
                               std::int64_t size, std::int64_t allowed) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    std::int64_t off[1];
    ix.offsets(i, off);
    const std::int64_t v = index[off[0]];
    if ((v < 0 || v >= size) && v != allowed) {
      atomicMin(&slot->scan, static_cast<unsigned long long>(i));
    }
  }
}

template <class I>
__global__ void record_bad_index(IndexErrorSlot* slot, const I* index, Indexer<1> ix,
                                 std::int64_t size, const char* op) {
  const unsigned long long position = slot->scan;
  if (position == kNoPosition) return;
  slot->scan = kNoPosition;
  if (slot->recorded) return;  // the first error stays until it is raised
  std::int64_t off[1];
  ix.offsets(static_cast<std::int64_t>(position), off);
  slot->position = static_cast<long long>(position);
  slot->value = static_cast<long long>(index[off[0]]);
  slot->size = size;
  slot->op = op;
  slot->recorded = 1;
}

// The current device's slot, created (and queued for initialisation) on first use.
IndexErrorSlot* current_slot() {
  int device = 0;
  MB_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard lock(g_slots_mutex);
  SlotState& st = slot_state(device);
  if (st.slot == nullptr) {
    static const IndexErrorSlot kEmpty{kNoPosition, 0, 0, 0, 0, nullptr};
    MB_CUDA_CHECK(cudaMalloc(&st.slot, sizeof(IndexErrorSlot)));
    MB_CUDA_CHECK(cudaMemcpyAsync(st.slot, &kEmpty, sizeof(IndexErrorSlot), cudaMemcpyHostToDevice,
                                  current_stream()));
  }
  st.checked = true;
  return st.slot;
}

template <class T, class I>
__global__ void gather_kernel(T* out, const T* in, const I* index, Indexer<3> ix, std::int64_t n,
                              std::int64_t in_dim_stride, std::int64_t size) {
  for (std::int64_t i = global_thread(); i < n; i += grid_threads()) {
    std::int64_t off[3];  // out, in without dim, index
    ix.offsets(i, off);
    const std::int64_t v = index[off[2]];
    out[off[0]] = v >= 0 && v < size ? in[off[1] + v * in_dim_stride]
                                     : static_cast<T>(static_cast<compute_t<T>>(0));
  }
}

// target + w * x as the CPU's scatter_add computes it: with kWeighted, add_weighted; else
// target + x.
template <bool kWeighted, class D, class S>
__device__ __forceinline__ D add_scaled(D target, S x, compute_t<D> w) {
  using C = compute_t<D>;
  const C v = static_cast<C>(static_cast<compute_t<S>>(x));
  if constexpr (kWeighted) {
    return add_weighted(target, v, w);
  } else {
    return static_cast<D>(static_cast<C>(target) + v);
  }
}

// Thread `line` adds source line `line` into its destination line, `kChunk` positions at a time:
// the chunk's index and source values are loaded first (independent loads in flight together),
// then added in order.
template <bool kWeighted, class D, class S, class I>
__global__ void scatter_add_lines(D* dst, const S* src, const I* index, Indexer<3> ix,
                                  std::int64_t lines, std::int64_t length, std::int64_t src_step,
                                  std::int64_t index_step, std::int64_t dst_dim_stride,
                                  std::int64_t size, compute_t<D> w) {
  constexpr int kChunk = 8;
  for (std::int64_t line = global_thread(); line < lines; line += grid_threads()) {
    std::int64_t off[3];  // src, dst without dim, index
    ix.offsets(line, off);
    const S* s = src + off[0];
    D* d = dst + off[1];
    const I* x = index + off[2];
    for (std::int64_t j0 = 0; j0 < length; j0 += kChunk) {
      std::int64_t v[kChunk];
      S value[kChunk];
#pragma unroll
      for (int u = 0; u < kChunk; ++u) {
        const std::int64_t j = j0 + u;
        v[u] = j < length ? static_cast<std::int64_t>(x[j * index_step]) : -1;
        value[u] = j < length ? s[j * src_step] : S{};
      }
#pragma unroll
      for (int u = 0; u < kChunk; ++u) {
        if (v[u] < 0 || v[u] >= size) continue;
        D& target = d[v[u] * dst_dim_stride];
        target = add_scaled<kWeighted>(target, value[u], w);
      }
    }
  }
}

// Sort input for scatter_add_sorted: keys[j] = index[j] where it lies in [0, size), else size;
// positions[j] = j.
template <class I>
__global__ void sort_keys_kernel(unsigned* keys, int* positions, const I* index,
                                 std::int64_t index_step, std::int64_t n, std::int64_t size) {
  for (std::int64_t j = global_thread(); j < n; j += grid_threads()) {
    const auto v = static_cast<std::int64_t>(index[j * index_step]);
    keys[j] = static_cast<unsigned>(v >= 0 && v < size ? v : size);
    positions[j] = static_cast<int>(j);
  }
}

constexpr int kRunThreads = 128;

// Element strides of the (positions, columns) source and the (size, columns) destination.
struct RowStrides {
  std::int64_t src_row, src_col, dst_row, dst_col;
};

// Block (x, y) adds the runs of equal keys that start at sorted positions x, x + gridDim.x, ...;
// its threads take columns y * blockDim.x + threadIdx.x, ... A thread adds the run's source
// elements of its column onto the destination element in position order, rounding to D after each
// addition, as scatter_add_lines does. Runs have distinct keys, so no two threads write one
// element. Keys and positions are loaded kChunk at a time; a run ends where the key changes (keys
// are sorted, so the chunk's matches are a prefix).
template <bool kWeighted, class D, class S>
__global__ void __launch_bounds__(kRunThreads)
    scatter_add_runs(D* dst, const S* src, const unsigned* keys, const int* positions,
                     std::int64_t n, std::int64_t cols, std::int64_t size, RowStrides st,
                     compute_t<D> w) {
  constexpr int kChunk = 16;
  const std::int64_t first_col = static_cast<std::int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const std::int64_t col_step = static_cast<std::int64_t>(gridDim.y) * blockDim.x;
  for (std::int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const unsigned key = keys[i];
    if (key >= size || (i > 0 && keys[i - 1] == key)) continue;  // skipped, or inside a run
    for (std::int64_t c = first_col; c < cols; c += col_step) {
      const S* s = src + c * st.src_col;
      D* target = dst + static_cast<std::int64_t>(key) * st.dst_row + c * st.dst_col;
      D acc = *target;
      for (std::int64_t j0 = i;; j0 += kChunk) {
        unsigned k[kChunk];
        int pos[kChunk];
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          const bool inside = j0 + u < n;
          k[u] = inside ? keys[j0 + u] : key + 1;  // past the end: not in the run
          pos[u] = inside ? positions[j0 + u] : 0;
        }
        int count = 0;  // leading positions of the chunk inside the run
#pragma unroll
        for (int u = 0; u < kChunk; ++u) count += k[u] == key ? 1 : 0;
        S value[kChunk];
#pragma unroll
        for (int u = 0; u < kChunk; ++u) value[u] = u < count ? s[pos[u] * st.src_row] : S{};
#pragma unroll
        for (int u = 0; u < kChunk; ++u) {
          if (u < count) acc = add_scaled<kWeighted>(acc, value[u], w);
        }
        if (count < kChunk) break;
      }
      *target = acc;
    }
  }
}

}  // namespace

void check_index_range(const StridedView& index, std::int64_t size, std::int64_t allowed,
                       const char* op) {
  const std::int64_t n = index.numel();
  if (n == 0) return;
  IndexErrorSlot* slot = current_slot();
  const StridedView* const views[1] = {&index};
  const Indexer<1> ix = make_indexer(views);
  cudaStream_t stream = current_stream();
  dispatch_index(index.dtype, "check_index_range", [&]<class I>() {
    find_bad_index<I><<<grid_for(n, kThreads), kThreads, 0, stream>>>(slot, index.ptr<I>(), ix, n,
                                                                      size, allowed);
    MB_CUDA_CHECK_LAUNCH("find_bad_index");
    record_bad_index<I><<<1, 1, 0, stream>>>(slot, index.ptr<I>(), ix, size, op);
    MB_CUDA_CHECK_LAUNCH("record_bad_index");
  });
}

void raise_pending_index_error(int device) {
  IndexErrorSlot* slot = nullptr;
  {
    std::lock_guard lock(g_slots_mutex);
    SlotState& st = slot_state(device);
    if (st.slot == nullptr || !st.checked) return;
    st.checked = false;
    slot = st.slot;
  }
  MB_CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t stream = current_stream();
  IndexErrorSlot seen;
  MB_CUDA_CHECK(
      cudaMemcpyAsync(&seen, slot, sizeof(IndexErrorSlot), cudaMemcpyDeviceToHost, stream));
  MB_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (!seen.recorded) return;
  MB_CUDA_CHECK(cudaMemsetAsync(&slot->recorded, 0, sizeof(int), stream));
  detail::throw_error(MB_FORMAT("[{}] index {} is out of range for size {} (at position {})",
                                seen.op, seen.value, seen.size, seen.position));
}

void synchronize_checked(int device) {
  synchronize(device);
  raise_pending_index_error(device);
}

void gather(const StridedView& out, const StridedView& in, const StridedView& index, int dim) {
  MB_ASSERT(out.dtype == in.dtype && out.ndim == in.ndim && index.ndim == out.ndim,
            "gather views disagree");
  const std::int64_t n = out.numel();
  if (n == 0) return;
  StridedView in_other = in;  // the index supplies the coordinate along dim
  if (in.ndim > 0) in_other.strides[dim] = 0;
  const StridedView* const views[3] = {&out, &in_other, &index};
  const Indexer<3> ix = make_indexer(views);
  const std::int64_t in_dim_stride = in.ndim == 0 ? 0 : in.strides[dim];
  const std::int64_t size = in.ndim == 0 ? 1 : in.shape[dim];
  cudaStream_t stream = current_stream();
  dispatch_all(out.dtype, [&]<class T>() {
    dispatch_index(index.dtype, "gather", [&]<class I>() {
      gather_kernel<T, I><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
          out.ptr<T>(), in.ptr<T>(), index.ptr<I>(), ix, n, in_dim_stride, size);
    });
  });
  MB_CUDA_CHECK_LAUNCH("gather");
}

namespace {
// Calls f.template operator()<kWeighted, D, S>(w): dst += src for one dtype and weight 1 (any
// dtype, integers included), else dst += w * src for floating dst and src.
template <class F>
void dispatch_scatter(const StridedView& dst, const StridedView& src, double weight, F&& f) {
  if (dst.dtype == src.dtype && weight == 1.0) {
    dispatch_all(dst.dtype, [&]<class T>() { f.template operator()<false, T, T>(compute_t<T>(1)); });
    return;
  }
  dispatch_float(dst.dtype, "scatter_add", [&]<class D>() {
    dispatch_float(src.dtype, "scatter_add", [&]<class S>() {
      f.template operator()<true, D, S>(static_cast<compute_t<D>>(weight));
    });
  });
}
}  // namespace

void scatter_add(const StridedView& dst, const StridedView& src, const StridedView& index,
                 int dim, double weight) {
  MB_ASSERT(dst.ndim == src.ndim && index.ndim == src.ndim, "scatter_add views disagree");
  MB_ASSERT(dst.dtype == src.dtype || (is_floating(dst.dtype) && is_floating(src.dtype)),
            "scatter_add: dst {} and src {} dtypes", dtype_name(dst.dtype), dtype_name(src.dtype));
  if (src.numel() == 0) return;
  // Lines: src's shape without dim; each view keeps its strides on the other dims.
  StridedView line_src = src, line_dst = dst, line_index = index;
  for (StridedView* v : {&line_src, &line_dst, &line_index}) v->ndim = 0;
  for (int d = 0; d < src.ndim; ++d) {
    if (d == dim) continue;
    const int k = line_src.ndim;
    line_src.shape[k] = src.shape[d];
    line_src.strides[k] = src.strides[d];
    line_dst.strides[k] = dst.strides[d];
    line_index.strides[k] = index.strides[d];
    for (StridedView* v : {&line_src, &line_dst, &line_index}) ++v->ndim;
  }
  const StridedView* const views[3] = {&line_src, &line_dst, &line_index};
  const Indexer<3> ix = make_indexer(views);
  const std::int64_t lines = line_src.numel();
  const std::int64_t length = src.ndim == 0 ? 1 : src.shape[dim];
  const std::int64_t src_step = src.ndim == 0 ? 0 : src.strides[dim];
  const std::int64_t index_step = src.ndim == 0 ? 0 : index.strides[dim];
  const std::int64_t dst_dim_stride = dst.ndim == 0 ? 0 : dst.strides[dim];
  const std::int64_t size = dst.ndim == 0 ? 1 : dst.shape[dim];
  // Few lines, each long: small blocks spread them over more multiprocessors.
  constexpr int kLineThreads = 64;
  cudaStream_t stream = current_stream();
  dispatch_scatter(dst, src, weight, [&]<bool kWeighted, class D, class S>(compute_t<D> w) {
    dispatch_index(index.dtype, "scatter_add", [&]<class I>() {
      scatter_add_lines<kWeighted, D, S, I>
          <<<grid_for(lines, kLineThreads), kLineThreads, 0, stream>>>(
              dst.ptr<D>(), src.ptr<S>(), index.ptr<I>(), ix, lines, length, src_step, index_step,
              dst_dim_stride, size, w);
    });
  });
  MB_CUDA_CHECK_LAUNCH("scatter_add");
}

void scatter_add_sorted(const StridedView& dst, const StridedView& src, const StridedView& index,
                        int dim, const StridedView& workspace, double weight) {
  const std::int64_t bytes = sorted_scatter_workspace_bytes(dst, src, index, dim);
  MB_ASSERT(bytes > 0 && (dst.dtype == src.dtype || (is_floating(dst.dtype) && is_floating(src.dtype))),
            "scatter_add_sorted does not apply to these views");
  MB_ASSERT(workspace.is_contiguous() &&
                workspace.numel() * static_cast<std::int64_t>(dtype_size(workspace.dtype)) >= bytes,
            "scatter_add_sorted: a workspace of {} elements is below {} bytes", workspace.numel(),
            bytes);
  const std::int64_t n = src.shape[0], cols = src.shape[1], size = dst.shape[0];
  const SortedScatterLayout layout = sorted_scatter_layout(n);
  char* base = static_cast<char*>(workspace.data);
  cub::DoubleBuffer<unsigned> keys(reinterpret_cast<unsigned*>(base + layout.keys[0]),
                                   reinterpret_cast<unsigned*>(base + layout.keys[1]));
  cub::DoubleBuffer<int> positions(reinterpret_cast<int*>(base + layout.positions[0]),
                                   reinterpret_cast<int*>(base + layout.positions[1]));
  const int end_bit = std::bit_width(static_cast<std::uint64_t>(size));  // keys in [0, size]
  cudaStream_t stream = current_stream();
  std::size_t sort_bytes = 0;
  MB_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys, positions,
                                                static_cast<int>(n), 0, end_bit, stream));
  if (sort_bytes > static_cast<std::size_t>(layout.sort_bytes)) {
    scatter_add(dst, src, index, dim, weight);  // the bound fell short: the same bits, unsorted
    return;
  }
  dispatch_index(index.dtype, "scatter_add", [&]<class I>() {
    sort_keys_kernel<I><<<grid_for(n, kThreads), kThreads, 0, stream>>>(
        keys.Current(), positions.Current(), index.ptr<I>(), index.strides[0], n, size);
  });
  MB_CUDA_CHECK_LAUNCH("sort_keys_kernel");
  MB_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + layout.sort, sort_bytes, keys, positions,
                                                static_cast<int>(n), 0, end_bit, stream));
  // About 8192 blocks: each checks a few sorted positions for the start of a run.
  const auto col_blocks =
      static_cast<unsigned>(std::min<std::int64_t>(ceil_div(cols, kRunThreads), 65535));
  const auto run_blocks = static_cast<unsigned>(
      std::min<std::int64_t>(n, std::max<std::int64_t>(1, 8192 / col_blocks)));
  const RowStrides st{src.strides[0], src.strides[1], dst.strides[0], dst.strides[1]};
  dispatch_scatter(dst, src, weight, [&]<bool kWeighted, class D, class S>(compute_t<D> w) {
    scatter_add_runs<kWeighted, D, S><<<dim3(run_blocks, col_blocks), kRunThreads, 0, stream>>>(
        dst.ptr<D>(), src.ptr<S>(), keys.Current(), positions.Current(), n, cols, size, st, w);
  });
  MB_CUDA_CHECK_LAUNCH("scatter_add_runs");
}

}  // namespace microbatch::kernels::cuda
