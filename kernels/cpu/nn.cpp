// CPU row kernels for softmax / log-softmax, fused cross-entropy and layer norm (see kernels/nn.h).
// Each row is reduced with its max subtracted first, so exp never overflows for finite input.
// Rows are processed in chunks of kChunk elements with Eigen arrays (vectorized exp and sums) in
// compute_t<T> (f32 for 16-bit storage, which is widened chunk by chunk; f64 for f64); a chunk's
// sum runs in that type, and the chunk sums of a row add up in f64.
// All outputs are overwritten, the backward ones included, except layer norm's parameter
// gradients, which are added into their buffers.
#include "kernels/nn.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/chunks.h"

namespace microbatch::kernels::cpu {

namespace {

using namespace chunks;

// log(sum(exp(row))) as max + log(sum(exp(row - max))). The two parts are kept apart so that
// x - lse is formed as (x - max) - log_sum: adding log_sum to a large max first would round it.
// A NaN anywhere makes the sum, and so every result of the row, NaN.
template <class C>
struct LogSumExp {
  C max;
  C log_sum;
};

template <class T>
compute_t<T> row_max(const T* row, std::int64_t cols) {
  using C = compute_t<T>;
  C buf[kChunk];
  C m = -std::numeric_limits<C>::infinity();
  for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
    m = std::max(m, load(row + j0, len, buf).maxCoeff());
  });
  return m;
}

template <class T>
LogSumExp<compute_t<T>> row_logsumexp(const T* row, std::int64_t cols) {
  using C = compute_t<T>;
  C buf[kChunk];
  const C m = row_max(row, cols);
  double acc = 0.0;
  for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
    acc += static_cast<double>((load(row + j0, len, buf) - m).exp().sum());
  });
  return {m, static_cast<C>(std::log(acc))};
}

// sum(row - shift) in f64, chunk sums in the math type. A shift near the row's values (its first
// element, its max) keeps the chunk sums small, so f32 chunks of values near 1e4 stay exact enough.
template <class T>
double row_sum(const T* row, std::int64_t cols, compute_t<T> shift = 0) {
  compute_t<T> buf[kChunk];
  double acc = 0.0;
  for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
    acc += static_cast<double>((load(row + j0, len, buf) - shift).sum());
  });
  return acc;
}

std::int64_t row_count(const StridedView& v, std::int64_t cols) {
  return cols > 0 ? v.numel() / cols : 0;
}

template <class I>
std::int64_t target_at(const StridedView& target, std::int64_t i) {
  return static_cast<std::int64_t>(target.ptr<I>()[i * target.strides[0]]);
}

}  // namespace

void softmax_forward(SoftmaxKind kind, const StridedView& out, const StridedView& in,
                     std::int64_t cols) {
  MB_ASSERT(in.is_contiguous() && out.is_contiguous(), "softmax rows must be contiguous");
  const std::int64_t rows = row_count(in, cols);
  dispatch_float(in.dtype, "softmax", [&]<class T>() {
    using C = compute_t<T>;
    C buf[kChunk];
    for (std::int64_t i = 0; i < rows; ++i) {
      const T* x = in.ptr<T>() + i * cols;
      T* y = out.ptr<T>() + i * cols;
      if (kind == SoftmaxKind::LogSoftmax) {
        const LogSumExp<C> l = row_logsumexp(x, cols);
        for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
          store(y + j0, (load(x + j0, len, buf) - l.max) - l.log_sum);
        });
        continue;
      }
      const C m = row_max(x, cols);
      double acc = 0.0;
      if constexpr (kWide<T>) {
        // Full-precision storage: keep the exponentials in y and scale them in place.
        for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
          Chunk<C> e(y + j0, len);
          e = (ConstChunk<C>(x + j0, len) - m).exp();
          acc += static_cast<double>(e.sum());
        });
        Chunk<C>(y, cols) *= static_cast<C>(1.0 / acc);
      } else {
        // 16-bit storage would round the exponentials before the division: recompute them instead.
        for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
          acc += static_cast<double>((load(x + j0, len, buf) - m).exp().sum());
        });
        const C inv = static_cast<C>(1.0 / acc);
        for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
          store(y + j0, (load(x + j0, len, buf) - m).exp() * inv);
        });
      }
    }
  });
}

void softmax_backward(SoftmaxKind kind, const StridedView& dx, const StridedView& y,
                      const StridedView& dy, std::int64_t cols) {
  MB_ASSERT(dx.is_contiguous() && y.is_contiguous() && dy.is_contiguous(),
            "softmax backward rows must be contiguous");
  const std::int64_t rows = row_count(y, cols);
  dispatch_float(y.dtype, "softmax", [&]<class T>() {
    using C = compute_t<T>;
    C by[kChunk], bg[kChunk];
    for (std::int64_t i = 0; i < rows; ++i) {
      const T* yr = y.ptr<T>() + i * cols;
      const T* gr = dy.ptr<T>() + i * cols;
      T* out = dx.ptr<T>() + i * cols;
      double acc = 0.0;
      if (kind == SoftmaxKind::Softmax) {
        for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
          acc += static_cast<double>((load(gr + j0, len, bg) * load(yr + j0, len, by)).sum());
        });
        const C s = static_cast<C>(acc);
        for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
          store(out + j0, load(yr + j0, len, by) * (load(gr + j0, len, bg) - s));
        });
      } else {
        const C s = static_cast<C>(row_sum(gr, cols));
        for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
          store(out + j0, load(gr + j0, len, bg) - load(yr + j0, len, by).exp() * s);
        });
      }
    }
  });
}

void cross_entropy_forward(const StridedView& loss, const StridedView& stats,
                           const StridedView& logits, const StridedView& target,
                           CrossEntropyArgs args) {
  MB_ASSERT(logits.is_contiguous() && logits.ndim == 2 && stats.is_contiguous(),
            "cross_entropy logits must be contiguous (N, C), stats (N, 2)");
  const std::int64_t n = logits.shape[0], cols = logits.shape[1];
  const double s = args.label_smoothing;
  dispatch_float(logits.dtype, "cross_entropy", [&]<class T>() {
    using C = compute_t<T>;
    dispatch_index(target.dtype, "cross_entropy", [&]<class I>() {
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t t = target_at<I>(target, i);
        C& li = loss.ptr<C>()[i * loss.strides[0]];
        C* st = stats.ptr<C>() + 2 * i;
        if (t == args.ignore_index) {
          li = st[0] = st[1] = C(0);
          continue;
        }
        MB_CHECK(
            t >= 0 && t < cols,
            "[cross_entropy] target {} (row {}) is out of range for {} classes: expected 0..{} "
            "or ignore_index {}",
            t, i, cols, cols - 1, args.ignore_index);
        const T* x = logits.ptr<T>() + i * cols;
        const LogSumExp<C> l = row_logsumexp(x, cols);
        st[0] = l.max;
        st[1] = l.log_sum;
        const double max = static_cast<double>(l.max), log_sum = static_cast<double>(l.log_sum);
        double value = (max - static_cast<double>(static_cast<C>(x[t]))) + log_sum;  // -log p[t]
        if (s > 0.0) {
          // mean_c(-log p) = log_sum - (mean(x) - max)
          const double mean_below_max = row_sum(x, cols, l.max) / static_cast<double>(cols);
          value = (1.0 - s) * value + s * (log_sum - mean_below_max);
        }
        li = static_cast<C>(value);
      }
    });
  });
}

void cross_entropy_backward(const StridedView& dlogits, const StridedView& logits,
                            const StridedView& stats, const StridedView& target,
                            const StridedView& g, CrossEntropyArgs args) {
  MB_ASSERT(logits.is_contiguous() && dlogits.is_contiguous() && logits.ndim == 2,
            "cross_entropy logits and dlogits must be contiguous (N, C)");
  const std::int64_t n = logits.shape[0], cols = logits.shape[1];
  const double s = args.label_smoothing;
  dispatch_float(logits.dtype, "cross_entropy", [&]<class T>() {
    using C = compute_t<T>;
    C buf[kChunk];
    // The smoothed target is off = s / C on every class, plus on = 1 - s on the label.
    const C off = static_cast<C>(s / static_cast<double>(cols));
    const C on = static_cast<C>(1.0 - s);
    dispatch_index(target.dtype, "cross_entropy", [&]<class I>() {
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t t = target_at<I>(target, i);
        T* d = dlogits.ptr<T>() + i * cols;
        if (t == args.ignore_index) {
          std::fill(d, d + cols, static_cast<T>(C(0)));
          continue;
        }
        MB_ASSERT(t >= 0 && t < cols,
                  "cross_entropy target {} (row {}) out of range for {} classes after the "
                  "forward's check",
                  t, i, cols);
        const T* x = logits.ptr<T>() + i * cols;
        const C max = stats.ptr<C>()[2 * i], log_sum = stats.ptr<C>()[2 * i + 1];
        const C gi = g.ptr<C>()[i * g.strides[0]];
        // The label's entry from its logit, so that 16-bit storage rounds it only once; read first,
        // as d may be x (Note [Reusing an input's memory], core/autograd.h).
        const C p_t = std::exp((static_cast<C>(x[t]) - max) - log_sum);
        for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
          store(d + j0, gi * (((load(x + j0, len, buf) - max) - log_sum).exp() - off));
        });
        d[t] = static_cast<T>(gi * (p_t - off - on));
      }
    });
  });
}

void layer_norm_forward(const StridedView& y, const StridedView& mean, const StridedView& rstd,
                        const StridedView& x, const StridedView& weight, const StridedView& bias,
                        double eps) {
  MB_ASSERT(x.is_contiguous() && y.is_contiguous(), "layer_norm rows must be contiguous");
  const std::int64_t rows = mean.numel();
  const std::int64_t cols = rows > 0 ? x.numel() / rows : 0;
  dispatch_float(x.dtype, "layer_norm", [&]<class T>() {
    using C = compute_t<T>;
    C bx[kChunk], bw[kChunk], bb[kChunk];
    const T* w = weight.data ? weight.ptr<T>() : nullptr;
    const T* b = bias.data ? bias.ptr<T>() : nullptr;
    for (std::int64_t i = 0; i < rows; ++i) {
      const T* xr = x.ptr<T>() + i * cols;
      T* yr = y.ptr<T>() + i * cols;
      // The mean in two parts, hi + lo: x - hi is exact for x near the mean, so values far from
      // zero (1e4 + noise) keep their precision. Two passes: no cancellation in the variance.
      const C x0 = cols > 0 ? static_cast<C>(xr[0]) : C(0);
      const double mu = static_cast<double>(x0) + row_sum(xr, cols, x0) / static_cast<double>(cols);
      const C hi = static_cast<C>(mu), lo = static_cast<C>(mu - static_cast<double>(hi));
      double sq = 0.0;
      for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
        sq += static_cast<double>(((load(xr + j0, len, bx) - hi) - lo).square().sum());
      });
      const C r = static_cast<C>(1.0 / std::sqrt(sq / static_cast<double>(cols) + eps));
      mean.ptr<C>()[i] = hi;
      rstd.ptr<C>()[i] = r;
      for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
        ChunkValue<C> v = ((load(xr + j0, len, bx) - hi) - lo) * r;
        if (w) v *= load(w + j0, len, bw);
        if (b) v += load(b + j0, len, bb);
        store(yr + j0, v);
      });
    }
  });
}

void layer_norm_backward(const StridedView& dx, const StridedView& dweight,
                         const StridedView& dbias, const StridedView& dy, const StridedView& x,
                         const StridedView& mean, const StridedView& rstd,
                         const StridedView& weight, double grad_weight) {
  MB_ASSERT(x.is_contiguous() && dy.is_contiguous() && (!dx.data || dx.is_contiguous()),
            "layer_norm backward rows must be contiguous");
  const std::int64_t rows = mean.numel();
  const std::int64_t cols = rows > 0 ? x.numel() / rows : 0;
  dispatch_float(x.dtype, "layer_norm", [&]<class T>() {
    using C = compute_t<T>;
    C bx[kChunk], bg[kChunk], bw[kChunk];
    const T* w = weight.data ? weight.ptr<T>() : nullptr;
    // The sums over rows, added into dweight / dbias at the end.
    std::vector<C> sum_w(dweight.data ? static_cast<std::size_t>(cols) : 0);
    std::vector<C> sum_b(dbias.data ? static_cast<std::size_t>(cols) : 0);
    C* dw = dweight.data ? sum_w.data() : nullptr;
    C* db = dbias.data ? sum_b.data() : nullptr;
    const double inv_cols = 1.0 / static_cast<double>(cols);
    for (std::int64_t i = 0; i < rows; ++i) {
      const T* xr = x.ptr<T>() + i * cols;
      const T* gr = dy.ptr<T>() + i * cols;
      T* out = dx.data ? dx.ptr<T>() + i * cols : nullptr;
      const C m = mean.ptr<C>()[i], r = rstd.ptr<C>()[i];
      // xhat and dy * weight for one chunk.
      auto terms = [&](std::int64_t j0, std::int64_t len, ChunkValue<C>& xhat, ChunkValue<C>& wdy) {
        xhat = (load(xr + j0, len, bx) - m) * r;
        wdy = load(gr + j0, len, bg);
        if (w) wdy *= load(w + j0, len, bw);
      };
      ChunkValue<C> xhat, wdy;
      double sum_wdy = 0.0, sum_wdy_xhat = 0.0;
      for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
        terms(j0, len, xhat, wdy);
        sum_wdy += static_cast<double>(wdy.sum());
        sum_wdy_xhat += static_cast<double>((wdy * xhat).sum());
        if (dw) Chunk<C>(dw + j0, len) += load(gr + j0, len, bg) * xhat;
        if (db) Chunk<C>(db + j0, len) += load(gr + j0, len, bg);
      });
      if (!out) continue;
      const C a = static_cast<C>(sum_wdy * inv_cols), b = static_cast<C>(sum_wdy_xhat * inv_cols);
      for_chunks(cols, [&](std::int64_t j0, std::int64_t len) {
        terms(j0, len, xhat, wdy);
        store(out + j0, r * (wdy - a - xhat * b));
      });
    }
    const C gw = static_cast<C>(grad_weight);
    auto add_into = [&](const StridedView& slot, const C* sums) {
      if (!sums) return;
      C* d = slot.ptr<C>();
      for (std::int64_t j = 0; j < cols; ++j) d[j] = d[j] + gw * sums[j];
    };
    add_into(dweight, dw);
    add_into(dbias, db);
  });
}

}  // namespace microbatch::kernels::cpu
