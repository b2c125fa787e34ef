// Indexing ops: embedding, gather and index_select. Each forward is one gather kernel (index_select
// and embedding broadcast their 1-D index over the other dims with stride 0); each backward writes
// a fresh gradient (overwrites) by scatter-adding the incoming gradient into zeros of the input's
// shape, so repeated indices accumulate. Index values are checked before any write.
#include <cstdint>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/ops/dispatch.h"
#include "kernels/index.h"

namespace microbatch {

namespace {

void check_index_dtype(const char* op, const Tensor& index) {
  MB_CHECK(index.defined(), "[{}] index is undefined", op);
  MB_CHECK(index.dtype() == DType::i32 || index.dtype() == DType::i64,
           "[{}] index must be i32 or i64, got {}", op, dtype_name(index.dtype()));
}

// Throws, naming the op, the first bad value, its position and the valid range, when an index
// leaves [0, size). On CUDA the check is recorded on the device and raised at the next
// synchronisation (Note [Deferred index errors] in kernels/index.h). Meta tensors hold no values
// and pass.
void check_in_range(const char* op, const Tensor& index, std::int64_t size, int dim) {
  kernels::IndexRangeError err;
  launch(
      op, index.device(), [&] { err = kernels::cpu::first_out_of_range(index.kview(), size); },
      [&] { kernels::cuda::check_index_range(index.kview(), size, INT64_MIN, op); });
  MB_CHECK(err.position < 0,
           "[{}] index {} is out of range for dim {} of size {} (valid range [0, {})), at position "
           "{} of the index",
           op, err.value, dim, size, size, err.position);
}

// A 1-D index (n) seen as a tensor of `shape` (shape[dim] == n) whose other dims broadcast.
kernels::StridedView broadcast_index(const Tensor& index, const Shape& shape, int dim) {
  kernels::StridedView v = index.kview();
  v.ndim = static_cast<int>(shape.size());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = shape[i];
    v.strides[i] = i == dim ? index.strides()[0] : 0;
  }
  return v;
}

// gather's kernel into a fresh tensor of `shape`; index is a view of that shape.
Tensor gather_kernel(const char* op, const Tensor& a, const Shape& shape,
                     const kernels::StridedView& index, int dim) {
  Tensor out = empty(shape, {.dtype = a.dtype(), .device = a.device()});
  launch(
      op, a.device(), [&] { kernels::cpu::gather(out.kview(), a.kview(), index, dim); },
      [&] { kernels::cuda::gather(out.kview(), a.kview(), index, dim); });
  return out;
}

// dst += weight * g scattered along dim, in place. On CUDA an embedding-like scatter sorts its
// indices first (Note [Sorted scatter_add] in kernels/index.h), in a workspace allocated here so
// that meta mirrors it.
void scatter_add_into(const char* op, const Tensor& dst, const Tensor& g,
                      const kernels::StridedView& index, int dim, double weight = 1.0) {
  const std::int64_t sort_bytes =
      backend_of(g.device()) == Backend::cuda
          ? kernels::sorted_scatter_workspace_bytes(dst.kview(), g.kview(), index, dim)
          : 0;
  if (sort_bytes > 0) {
    Tensor workspace = empty({sort_bytes}, {.dtype = DType::u8, .device = g.device()});
    launch(
        op, g.device(), [&] { MB_ASSERT(false, "[{}] the sorted scatter runs on CUDA only", op); },
        [&] {
          kernels::cuda::scatter_add_sorted(dst.kview(), g.kview(), index, dim, workspace.kview(),
                                            weight);
        });
    return;
  }
  launch(
      op, g.device(), [&] { kernels::cpu::scatter_add(dst.kview(), g.kview(), index, dim, weight); },
      [&] { kernels::cuda::scatter_add(dst.kview(), g.kview(), index, dim, weight); });
}

// The backward of a gather: zeros of the input's shape with g scatter-added along dim.
Tensor scatter_add_kernel(const char* op, const Shape& input_shape, DType dtype, Tensor g,
                          const kernels::StridedView& index, int dim) {
  if (g.dtype() != dtype) g = g.to(dtype);
  Tensor dx = zeros(input_shape, {.dtype = dtype, .device = g.device()});
  scatter_add_into(op, dx, g, index, dim);
  return dx;
}

// Note [Embedding gradients in place]: as linear's weight-gradient GEMM (Note [Weight-gradient
// GEMM] in core/ops/linalg.cpp), embedding's backward adds its rows straight into the weight's
// gradient buffer (a slot of the f32 gradient arena) as grad[index[i]] += w * g[i], in position
// order, instead of scatter-adding into a dense (V, C) temporary of the weight's dtype that
// AccumulateGrad then adds into the slot. For a 16-bit model that is a 16-bit sum per row, rounded
// after every addition, turned into an f32 sum rounded once per addition; and GPT-2's (50257, 768)
// temporary (zero-filled, then read by the accumulation) is not made. Where the weight does not
// accumulate in place (grad() capturing it, no buffer yet) it returns the dense gradient as before.

}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  MB_CHECK(weight.dim() == 2, "[embedding] weight must be (V, C), got shape {}",
           shape_str(weight.shape()));
  check_index_dtype("embedding", indices);
  check_same_device("embedding", {weight, indices});
  const std::int64_t vocab = weight.shape()[0], channels = weight.shape()[1];
  Tensor flat = indices.reshape({-1});  // (N)
  check_in_range("embedding", flat, vocab, 0);

  Shape out_shape = indices.shape();
  out_shape.push_back(channels);
  Tensor out = empty(out_shape, {.dtype = weight.dtype(), .device = weight.device()});  // (*, C)
  const Shape rows{flat.numel(), channels};
  kernels::StridedView out_rows = out.kview();  // (N, C), contiguous
  out_rows.ndim = 2;
  out_rows.shape[0] = rows[0];
  out_rows.shape[1] = rows[1];
  out_rows.strides[0] = channels;
  out_rows.strides[1] = 1;
  const kernels::StridedView index_rows = broadcast_index(flat, rows, 0);
  launch(
      "embedding", weight.device(),
      [&] { kernels::cpu::gather(out_rows, weight.kview(), index_rows, 0); },
      [&] { kernels::cuda::gather(out_rows, weight.kview(), index_rows, 0); });

  record("embedding", {weight}, out,
         [si = SavedTensor(flat, "embedding"), wl = grad_leaf(weight), weight_shape = weight.shape(),
          rows, dtype = weight.dtype()](const Tensor& g) {
           Tensor idx = si.get();
           const kernels::StridedView index = broadcast_index(idx, rows, 0);
           if (Tensor grad = in_place_grad(wl); grad.defined()) {
             scatter_add_into("embedding", grad, g.reshape(rows), index, 0, grad_weight());
             grad.bump_version();
             return std::vector<Tensor>{Tensor()};
           }
           return std::vector<Tensor>{
               scatter_add_kernel("embedding", weight_shape, dtype, g.reshape(rows), index, 0)};
         });
  return out;
}

Tensor gather(const Tensor& a, std::int64_t dim, const Tensor& index) {
  check_index_dtype("gather", index);
  check_same_device("gather", {a, index});
  const int d = wrap_dim(dim, a.dim(), "gather");
  MB_CHECK(index.dim() == a.dim(),
           "[gather] index has {} dims but the input has {} (shapes {} and {})", index.dim(),
           a.dim(), shape_str(index.shape()), shape_str(a.shape()));
  for (int i = 0; i < a.dim(); ++i) {
    MB_CHECK(i == d || index.shape()[i] <= a.shape()[i],
             "[gather] index shape {} exceeds input shape {} in dim {}", shape_str(index.shape()),
             shape_str(a.shape()), i);
  }
  const std::int64_t size = a.dim() == 0 ? 1 : a.shape()[d];
  check_in_range("gather", index, size, d);

  Tensor out = gather_kernel("gather", a, index.shape(), index.kview(), d);
  record("gather", {a}, out,
         [si = SavedTensor(index, "gather"), from = a.shape(), dtype = a.dtype(),
          d](const Tensor& g) {
           Tensor idx = si.get();
           return std::vector<Tensor>{scatter_add_kernel("gather", from, dtype, g, idx.kview(), d)};
         });
  return out;
}

Tensor index_select(const Tensor& a, std::int64_t dim, const Tensor& index) {
  check_index_dtype("index_select", index);
  check_same_device("index_select", {a, index});
  MB_CHECK(a.dim() >= 1, "[index_select] the input must have at least one dim, got shape {}",
           shape_str(a.shape()));
  const int d = wrap_dim(dim, a.dim(), "index_select");
  MB_CHECK(index.dim() == 1, "[index_select] index must be 1-D, got shape {}",
           shape_str(index.shape()));
  check_in_range("index_select", index, a.shape()[d], d);

  Shape out_shape = a.shape();
  out_shape[d] = index.shape()[0];
  Tensor out = gather_kernel("index_select", a, out_shape, broadcast_index(index, out_shape, d), d);
  record("index_select", {a}, out,
         [si = SavedTensor(index, "index_select"), from = a.shape(), out_shape, dtype = a.dtype(),
          d](const Tensor& g) {
           Tensor idx = si.get();
           return std::vector<Tensor>{scatter_add_kernel("index_select", from, dtype, g,
                                                         broadcast_index(idx, out_shape, d), d)};
         });
  return out;
}

}  // namespace microbatch
