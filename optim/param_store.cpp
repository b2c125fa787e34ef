#include "optim/param_store.h"

#include <algorithm>
#include <cmath>

#include "core/ops/dispatch.h"
#include "kernels/device.h"
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
  const DType compute = options.compute_dtype.value_or(dtype);
  MB_CHECK(compute == dtype || (dtype == DType::f32 && is_16bit_float(compute)),
           "[ParamStore] parameters are {}: a {} compute dtype needs f32 parameters", dtype_name(dtype),
           dtype_name(compute));
  if (compute != dtype) master_ = empty({total}, {.dtype = dtype, .device = device});
  weights_ = empty({total}, {.dtype = compute, .device = device});
  const DType grad_dtype = options.grad_dtype.value_or(dtype == DType::f64 ? DType::f64 : DType::f32);
  grads_ = zeros({total}, {.dtype = grad_dtype, .device = device});
  NoGradGuard no_grad;
  for (std::size_t i = 0; i < ordered.size(); ++i) {
    const Entry& e = entries_[i];
    Tensor* slot = ordered[i].second;
    if (master_.defined()) master_of(e).copy_(*slot);
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

Tensor ParamStore::master_of(const Entry& e) const {
  return master().slice(0, e.offset, e.offset + e.numel).view(e.shape);
}

std::map<std::string, Tensor> ParamStore::master_state() const {
  std::map<std::string, Tensor> out;
  for (const Entry& e : entries_) out[e.name] = master_of(e);
  return out;
}

void ParamStore::load_master_state(const std::map<std::string, Tensor>& state) {
  NoGradGuard no_grad;
  for (const Entry& e : entries_) {
    auto it = state.find(e.name);
    MB_CHECK(it != state.end(), "[ParamStore] state has no weights for '{}'", e.name);
    MB_CHECK(it->second.shape() == e.shape, "[ParamStore] '{}' has shape {}, expected {}", e.name,
             shape_str(it->second.shape()), shape_str(e.shape));
    master_of(e).copy_(it->second);
  }
  if (master_.defined()) weights_.copy_(master_);
}

Tensor ParamStore::grad_of(const Entry& e) const {
  return grads_.slice(0, e.offset, e.offset + e.numel).view(e.shape);
}

void ParamStore::zero_grad() {
  NoGradGuard no_grad;
  grads_.zero_();
}

namespace {
// The statistics of a whole gradient arena, waited for: one reduction launch on CUDA.
kernels::GradStats arena_stats(const Tensor& grads) {
  const Device device = grads.device();
  MB_CHECK(device.is_cpu() || device.is_cuda(), "[grad_norm] the gradients are on {}, which holds no values",
           device.str());
  if (device.is_cpu()) {
    const kernels::cpu::NormResult r = kernels::cpu::sum_squares(grads.kview());
    return {.sum_sq = r.sum_sq, .non_finite = r.non_finite ? 1u : 0u};
  }
  Tensor buffer = zeros({static_cast<std::int64_t>(sizeof(kernels::GradStatsBuffer))},
                        {.dtype = DType::u8, .device = device});
  launch("grad_norm", device, [] {}, [&] {
    kernels::cuda::sum_squares(grads.kview(), static_cast<kernels::GradStatsBuffer*>(buffer.raw_data()));
  });
  kernels::GradStats stats;
  kernels::cuda::memcpy_device_to_host(&stats, buffer.raw_data(), sizeof stats, device.index);
  return stats;
}
}  // namespace

ParamStore::GradNorm ParamStore::grad_norm() const {
  const kernels::GradStats s = arena_stats(grads_);
  return {std::sqrt(s.sum_sq), s.non_finite != 0};
}

std::string ParamStore::first_non_finite() const {
  if (grads_.device().is_cuda()) {  // one reduction gives the first bad element's index
    const kernels::GradStats s = arena_stats(grads_);
    return s.non_finite != 0 ? entry_at(s.first_non_finite).name : std::string();
  }
  for (const Entry& e : entries_) {
    if (kernels::cpu::sum_squares(grad_of(e).contiguous().kview()).non_finite) return e.name;
  }
  return {};
}

const ParamStore::Entry& ParamStore::entry_at(std::int64_t index) const {
  MB_CHECK(index >= 0 && index < numel(), "[ParamStore] element {} is outside the arena of {}", index, numel());
  auto it = std::upper_bound(entries_.begin(), entries_.end(), index,
                             [](std::int64_t i, const Entry& e) { return i < e.offset; });
  return *std::prev(it);
}

double clip_grad_norm_(ParamStore& store, double max_norm) {
  MB_CHECK(max_norm > 0, "[clip_grad_norm_] max_norm must be positive, got {}", max_norm);
  const double norm = store.grad_norm().norm;
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    const Tensor& grads = store.grads();
    launch("clip_grad_norm_", grads.device(), [&] { kernels::cpu::scale(grads.kview(), coef); },
           [&] { kernels::cuda::scale(grads.kview(), coef); });
    grads.bump_version();
  }
  return norm;
}

}  // namespace microbatch::optim
