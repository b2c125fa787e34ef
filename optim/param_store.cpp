#include "optim/param_store.h"

#include <algorithm>
#include <cmath>

#include "kernels/optim.h"

namespace microbatch::optim {

namespace {
bool decays(DecayRule rule, const Tensor& t) {
  switch (rule) {
    case DecayRule::All: return true;
    case DecayRule::None: return false;
    case DecayRule::MatricesOnly: return t.dim() >= 2;
  }
  return false;
}
}  // namespace

ParamStore::ParamStore(nn::Module& model, ParamStoreOptions options) : model_(model) {
  auto slots = model.parameter_slots();
  MB_CHECK(!slots.empty(), "[ParamStore] the model has no parameters");
  const Device device = slots[0].second->device();
  const DType dtype = slots[0].second->dtype();
  // Decay group first, each group in registration order.
  std::vector<std::pair<std::string, Tensor*>> ordered;
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& s : slots) {
      if (decays(options.decay, *s.second) == (pass == 0)) ordered.push_back(s);
    }
  }
  std::int64_t total = 0;
  for (auto& [name, slot] : ordered) {
    MB_CHECK(slot->device() == device && slot->dtype() == dtype,
             "[ParamStore] parameter '{}' is {} on {}, others are {} on {}", name,
             dtype_name(slot->dtype()), slot->device().str(), dtype_name(dtype), device.str());
    const bool d = decays(options.decay, *slot);
    entries_.push_back(Entry{name, slot->shape(), total, slot->numel(), d});
    if (d) decay_numel_ = total + slot->numel();
    total += slot->numel();
  }
  weights_ = empty({total}, {.dtype = dtype, .device = device});
  const DType grad_dtype = options.grad_dtype.value_or(dtype == DType::f64 ? DType::f64 : DType::f32);
  grads_ = zeros({total}, {.dtype = grad_dtype, .device = device});
  NoGradGuard no_grad;
  for (std::size_t i = 0; i < ordered.size(); ++i) {
    const Entry& e = entries_[i];
    Tensor* slot = ordered[i].second;
    Tensor w = weight_of(e);
    w.copy_(*slot);
    Tensor param = w.detach();
    param.requires_grad_(true);
    param.set_grad(grad_of(e));
    *slot = param;
  }
}

Tensor ParamStore::weight_of(const Entry& e) const {
  return weights_.slice(0, e.offset, e.offset + e.numel).view(e.shape);
}

Tensor ParamStore::grad_of(const Entry& e) const {
  return grads_.slice(0, e.offset, e.offset + e.numel).view(e.shape);
}

void ParamStore::zero_grad() {
  NoGradGuard no_grad;
  grads_.zero_();
}

ParamStore::GradNorm ParamStore::grad_norm() const {
  MB_CHECK(grads_.device().is_cpu(), "[grad_norm] has no {} kernel in this build yet", grads_.device().str());
  auto r = kernels::cpu::sum_squares(grads_.kview());
  return {std::sqrt(r.sum_sq), r.non_finite};
}

double clip_grad_norm_(ParamStore& store, double max_norm) {
  MB_CHECK(max_norm > 0, "[clip_grad_norm_] max_norm must be positive, got {}", max_norm);
  const double norm = store.grad_norm().norm;
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    kernels::cpu::scale(store.grads().kview(), coef);
    store.grads().bump_version();
  }
  return norm;
}

}  // namespace microbatch::optim
