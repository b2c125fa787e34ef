// Indexing loops over strided views: gather overwrites its output, scatter_add accumulates into
// dst one source element at a time in row-major order (never in parallel), so that repeated
// indices (an embedding row used twice) sum in the same order on every run.
#include "kernels/index.h"

namespace microbatch::kernels::cpu {

namespace {

// Calls f(off) for every coordinate of `shape` in row-major order; off[k] is the element offset
// of that coordinate in a view with strides strides[k].
template <int N, class F>
void walk(const StridedView& shape, const std::int64_t* const (&strides)[N], F&& f) {
  if (shape.numel() == 0) return;
  std::int64_t off[N] = {};
  const int nd = shape.ndim;
  if (nd == 0) {
    f(off);
    return;
  }
  std::int64_t coord[kMaxDims] = {};
  const std::int64_t inner = shape.shape[nd - 1];
  while (true) {
    std::int64_t base[N];
    for (int k = 0; k < N; ++k) base[k] = off[k];
    for (std::int64_t j = 0; j < inner; ++j) {
      f(off);
      for (int k = 0; k < N; ++k) off[k] += strides[k][nd - 1];
    }
    for (int k = 0; k < N; ++k) off[k] = base[k];
    int d = nd - 2;
    for (; d >= 0; --d) {  // advance the outer counter
      ++coord[d];
      for (int k = 0; k < N; ++k) off[k] += strides[k][d];
      if (coord[d] < shape.shape[d]) break;
      for (int k = 0; k < N; ++k) off[k] -= strides[k][d] * shape.shape[d];
      coord[d] = 0;
    }
    if (d < 0) return;
  }
}

// The strides of `v` with the one along `dim` zeroed: the index supplies that coordinate.
struct Strides {
  std::int64_t s[kMaxDims] = {};
};
Strides without_dim(const StridedView& v, int dim) {
  Strides out;
  for (int i = 0; i < v.ndim; ++i) out.s[i] = i == dim ? 0 : v.strides[i];
  return out;
}

}  // namespace

IndexRangeError first_out_of_range(const StridedView& index, std::int64_t size) {
  IndexRangeError err;
  std::int64_t position = 0;
  dispatch_index(index.dtype, "first_out_of_range", [&]<class I>() {
    const I* p = index.ptr<I>();
    const std::int64_t* const strides[1] = {index.strides};
    walk<1>(index, strides, [&](const std::int64_t* off) {
      const std::int64_t v = p[off[0]];
      if (err.position < 0 && (v < 0 || v >= size)) err = {position, v};
      ++position;
    });
  });
  return err;
}

void gather(const StridedView& out, const StridedView& in, const StridedView& index, int dim) {
  MB_ASSERT(out.dtype == in.dtype && out.ndim == in.ndim && index.ndim == out.ndim,
            "gather views disagree");
  const Strides in_other = without_dim(in, dim);
  const std::int64_t in_dim_stride = in.ndim == 0 ? 0 : in.strides[dim];
  dispatch_all(out.dtype, [&]<class T>() {
    T* o = out.ptr<T>();
    const T* x = in.ptr<T>();
    dispatch_index(index.dtype, "gather", [&]<class I>() {
      const I* idx = index.ptr<I>();
      const std::int64_t* const strides[3] = {out.strides, in_other.s, index.strides};
      walk<3>(out, strides, [&](const std::int64_t* off) {
        o[off[0]] = x[off[1] + static_cast<std::int64_t>(idx[off[2]]) * in_dim_stride];
      });
    });
  });
}

void scatter_add(const StridedView& dst, const StridedView& src, const StridedView& index,
                 int dim, double weight) {
  MB_ASSERT(dst.ndim == src.ndim && index.ndim == src.ndim, "scatter_add views disagree");
  MB_ASSERT(dst.dtype == src.dtype || (is_floating(dst.dtype) && is_floating(src.dtype)),
            "scatter_add: dst {} and src {} dtypes", dtype_name(dst.dtype), dtype_name(src.dtype));
  const Strides dst_other = without_dim(dst, dim);
  const std::int64_t dst_dim_stride = dst.ndim == 0 ? 0 : dst.strides[dim];
  const std::int64_t* const strides[3] = {src.strides, dst_other.s, index.strides};
  // Walks src in row-major order, target = add(target, source) at each index.
  auto scatter = [&]<class D, class S>(auto add) {
    D* d = dst.ptr<D>();
    const S* s = src.ptr<S>();
    dispatch_index(index.dtype, "scatter_add", [&]<class I>() {
      const I* idx = index.ptr<I>();
      walk<3>(src, strides, [&](const std::int64_t* off) {
        D& target = d[off[1] + static_cast<std::int64_t>(idx[off[2]]) * dst_dim_stride];
        target = add(target, s[off[0]]);
      });
    });
  };
  if (dst.dtype == src.dtype && weight == 1.0) {
    dispatch_all(dst.dtype, [&]<class T>() {
      using C = compute_t<T>;
      scatter.template operator()<T, T>(
          [](T t, T x) { return static_cast<T>(static_cast<C>(t) + static_cast<C>(x)); });
    });
    return;
  }
  // dst += weight * src, the product rounded, then the sum, as accumulate does.
  dispatch_float(dst.dtype, "scatter_add", [&]<class D>() {
    dispatch_float(src.dtype, "scatter_add", [&]<class S>() {
      using C = compute_t<D>;
      const C w = static_cast<C>(weight);
      scatter.template operator()<D, S>([w](D t, S x) {
        const C product = w * static_cast<C>(static_cast<compute_t<S>>(x));
        return static_cast<D>(static_cast<C>(t) + product);
      });
    });
  });
}

}  // namespace microbatch::kernels::cpu
