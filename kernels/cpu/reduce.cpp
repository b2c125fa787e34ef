// Row reductions on contiguous input. Sums accumulate in f64 so that results do not depend on how
// a batch was split (Note [Exact accumulation] relies on sums being this accurate).
#include <cmath>
#include <type_traits>
#include <vector>

#include "kernels/reduce.h"

namespace microbatch::kernels::cpu {

void reduce_rows(ReduceOp op, const StridedView& out, const StridedView& in, std::int64_t inner) {
  const std::int64_t outer = inner == 0 ? out.numel() : in.numel() / inner;
  dispatch_all(in.dtype, [&]<class T>() {
    using C = compute_t<T>;
    const T* x = in.ptr<T>();
    for (std::int64_t i = 0; i < outer; ++i) {
      const T* row = x + i * inner;
      switch (op) {
        case ReduceOp::Sum: {
          if constexpr (std::is_integral_v<T>) {  // exact, into i64 (as torch.sum)
            std::int64_t acc = 0;
            for (std::int64_t j = 0; j < inner; ++j) acc += static_cast<std::int64_t>(row[j]);
            out.ptr<std::int64_t>()[i] = acc;
          } else {
            double acc = 0.0;
            for (std::int64_t j = 0; j < inner; ++j) acc += static_cast<double>(static_cast<C>(row[j]));
            out.ptr<T>()[i] = static_cast<T>(static_cast<C>(acc));
          }
          break;
        }
        case ReduceOp::Max:
        case ReduceOp::ArgMax: {
          std::int64_t best = 0;
          C best_value = inner > 0 ? static_cast<C>(row[0]) : C(0);
          for (std::int64_t j = 1; j < inner; ++j) {
            const C v = static_cast<C>(row[j]);
            if (best_value != best_value) break;  // NaN wins and stays
            if (v > best_value || v != v) {
              best_value = v;
              best = j;
            }
          }
          if (op == ReduceOp::Max) out.ptr<T>()[i] = static_cast<T>(best_value);
          else out.ptr<std::int64_t>()[i] = best;
          break;
        }
      }
    }
  });
}

void add_column_sums(const StridedView& dst, const StridedView& in, double weight) {
  MB_ASSERT(in.ndim == 2 && dst.is_contiguous() && dst.numel() == in.shape[1],
            "add_column_sums: a ({}) destination for {}-d input of {} elements", dst.numel(),
            in.ndim, in.numel());
  const std::int64_t rows = in.shape[0], cols = in.shape[1];
  const std::int64_t row_stride = in.strides[0], col_stride = in.strides[1];
  dispatch_float(in.dtype, "add_column_sums", [&]<class T>() {
    dispatch_float(dst.dtype, "add_column_sums", [&]<class D>() {
      using C = compute_t<D>;
      std::vector<double> acc(static_cast<std::size_t>(cols), 0.0);
      for (std::int64_t r = 0; r < rows; ++r) {  // row order, as reduce_rows sums a column
        const T* x = in.ptr<T>() + r * row_stride;
        for (std::int64_t c = 0; c < cols; ++c) {
          const T v = x[c * col_stride];
          acc[static_cast<std::size_t>(c)] += static_cast<double>(static_cast<compute_t<T>>(v));
        }
      }
      D* d = dst.ptr<D>();
      const C w = static_cast<C>(weight);
      for (std::int64_t c = 0; c < cols; ++c) {
        const C sum = static_cast<C>(acc[static_cast<std::size_t>(c)]);
        d[c] = static_cast<D>(static_cast<C>(d[c]) + w * sum);
      }
    });
  });
}

}  // namespace microbatch::kernels::cpu
