// Optimizer kernels on CPU: one loop over the whole arena each.
#include <cmath>

#include "kernels/optim.h"

namespace microbatch::kernels::cpu {

namespace {
// Writes the rounded working copy of element i (no-op without one).
template <class C>
void write_work(const StridedView& work, std::int64_t i, C value) {
  if (work.data == nullptr) return;
  if (work.dtype == DType::f16) work.ptr<f16>()[i] = f16(static_cast<float>(value));
  else if (work.dtype == DType::bf16) work.ptr<bf16>()[i] = bf16(static_cast<float>(value));
  else if (work.dtype == DType::f32) work.ptr<float>()[i] = static_cast<float>(value);
}
}  // namespace

void adamw(const StridedView& params, const StridedView& grads, const StridedView& exp_avg,
           const StridedView& exp_avg_sq, const AdamWArgs& a, const StridedView& work) {
  dispatch_float(params.dtype, "adamw", [&]<class P>() {
    dispatch_float(grads.dtype, "adamw", [&]<class G>() {
      using C = std::conditional_t<std::is_same_v<P, double>, double, float>;
      P* p = params.ptr<P>();
      const G* g = grads.ptr<G>();
      C* m = exp_avg.ptr<C>();
      C* v = exp_avg_sq.ptr<C>();
      const C lr = static_cast<C>(a.lr), b1 = static_cast<C>(a.beta1), b2 = static_cast<C>(a.beta2);
      const C eps = static_cast<C>(a.eps), scale = static_cast<C>(a.grad_scale);
      // 1 - beta in double, then rounded, as torch's alpha = 1 - beta1 and value = 1 - beta2 (a
      // 1 - beta2 of f32 operands is 0.00099998713 for 0.999, and biases every v by 1.3e-5).
      const C one_minus_b1 = static_cast<C>(1.0 - a.beta1), one_minus_b2 = static_cast<C>(1.0 - a.beta2);
      const C decay = static_cast<C>(1.0 - a.lr * a.weight_decay);
      const double bias1 = 1.0 - std::pow(a.beta1, static_cast<double>(a.step));
      const double bias2 = 1.0 - std::pow(a.beta2, static_cast<double>(a.step));
      const C step_size = static_cast<C>(a.lr / bias1);
      const C bias2_sqrt = static_cast<C>(std::sqrt(bias2));
      (void)lr;
      const std::int64_t n = params.numel();
      for (std::int64_t i = 0; i < n; ++i) {
        const C grad = static_cast<C>(static_cast<compute_t<G>>(g[i])) * scale;
        C w = static_cast<C>(static_cast<compute_t<P>>(p[i]));
        if (i < a.decay_end) w *= decay;  // decoupled decay first, as torch.optim.AdamW
        m[i] = b1 * m[i] + one_minus_b1 * grad;
        v[i] = b2 * v[i] + one_minus_b2 * grad * grad;
        const C denom = std::sqrt(v[i]) / bias2_sqrt + eps;
        w -= step_size * m[i] / denom;
        p[i] = static_cast<P>(w);
        write_work(work, i, w);
      }
    });
  });
}

void sgd(const StridedView& params, const StridedView& grads, const StridedView& momentum_buffer,
         const SGDArgs& a, const StridedView& work) {
  dispatch_float(params.dtype, "sgd", [&]<class P>() {
    dispatch_float(grads.dtype, "sgd", [&]<class G>() {
      using C = std::conditional_t<std::is_same_v<P, double>, double, float>;
      P* p = params.ptr<P>();
      const G* g = grads.ptr<G>();
      C* buf = momentum_buffer.ptr<C>();
      const C lr = static_cast<C>(a.lr), mom = static_cast<C>(a.momentum);
      // 1 - dampening in double, then rounded, as torch's alpha = 1 - dampening.
      const C one_minus_damp = static_cast<C>(1.0 - a.dampening), wd = static_cast<C>(a.weight_decay);
      const C scale = static_cast<C>(a.grad_scale);
      const std::int64_t n = params.numel();
      for (std::int64_t i = 0; i < n; ++i) {
        C w = static_cast<C>(static_cast<compute_t<P>>(p[i]));
        C d = static_cast<C>(static_cast<compute_t<G>>(g[i])) * scale;
        if (i < a.decay_end) d += wd * w;
        if (a.momentum != 0.0) {
          buf[i] = a.first_step ? d : mom * buf[i] + one_minus_damp * d;
          d = a.nesterov ? d + mom * buf[i] : buf[i];
        }
        p[i] = static_cast<P>(w - lr * d);
        write_work(work, i, w - lr * d);
      }
    });
  });
}

NormResult sum_squares(const StridedView& values) {
  NormResult r;
  dispatch_float(values.dtype, "sum_squares", [&]<class T>() {
    const T* x = values.ptr<T>();
    const std::int64_t n = values.numel();
    double acc = 0.0;
    bool bad = false;
    for (std::int64_t i = 0; i < n; ++i) {
      const double v = static_cast<double>(static_cast<compute_t<T>>(x[i]));
      bad |= !std::isfinite(v);
      acc += v * v;
    }
    r = {acc, bad};
  });
  return r;
}

void scale(const StridedView& values, double factor) {
  dispatch_float(values.dtype, "scale", [&]<class T>() {
    T* x = values.ptr<T>();
    const std::int64_t n = values.numel();
    for (std::int64_t i = 0; i < n; ++i) {
      x[i] = static_cast<T>(static_cast<compute_t<T>>(x[i]) * static_cast<compute_t<T>>(factor));
    }
  });
}

}  // namespace microbatch::kernels::cpu
