#include "optim/optimizer.h"

#include <cstring>
#include <sstream>

#include "core/ops/dispatch.h"
#include "kernels/optim.h"

namespace microbatch::optim {

namespace {
DType state_dtype(const ParamStore& store) {
  return store.master().dtype() == DType::f64 ? DType::f64 : DType::f32;
}

// The store's layout as bytes, saved beside the flat moment arenas (ParamStore::layout).
Tensor layout_tensor(const ParamStore& store) {
  const std::string text = store.layout();
  Tensor t = empty({static_cast<std::int64_t>(text.size())}, {.dtype = DType::u8});
  if (!text.empty()) std::memcpy(t.raw_data(), text.data(), text.size());
  return t;
}

// A flat state is meaningful only in the layout it was saved in: with another set of frozen
// parameters or decay groups of the same total size, each moment would land on another
// parameter. States saved without a layout are taken as they are.
void check_layout(const std::map<std::string, Tensor>& state, const ParamStore& store,
                  const char* op) {
  auto it = state.find("layout");
  if (it == state.end()) return;
  MB_CHECK(it->second.dtype() == DType::u8 && it->second.dim() == 1 && it->second.device().is_cpu(),
           "[{}] state 'layout' must be a 1-d u8 CPU tensor, got {} {}", op,
           dtype_name(it->second.dtype()), shape_str(it->second.shape()));
  const Tensor bytes = it->second.contiguous();
  const std::string saved(static_cast<const char*>(bytes.raw_data()),
                          static_cast<std::size_t>(bytes.numel()));
  const std::string now = store.layout();
  if (saved == now) return;
  // Name the first entry that differs.
  std::istringstream a(saved), b(now);
  std::string was, is;
  while (std::getline(a, was) && std::getline(b, is) && was == is) {
  }
  MB_CHECK(false,
           "[{}] the state was saved for another parameter layout (which parameters are frozen, "
           "or decay, differs): saved '{}', now '{}'; its moments would land on other parameters",
           op, was, is);
}

// As torch's "optimizer got an empty parameter list": a model whose every parameter is frozen
// has nothing to optimize.
void check_trainable(const ParamStore& store, const char* op) {
  MB_CHECK(store.trainable_numel() > 0,
           "[{}] every parameter of the model is frozen (none requires grad): nothing to optimize",
           op);
}

Tensor state_tensor(const std::map<std::string, Tensor>& state, const std::string& name, const Tensor& like,
                    const char* op) {
  auto it = state.find(name);
  MB_CHECK(it != state.end(), "[{}] state has no '{}'", op, name);
  MB_CHECK(it->second.shape() == like.shape(), "[{}] state '{}' has shape {}, expected {}", op, name,
           shape_str(it->second.shape()), shape_str(like.shape()));
  return it->second;
}
}  // namespace

std::int64_t saved_count(const std::map<std::string, Tensor>& state, const char* name,
                         const char* op) {
  auto it = state.find(name);
  MB_CHECK(it != state.end(), "[{}] state has no '{}'", op, name);
  MB_CHECK(it->second.numel() == 1, "[{}] state '{}' must hold one value, got shape {}", op, name,
           shape_str(it->second.shape()));
  const double v = it->second.item();
  // A negative step puts AdamW's bias correction at 1 - beta^0 = 0, and a NaN cast to int64 is
  // undefined.
  MB_CHECK(holds_value(DType::i64, v) && v >= 0,
           "[{}] state '{}' must be a whole number >= 0, got {}", op, name, v);
  return static_cast<std::int64_t>(v);
}

AdamW::AdamW(ParamStore& store, AdamWConfig config) : Optimizer(store), config_(config) {
  check_trainable(store, "AdamW");
  MB_CHECK(config.lr >= 0, "[AdamW] lr must be >= 0, got {}", config.lr);
  MB_CHECK(config.beta1 >= 0 && config.beta1 < 1 && config.beta2 >= 0 && config.beta2 < 1,
           "[AdamW] betas must be in [0, 1), got ({}, {})", config.beta1, config.beta2);
  MB_CHECK(config.eps >= 0, "[AdamW] eps must be >= 0, got {}", config.eps);
  MB_CHECK(config.weight_decay >= 0, "[AdamW] weight_decay must be >= 0, got {}",
           config.weight_decay);
  const TensorOptions opts{.dtype = state_dtype(store), .device = store.weights().device()};
  exp_avg_ = zeros({store.trainable_numel()}, opts);
  exp_avg_sq_ = zeros({store.trainable_numel()}, opts);
}

namespace {
// The weights an update pass writes: the trainable range, never the frozen one (Note [Frozen
// parameters] in optim/param_store.h).
Tensor updated(const Tensor& arena, const ParamStore& store) {
  return arena.slice(0, 0, store.trainable_numel());
}

kernels::StridedView working_copy(const ParamStore& store) {
  return store.has_master() ? updated(store.weights(), store).kview() : kernels::StridedView{};
}

// A gated pass on the CPU reads the gate here, as the CUDA kernels read it on the device.
bool apply_gate_on_host(const kernels::DeviceGate& gate, double* grad_scale) {
  if (gate.stats == nullptr) return true;
  if (gate.stats->non_finite != 0) return false;
  *grad_scale *= kernels::gated_grad_scale(gate.stats->sum_sq, gate.loss_scale, gate.max_grad_norm);
  return true;
}
}  // namespace

void AdamW::run(kernels::AdamWArgs args, const kernels::DeviceGate& gate) {
  store_.check_frozen("AdamW");
  const Tensor master = updated(store_.master(), store_);
  launch("AdamW", master.device(),
         [&] {
           if (!apply_gate_on_host(gate, &args.grad_scale)) return;
           kernels::cpu::adamw(master.kview(), store_.grads().kview(), exp_avg_.kview(), exp_avg_sq_.kview(), args,
                               working_copy(store_));
         },
         [&] {
           kernels::cuda::adamw(master.kview(), store_.grads().kview(), exp_avg_.kview(), exp_avg_sq_.kview(), args,
                                working_copy(store_), gate);
         });
  master.bump_version();
  store_.weights().bump_version();
}

kernels::AdamWArgs AdamW::step_args(std::int64_t step, double grad_scale) const {
  return {.lr = config_.lr,
          .beta1 = config_.beta1,
          .beta2 = config_.beta2,
          .eps = config_.eps,
          .weight_decay = config_.weight_decay,
          .step = step,
          .grad_scale = grad_scale,
          .decay_end = store_.decay_numel()};
}

void AdamW::step(StepOptions options) {
  if (options.found_inf) return;
  ++step_count_;
  run(step_args(step_count_, options.grad_scale), {});
}

void AdamW::step_gated(const kernels::DeviceGate& gate) {
  MB_CHECK(gate.stats != nullptr, "[AdamW] step_gated needs the gradient statistics");
  run(step_args(step_count_ + 1, 1.0), gate);  // the step it would be; counted by commit_step()
}

std::map<std::string, Tensor> AdamW::state_dict() const {
  return {{"exp_avg", exp_avg_},
          {"exp_avg_sq", exp_avg_sq_},
          {"step", scalar_tensor(static_cast<double>(step_count_), {.dtype = DType::i64})},
          {"layout", layout_tensor(store_)}};
}

void AdamW::load_state_dict(const std::map<std::string, Tensor>& state) {
  NoGradGuard no_grad;
  check_layout(state, store_, "AdamW");
  exp_avg_.copy_(state_tensor(state, "exp_avg", exp_avg_, "AdamW"));
  exp_avg_sq_.copy_(state_tensor(state, "exp_avg_sq", exp_avg_sq_, "AdamW"));
  step_count_ = saved_count(state, "step", "AdamW");
}

SGD::SGD(ParamStore& store, SGDConfig config) : Optimizer(store), config_(config) {
  check_trainable(store, "SGD");
  MB_CHECK(config.lr >= 0, "[SGD] lr must be >= 0, got {}", config.lr);
  MB_CHECK(config.momentum >= 0, "[SGD] momentum must be >= 0, got {}", config.momentum);
  MB_CHECK(config.weight_decay >= 0, "[SGD] weight_decay must be >= 0, got {}",
           config.weight_decay);
  MB_CHECK(!config.nesterov || (config.momentum > 0 && config.dampening == 0),
           "[SGD] Nesterov momentum needs momentum > 0 and dampening 0");
  if (config.momentum != 0.0) {
    momentum_buffer_ = zeros({store.trainable_numel()},
                             {.dtype = state_dtype(store), .device = store.weights().device()});
  }
}

void SGD::run(double grad_scale, const kernels::DeviceGate& gate) {
  store_.check_frozen("SGD");
  kernels::SGDArgs args{.lr = config_.lr,
                        .momentum = config_.momentum,
                        .dampening = config_.dampening,
                        .weight_decay = config_.weight_decay,
                        .nesterov = config_.nesterov,
                        .first_step = step_count_ == 0,
                        .grad_scale = grad_scale,
                        .decay_end = store_.decay_numel()};
  kernels::StridedView buffer = momentum_buffer_.defined() ? momentum_buffer_.kview() : kernels::StridedView{};
  const Tensor master = updated(store_.master(), store_);
  launch("SGD", master.device(),
         [&] {
           if (!apply_gate_on_host(gate, &args.grad_scale)) return;
           kernels::cpu::sgd(master.kview(), store_.grads().kview(), buffer, args, working_copy(store_));
         },
         [&] {
           kernels::cuda::sgd(master.kview(), store_.grads().kview(), buffer, args, working_copy(store_), gate);
         });
  master.bump_version();
  store_.weights().bump_version();
}

void SGD::step(StepOptions options) {
  if (options.found_inf) return;
  run(options.grad_scale, {});
  ++step_count_;
}

void SGD::step_gated(const kernels::DeviceGate& gate) {
  MB_CHECK(gate.stats != nullptr, "[SGD] step_gated needs the gradient statistics");
  run(1.0, gate);
}

std::map<std::string, Tensor> SGD::state_dict() const {
  std::map<std::string, Tensor> out{
      {"step", scalar_tensor(static_cast<double>(step_count_), {.dtype = DType::i64})},
      {"layout", layout_tensor(store_)}};
  if (momentum_buffer_.defined()) out["momentum_buffer"] = momentum_buffer_;
  return out;
}

void SGD::load_state_dict(const std::map<std::string, Tensor>& state) {
  NoGradGuard no_grad;
  check_layout(state, store_, "SGD");
  if (momentum_buffer_.defined())
    momentum_buffer_.copy_(state_tensor(state, "momentum_buffer", momentum_buffer_, "SGD"));
  step_count_ = saved_count(state, "step", "SGD");
}

}  // namespace microbatch::optim
