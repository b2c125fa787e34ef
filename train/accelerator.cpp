#include "train/accelerator.h"

namespace microbatch::train {

WindowedLoader::WindowedLoader(std::function<std::optional<Batch>()> next, std::int64_t steps, Device device)
    : next_(std::move(next)), steps_(steps), device_(device) {
  MB_CHECK(steps >= 1, "[Accelerator] gradient_accumulation_steps must be >= 1, got {}", steps);
}

std::optional<WindowBatch> WindowedLoader::next() {
  if (window_.empty()) {
    // Read the whole window ahead, so every batch's weight is known before its backward.
    std::int64_t total = 0;
    for (std::int64_t i = 0; i < steps_; ++i) {
      std::optional<Batch> b = next_();
      if (!b) break;
      total += b->num_items;
      window_.push_back(WindowBatch{std::move(*b), 0.0, false, 0});
    }
    if (window_.empty()) return std::nullopt;
    for (auto& w : window_) {
      // A window with no loss-bearing item contributes nothing (weight 0), rather than NaN.
      w.weight = total > 0 ? static_cast<double>(w.batch.num_items) / static_cast<double>(total) : 0.0;
      w.window_items = total;
    }
    window_.back().ends_window = true;
  }
  WindowBatch out = std::move(window_.front());
  window_.pop_front();
  out.batch = out.batch.to(device_);  // one copy, when it is needed
  return out;
}

Accelerator::Accelerator(AcceleratorConfig config) : config_(config) {
  MB_CHECK(config.gradient_accumulation_steps >= 1,
           "[Accelerator] gradient_accumulation_steps must be >= 1, got {}",
           config.gradient_accumulation_steps);
  if (config.device) {
    const Device d = *config.device;
    MB_CHECK(!d.is_meta(), "[Accelerator] device must be cpu or cuda:N, got meta");
    MB_CHECK(!(config.cpu && d.is_cuda()), "[Accelerator] cpu = true and device = {} disagree: give one of them",
             d.str());
    MB_CHECK(!d.is_cuda() || d.index < cuda_device_count(), "[Accelerator] device {} is not present ({} CUDA "
             "device(s) here)", d.str(), cuda_device_count());
    device_ = d;
  } else {
    device_ = !config.cpu && cuda_available() ? cuda_device(0) : kCPU;
  }
}

nn::Module& Accelerator::prepare_model(nn::Module& model) {
  model.to(device_);
  return model;
}

WindowedLoader Accelerator::prepare(std::function<std::optional<Batch>()> next) {
  return WindowedLoader(std::move(next), config_.gradient_accumulation_steps, device_);
}

AccumulateScope Accelerator::accumulate(const WindowBatch& batch) {
  MB_CHECK(!in_scope_, "[Accelerator] accumulate() scopes cannot nest");
  weight_ = batch.weight;
  sync_gradients_ = batch.ends_window;
  return AccumulateScope(*this);
}

AccumulateScope::AccumulateScope(Accelerator& accelerator) : accelerator_(accelerator) {
  accelerator_.in_scope_ = true;
}

AccumulateScope::~AccumulateScope() { accelerator_.in_scope_ = false; }

void Accelerator::backward(const Tensor& loss) {
  GradWeightGuard weight(weight_);
  loss.backward();
}

void AcceleratedOptimizer::step(optim::StepOptions options) {
  if (accelerator_.sync_gradients()) optimizer_.step(options);
}

void AcceleratedOptimizer::zero_grad() {
  if (accelerator_.sync_gradients()) optimizer_.zero_grad();
}

void AcceleratedScheduler::step() {
  if (accelerator_.sync_gradients()) scheduler_.step();
}

}  // namespace microbatch::train
