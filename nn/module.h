// Module: named parameters, buffers and sub-modules, train/eval mode, state_dict, device moves.
// A module registers pointers to its own Tensor members, so moving it (to(), or into a flat
// parameter arena) rewrites the members in place and layers keep using plain fields.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/ops.h"

namespace microbatch::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
using StateDict = std::map<std::string, Tensor>;

/// The device that layers create their parameters on: the CPU, unless a DeviceScope says otherwise.
Device default_device();

/// Layers built in this scope (on this thread) create their parameters on `device`, as under
/// torch.device(...). On meta a model is shapes only: no values, no initialization draws, no host
/// memory, which is how the planner builds a GPT-2 in no time. Elsewhere the values are drawn on
/// the CPU and copied, so a model is the same whichever device it is built on.
class DeviceScope {
 public:
  explicit DeviceScope(Device device);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  Device saved_;
};

enum class LoadMode { Strict, NonStrict };

/// What Module::zero_grad does with a defined gradient: zero it in place (torch 1.13's default,
/// set_to_none=False), or drop it, as set_to_none=True.
enum class GradReset { Zero, SetToNone };

/// Whatever holds a module's parameters after the module was built into it (optim::ParamStore):
/// the module asks it before it rewrites a parameter. Note [Parameters owned by a store] in
/// optim/param_store.h.
class ParameterOwner {
 public:
  virtual ~ParameterOwner() = default;
  /// Whether `param` is one of the owner's.
  virtual bool owns(const Tensor& param) const = 0;
  /// Writes `value` into the owned parameter `param` at the owner's full precision (its master
  /// copy) and refreshes the copy the model reads. False when `param` is not one of the owner's.
  virtual bool load_parameter(const Tensor& param, const Tensor& value) = 0;
};

class Module {
 public:
  virtual ~Module() = default;
  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  /// Parameters with dotted names ("blocks.0.attn.weight"), in registration order, each once.
  NamedTensors named_parameters() const;
  std::vector<Tensor> parameters() const;
  NamedTensors named_buffers() const;
  /// Every registered Tensor slot with its name (parameters and buffers), for whole-model rewrites.
  std::vector<std::pair<std::string, Tensor*>> parameter_slots();
  std::int64_t num_parameters() const;

  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  /// Copies of nothing: the live parameter and buffer tensors by name (detached).
  StateDict state_dict() const;
  /// Copies values in (shapes must match; dtype is converted). Strict: names must match exactly.
  /// A tied tensor (one registered under several names) is found under any of them, as torch's
  /// state dicts list it under each; strict mode needs one, and loads every one given.
  /// A parameter owned by a ParamStore with f32 masters is loaded into its master, unrounded.
  void load_state_dict(const StateDict& state, LoadMode mode = LoadMode::Strict);
  /// Moves (or casts) every parameter and buffer; parameters stay leaves and keep requires_grad.
  /// Tensors already on that device (with that dtype) are left as they are. Refused while a
  /// ParamStore owns the parameters and one of them would change.
  void to(Device device);
  void to(DType dtype);
  /// Resets every parameter's gradient (torch 1.13's Module.zero_grad). SetToNone is refused while
  /// a ParamStore owns the parameters: their gradients are views of its arena.
  void zero_grad(GradReset reset = GradReset::Zero);

  /// Records (for this module and every child) who owns the parameters' storage, which then
  /// guards to(), zero_grad() and load_state_dict() of this module and of any module above it.
  /// Held weakly: it lapses with its owner.
  void set_parameter_owner(const std::weak_ptr<ParameterOwner>& owner);
  /// Whether a live ParameterOwner holds parameters of this module or of a module inside it.
  bool has_parameter_owner() const { return !live_owners().empty(); }

 protected:
  /// Registers a member tensor as a parameter (requires grad).
  void register_parameter(const std::string& name, Tensor* slot);
  void register_buffer(const std::string& name, Tensor* slot);
  template <class M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> module) {
    children_.emplace_back(name, module);
    return module;
  }

 private:
  // Parameters (or buffers) by dotted name, each tensor once.
  NamedTensors named(bool params) const;
  // Refuses a move that would change a parameter a live ParameterOwner holds.
  void check_movable(Device device, std::optional<DType> dtype);
  // The distinct live owners of this module's and its children's parameters.
  std::vector<std::shared_ptr<ParameterOwner>> live_owners() const;
  void collect(const std::string& prefix, bool params, std::vector<std::pair<std::string, Tensor*>>& out,
               std::vector<const Tensor*>& seen) const;
  // Every slot under its dotted name, a tied one under each of its names, in collect's order
  // (loading and moves).
  void collect_every_name(const std::string& prefix, bool params,
                          std::vector<std::pair<std::string, Tensor*>>& out) const;

  std::vector<std::pair<std::string, Tensor*>> params_;
  std::vector<std::pair<std::string, Tensor*>> buffers_;
  std::vector<std::pair<std::string, std::shared_ptr<Module>>> children_;
  std::weak_ptr<ParameterOwner> owner_;
  bool training_ = true;
};

/// A module with one tensor in and one tensor out, so it can sit in a Sequential.
class Layer : public Module {
 public:
  virtual Tensor forward(const Tensor& x) = 0;
  Tensor operator()(const Tensor& x) { return forward(x); }
};

}  // namespace microbatch::nn
