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

// The link the modules hold weakly (Note [Parameters owned by a store]).
class ParamStore::Owner final : public nn::ParameterOwner {
 public:
  explicit Owner(ParamStore& store) : store_(store) {}
  bool owns(const Tensor& param) const override { return store_.entry_of(param) != nullptr; }
  bool load_parameter(const Tensor& param, const Tensor& value) override {
    return store_.load_parameter(param, value);
  }

 private:
  ParamStore& store_;
};

ParamStore::ParamStore(nn::Module& model, ParamStoreOptions options) {
  // A second store would copy the weights out of the first's arena, and the first (with its
  // optimizer) would go on updating a copy that nothing reads.
  MB_CHECK(!model.has_parameter_owner(),
           "[ParamStore] the model's parameters already belong to a live ParamStore; build one "
           "store per model, on the whole model");
  auto slots = model.parameter_slots();
  MB_CHECK(!slots.empty(), "[ParamStore] the model has no parameters");
  const Device device = slots[0].second->device();
  const DType dtype = slots[0].second->dtype();
  // Decay group, then the rest of the trainable ones, then the frozen ones (Note [Frozen
  // parameters]), each group in registration order.
  enum class Group { Decay, NoDecay, Frozen };
  auto group_of = [&](const Tensor& t) {
    if (!t.requires_grad()) return Group::Frozen;
    return decays(options.decay, t) ? Group::Decay : Group::NoDecay;
  };
  std::vector<std::pair<std::string, Tensor*>> ordered;
  for (Group group : {Group::Decay, Group::NoDecay, Group::Frozen}) {
    for (auto& s : slots) {
      if (group_of(*s.second) == group) ordered.push_back(s);
    }
  }
  std::int64_t total = 0, trainable = 0;
  for (auto& [name, slot] : ordered) {
    MB_CHECK(slot->device() == device && slot->dtype() == dtype,
             "[ParamStore] parameter '{}' is {} on {}, others are {} on {}", name,
             dtype_name(slot->dtype()), slot->device().str(), dtype_name(dtype), device.str());
    const Group group = group_of(*slot);
    entries_.push_back(Entry{.name = name,
                             .shape = slot->shape(),
                             .offset = total,
                             .numel = slot->numel(),
                             .decay = group == Group::Decay,
                             .frozen = group == Group::Frozen});
    if (group == Group::Decay) decay_numel_ = total + slot->numel();
    total += slot->numel();
    if (group != Group::Frozen) trainable = total;
  }
  const DType compute = options.compute_dtype.value_or(dtype);
  MB_CHECK(compute == dtype || (dtype == DType::f32 && is_16bit_float(compute)),
           "[ParamStore] parameters are {}: a {} compute dtype needs f32 parameters", dtype_name(dtype),
           dtype_name(compute));
  if (compute != dtype) master_ = empty({total}, {.dtype = dtype, .device = device});
  weights_ = empty({total}, {.dtype = compute, .device = device});
  const DType grad_dtype = options.grad_dtype.value_or(dtype == DType::f64 ? DType::f64 : DType::f32);
  grads_ = zeros({trainable}, {.dtype = grad_dtype, .device = device});
  NoGradGuard no_grad;
  for (std::size_t i = 0; i < ordered.size(); ++i) {
    const Entry& e = entries_[i];
    Tensor* slot = ordered[i].second;
    if (master_.defined()) master_of(e).copy_(*slot);
    Tensor w = weight_of(e);
    w.copy_(*slot);
    Tensor param = w.detach();  // a frozen one stays frozen, with no gradient slot
    if (!e.frozen) {
      param.requires_grad_(true);
      param.set_grad(grad_of(e));
    } else {
      frozen_.emplace_back(e.name, param);
    }
    *slot = param;
  }
  owner_ = std::make_shared<Owner>(*this);
  model.set_parameter_owner(owner_);
}

// The modules' weak links lapse with owner_; nothing here touches the model, which may be gone.
ParamStore::~ParamStore() = default;

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

std::string ParamStore::layout() const {
  std::string out;
  for (const Entry& e : entries_) {
    out += fmt::format("{} {} {} {}\n", e.name, e.offset, e.numel,
                       e.frozen ? "frozen" : e.decay ? "decay" : "no_decay");
  }
  return out;
}

void ParamStore::check_frozen(const char* op) const {
  for (const auto& [name, param] : frozen_) {
    MB_CHECK(!param.requires_grad(),
             "[{}] '{}' was frozen when its ParamStore was built and now requires grad: the store "
             "has no gradient slot for it and would never update it; build a new ParamStore and "
             "optimizer after changing which parameters are frozen",
             op, name);
  }
}

const ParamStore::Entry* ParamStore::entry_of(const Tensor& param) const {
  if (!param.defined() || !param.same_storage(weights_) || numel() == 0) return nullptr;
  const std::int64_t offset = param.offset() - weights_.offset();
  if (offset < 0 || offset >= numel()) return nullptr;
  const Entry& e = entry_at(offset);
  const bool whole = e.offset == offset && param.shape() == e.shape && param.is_contiguous();
  return whole ? &e : nullptr;
}

bool ParamStore::load_parameter(const Tensor& param, const Tensor& value) {
  const Entry* e = entry_of(param);
  if (e == nullptr) return false;
  // The working copy itself (model.load_state_dict(model.state_dict())): the master, not its
  // rounding, is the value, so there is nothing to load.
  if (same_elements(value, weight_of(*e))) return true;
  MB_CHECK(value.shape() == e->shape, "[ParamStore] '{}' has shape {}, expected {}", e->name,
           shape_str(value.shape()), shape_str(e->shape));
  NoGradGuard no_grad;
  master_of(*e).copy_(value);
  if (master_.defined()) weight_of(*e).copy_(master_of(*e));
  return true;
}

Tensor ParamStore::grad_of(const Entry& e) const {
  MB_CHECK(!e.frozen, "[ParamStore] '{}' is frozen: it has no gradient", e.name);
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
    if (e.frozen) continue;
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

double clip_grad_norm_(ParamStore& store, double max_norm, NonFiniteNorm non_finite) {
  MB_CHECK(max_norm > 0, "[clip_grad_norm_] max_norm must be positive, got {}", max_norm);
  const ParamStore::GradNorm g = store.grad_norm();
  const double norm = g.norm;  // inf or NaN when a gradient is (the sum of squares takes them in)
  // As torch, the norm itself is tested: finite f64 gradients past 1e154 overflow the sum.
  if (non_finite == NonFiniteNorm::Error && !std::isfinite(norm)) {
    const std::string where =
        g.non_finite ? fmt::format("'{}' holds the first non-finite gradient", store.first_non_finite())
                     : std::string("every gradient is finite, but their sum of squares overflows");
    MB_CHECK(false,
             "[clip_grad_norm_] the gradients' total norm is {} ({}), so they cannot be clipped; "
             "they are left as they were (NonFiniteNorm::Scale scales them by it, as torch's "
             "error_if_nonfinite = False does)",
             norm, where);
  }
  // A NaN coefficient is not clamped to 1 (torch's clamp keeps NaN): every gradient becomes NaN.
  const double coef = max_norm / (norm + 1e-6);
  if (!(coef >= 1.0)) {
    const Tensor& grads = store.grads();
    launch("clip_grad_norm_", grads.device(), [&] { kernels::cpu::scale(grads.kview(), coef); },
           [&] { kernels::cuda::scale(grads.kview(), coef); });
    grads.bump_version();
  }
  return norm;
}

}  // namespace microbatch::optim
