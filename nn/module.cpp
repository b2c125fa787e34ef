#include "nn/module.h"

#include <algorithm>

namespace microbatch::nn {

namespace {
thread_local Device t_default_device = kCPU;

// Whether two slots hold one tensor: the same slot, or tied (one impl under two names).
bool same_tensor(const Tensor* a, const Tensor* b) {
  return a == b || (a->defined() && b->defined() && a->impl() == b->impl());
}
}  // namespace

Device default_device() { return t_default_device; }

DeviceScope::DeviceScope(Device device) : saved_(t_default_device) { t_default_device = device; }
DeviceScope::~DeviceScope() { t_default_device = saved_; }

void Module::register_parameter(const std::string& name, Tensor* slot) {
  MB_CHECK(slot->defined(), "[register_parameter] '{}' is undefined", name);
  if (!slot->requires_grad()) slot->requires_grad_(true);
  params_.emplace_back(name, slot);
}

void Module::register_buffer(const std::string& name, Tensor* slot) { buffers_.emplace_back(name, slot); }

void Module::collect(const std::string& prefix, bool params,
                     std::vector<std::pair<std::string, Tensor*>>& out,
                     std::vector<const Tensor*>& seen) const {
  for (const auto& [name, slot] : params ? params_ : buffers_) {
    // A tied parameter (one tensor registered under several names) is listed once, under its
    // first name.
    auto same = [&](const Tensor* s) { return same_tensor(s, slot); };
    if (std::any_of(seen.begin(), seen.end(), same)) continue;
    seen.push_back(slot);
    out.emplace_back(prefix + name, slot);
  }
  for (const auto& [name, child] : children_) child->collect(prefix + name + ".", params, out, seen);
}

void Module::collect_every_name(const std::string& prefix, bool params,
                                std::vector<std::pair<std::string, Tensor*>>& out) const {
  for (const auto& [name, slot] : params ? params_ : buffers_)
    out.emplace_back(prefix + name, slot);
  for (const auto& [name, child] : children_)
    child->collect_every_name(prefix + name + ".", params, out);
}

std::vector<std::pair<std::string, Tensor*>> Module::parameter_slots() {
  std::vector<std::pair<std::string, Tensor*>> out;
  std::vector<const Tensor*> seen;
  collect("", true, out, seen);
  return out;
}

NamedTensors Module::named(bool params) const {
  std::vector<std::pair<std::string, Tensor*>> slots;
  std::vector<const Tensor*> seen;
  collect("", params, slots, seen);
  NamedTensors out;
  for (auto& [n, s] : slots) out.emplace_back(n, *s);
  return out;
}

NamedTensors Module::named_parameters() const { return named(true); }

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters()) out.push_back(t);
  return out;
}

NamedTensors Module::named_buffers() const { return named(false); }

std::int64_t Module::num_parameters() const {
  std::int64_t n = 0;
  for (auto& [name, t] : named_parameters()) n += t.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

StateDict Module::state_dict() const {
  StateDict out;
  for (auto& [n, t] : named_parameters()) out[n] = t.detach();
  for (auto& [n, t] : named_buffers()) out[n] = t.detach();
  return out;
}

void Module::load_state_dict(const StateDict& state, LoadMode mode) {
  // Each tensor with every name it has: a tied one (the same slot, or one sharing its impl) is one
  // tensor with several names, as collect() lists it once under the first.
  struct Named {
    std::vector<std::string> names;
    Tensor* slot;
  };
  std::vector<Named> tensors;
  std::vector<std::pair<std::string, Tensor*>> every;
  collect_every_name("", true, every);
  collect_every_name("", false, every);
  for (auto& [name, slot] : every) {
    auto it = std::find_if(tensors.begin(), tensors.end(),
                           [&](const Named& t) { return same_tensor(t.slot, slot); });
    if (it != tensors.end()) {
      it->names.push_back(name);
    } else {
      tensors.push_back({{name}, slot});
    }
  }
  // Under a store with f32 masters the working copy alone would be rewritten from stale masters
  // by the next step: the store takes the value (Note [Parameters owned by a store]).
  const std::vector<std::shared_ptr<ParameterOwner>> owners = live_owners();
  std::size_t used = 0;
  for (Named& t : tensors) {
    Tensor* slot = t.slot;
    bool found = false;
    for (const std::string& name : t.names) {
      auto it = state.find(name);
      if (it == state.end()) continue;
      found = true;
      ++used;
      MB_CHECK(it->second.defined(), "[load_state_dict] '{}' is an undefined tensor", name);
      MB_CHECK(!it->second.device().is_meta(),
               "[load_state_dict] '{}' is on the meta device: it has no values to load", name);
      MB_CHECK(it->second.shape() == slot->shape(),
               "[load_state_dict] '{}' has shape {}, the model expects {}", name,
               shape_str(it->second.shape()), shape_str(slot->shape()));
      NoGradGuard no_grad;
      const bool owned = std::any_of(owners.begin(), owners.end(), [&](const auto& owner) {
        return owner->load_parameter(*slot, it->second);
      });
      if (!owned) slot->copy_(it->second);
    }
    if (!found && mode == LoadMode::Strict) {
      std::string tied;  // the other names that would have served
      for (std::size_t k = 1; k < t.names.size(); ++k) tied += fmt::format(" or '{}'", t.names[k]);
      MB_CHECK(false, "[load_state_dict] missing key '{}'{}", t.names[0], tied);
    }
  }
  if (mode == LoadMode::Strict && used != state.size()) {
    for (auto& [name, t] : state) {
      bool known = std::any_of(every.begin(), every.end(), [&](auto& s) { return s.first == name; });
      MB_CHECK(known, "[load_state_dict] unexpected key '{}'", name);
    }
  }
}

namespace {
void move_slots(std::vector<std::pair<std::string, Tensor*>>& slots, Device device, std::optional<DType> dtype,
                bool params) {
  // Tied slots share one impl: convert it once and hand the same tensor to every slot.
  std::vector<std::pair<TensorImpl*, Tensor>> done;
  for (auto& [name, slot] : slots) {
    auto it = std::find_if(done.begin(), done.end(), [&](auto& d) { return d.first == slot->impl(); });
    if (it != done.end()) {
      *slot = it->second;
      continue;
    }
    TensorImpl* before = slot->impl();
    const DType dt = dtype && is_floating(slot->dtype()) ? *dtype : slot->dtype();
    if (slot->device() == device && slot->dtype() == dt) {  // already there: keep it (and its views)
      done.emplace_back(before, *slot);
      continue;
    }
    Tensor moved;
    {
      NoGradGuard no_grad;
      moved = slot->to(device, dt).detach();
      if (moved.same_storage(*slot)) moved = moved.clone().detach();
    }
    if (params) {
      moved.requires_grad_(slot->requires_grad());  // a frozen parameter stays frozen
      // The gradient moves with its parameter, as torch's Module._apply moves param.grad.
      if (slot->grad().defined()) {
        NoGradGuard no_grad;
        Tensor grad = slot->grad().to(device, dt).detach();
        if (grad.same_storage(slot->grad())) grad = grad.clone().detach();
        moved.set_grad(grad);
      }
    }
    done.emplace_back(before, moved);
    *slot = moved;
  }
}
}  // namespace

std::vector<std::shared_ptr<ParameterOwner>> Module::live_owners() const {
  std::vector<std::shared_ptr<ParameterOwner>> out;
  if (auto owner = owner_.lock()) out.push_back(std::move(owner));
  for (const auto& [name, child] : children_) {
    for (auto& owner : child->live_owners())
      if (std::find(out.begin(), out.end(), owner) == out.end()) out.push_back(std::move(owner));
  }
  return out;
}

namespace {
bool owned_by(const std::vector<std::shared_ptr<ParameterOwner>>& owners, const Tensor& param) {
  return std::any_of(owners.begin(), owners.end(),
                     [&](const auto& owner) { return owner->owns(param); });
}
}  // namespace

void Module::check_movable(Device device, std::optional<DType> dtype) {
  const auto owners = live_owners();  // a store built on this module or on one inside it
  if (owners.empty()) return;
  std::vector<std::pair<std::string, Tensor*>> slots;  // by dotted name
  std::vector<const Tensor*> seen;
  collect("", true, slots, seen);
  for (auto& [name, slot] : slots) {
    const DType dt = dtype && is_floating(slot->dtype()) ? *dtype : slot->dtype();
    MB_CHECK(!owned_by(owners, *slot) || (slot->device() == device && slot->dtype() == dt),
             "[Module::to] parameter '{}' ({} on {}) belongs to a ParamStore, which would keep "
             "updating its old copy: move or cast the model before building its ParamStore and "
             "optimizer (asked for {} on {})",
             name, dtype_name(slot->dtype()), slot->device().str(), dtype_name(dt), device.str());
  }
}

void Module::to(Device device) {
  check_movable(device, std::nullopt);
  for (bool params : {true, false}) {
    std::vector<std::pair<std::string, Tensor*>> slots;
    collect_every_name("", params, slots);
    move_slots(slots, device, std::nullopt, params);
  }
}

void Module::to(DType dtype) {
  std::vector<std::pair<std::string, Tensor*>> params;
  collect_every_name("", true, params);
  if (!params.empty()) check_movable(params[0].second->device(), dtype);
  for (bool params : {true, false}) {
    std::vector<std::pair<std::string, Tensor*>> slots;
    collect_every_name("", params, slots);
    if (!slots.empty()) move_slots(slots, slots[0].second->device(), dtype, params);
  }
}

void Module::zero_grad(GradReset reset) {
  const auto owners = reset == GradReset::SetToNone ? live_owners()
                                                     : std::vector<std::shared_ptr<ParameterOwner>>{};
  NoGradGuard no_grad;
  for (auto& [n, t] : named_parameters()) {
    if (!t.grad().defined()) continue;
    MB_CHECK(reset == GradReset::Zero || !owned_by(owners, t),
             "[Module::zero_grad] the gradient of '{}' is a view of a ParamStore's arena: SetToNone "
             "would cut it off and the optimizer would step on zeros (use GradReset::Zero, or the "
             "optimizer's zero_grad())",
             n);
    if (reset == GradReset::SetToNone) {
      t.set_grad({});
    } else {
      t.grad().zero_();
    }
  }
}

void Module::set_parameter_owner(const std::weak_ptr<ParameterOwner>& owner) {
  owner_ = owner;
  for (auto& [name, child] : children_) child->set_parameter_owner(owner);
}

}  // namespace microbatch::nn
