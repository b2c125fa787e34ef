#include "train/accelerator.h"

#include "nn/models.h"

namespace microbatch::train {

WindowedLoader::WindowedLoader(std::function<std::optional<Batch>()> next, std::int64_t steps,
                               Device device)
    : next_(std::move(next)), steps_(steps), device_(device) {
  MB_CHECK(steps >= 1, "[Accelerator] gradient_accumulation_steps must be >= 1, got {}", steps);
}

WindowedLoader::WindowedLoader(DataLoader& loader, std::int64_t steps, Device device)
    : WindowedLoader([&loader] { return loader.next(); }, steps, device) {
  // An empty loader would hand out nullopt forever, and a loop waiting for a window never ends.
  MB_CHECK(loader.num_batches() > 0,
           "[Accelerator] the loader has no batches ({} examples, batch_size {}{}): there is no "
           "window to train on", loader.dataset().size(), loader.options().batch_size,
           loader.options().drop_last ? ", drop_last" : "");
  loader_ = &loader;
  read_to_ = loader.state();
}

// Note [Cutting a window]: a window's micro-batches add their weighted gradients as they are
// handed out, and its weights sum to 1 only over the whole window. Moving the loader part-way
// through one (set_epoch, set_state, or the DataLoader's own) would start a fresh window on top
// of the gradients already added: the next step would take more than one window's gradient, with
// no error. So a move is refused until the window's last batch has been handed out; reset() drops
// a window explicitly, leaving the gradients its micro-batches added to the caller (zero them with
// the inner optimizer's zero_grad, or keep them).
void WindowedLoader::check_between_windows(const char* what) const {
  MB_CHECK(handed_ == 0,
           "[WindowedLoader] {} with {} of this window's {} micro-batches handed out: their "
           "gradients would add to the next window's; finish the window first, or call reset() to "
           "drop it (zeroing the gradients its micro-batches added if they should not count)",
           what, handed_, handed_ + static_cast<std::int64_t>(window_.size()));
}

std::optional<WindowBatch> WindowedLoader::next() {
  // The loader was moved on its own (loader.set_epoch / set_state): what was read ahead is no
  // longer what it would hand out next.
  if (loader_ && loader_->state() != read_to_) {
    check_between_windows("the DataLoader was moved");
    reset();
  }
  if (window_.empty() && !read_window()) return std::nullopt;
  // Copy before taking the batch out, so a failed copy leaves it in the window for a retry.
  Batch on_device = window_.front().batch.to(device_);  // one copy, when it is needed
  WindowBatch out = std::move(window_.front());
  window_.pop_front();
  out.batch = std::move(on_device);
  handed_ = window_.empty() ? 0 : handed_ + 1;
  return out;
}

bool WindowedLoader::read_window() {
  // Read the whole window ahead, so every batch's weight is known before its backward
  // (Note [Window read-ahead]): if next_() throws, pending_ keeps what it holds for the retry.
  auto read = [&] {
    while (static_cast<std::int64_t>(pending_.size()) < steps_) {
      std::optional<Batch> b = next_();
      if (loader_) read_to_ = loader_->state();
      if (!b) break;
      pending_.push_back(std::move(*b));
    }
  };
  if (group_ == nullptr) {
    read();
  } else {
    // A process whose source fails stops every process (Note [Failing together]).
    group_->together("reading its window", read);
    // Every process's source must end together: one whose data ran out would leave the others
    // waiting for it in the window's sum.
    const std::int64_t with_window = group_->all_reduce_sum(std::int64_t{pending_.empty() ? 0 : 1});
    MB_CHECK(with_window == 0 || with_window == group_->size(),
             "[Accelerator] {} of the {} processes have a window to train on and the others' data "
             "has run out: every process's loader must give as many batches (shard it with "
             ".num_replicas and .rank)",
             with_window, group_->size());
  }
  if (pending_.empty()) return false;
  std::int64_t total = 0;
  for (const Batch& b : pending_) total += b.num_items;
  // In a data-parallel run the window is every process's: weights are shares of all its items.
  if (group_ != nullptr) total = group_->all_reduce_sum(total);
  for (Batch& b : pending_) {
    WindowBatch w;
    // A window with no loss-bearing item contributes nothing (weight 0), rather than NaN.
    w.weight = total > 0 ? static_cast<double>(b.num_items) / static_cast<double>(total) : 0.0;
    w.window_items = total;
    w.batch = std::move(b);
    w.from_loader_ = true;
    window_.push_back(std::move(w));
  }
  window_.back().ends_window = true;
  pending_.clear();
  return true;
}

void WindowedLoader::set_epoch(std::int64_t epoch) {
  MB_CHECK(loader_ != nullptr, "[WindowedLoader] set_epoch needs a DataLoader source "
           "(accelerator.prepare(loader)); after moving another source, call reset()");
  check_between_windows("set_epoch()");
  loader_->set_epoch(epoch);
  reset();
}

void WindowedLoader::set_state(LoaderState state) {
  MB_CHECK(loader_ != nullptr, "[WindowedLoader] set_state needs a DataLoader source "
           "(accelerator.prepare(loader)); after moving another source, call reset()");
  check_between_windows("set_state()");
  loader_->set_state(state);
  reset();
}

void WindowedLoader::reset() {
  pending_.clear();
  window_.clear();
  handed_ = 0;
  if (loader_) read_to_ = loader_->state();
}

Accelerator::Accelerator(AcceleratorConfig config)
    : config_(config), group_(config.group != nullptr ? config.group : &ProcessGroup::world()) {
  // A rank that refuses alone would leave the others waiting (Note [Failing together]).
  group_->together("checking its configuration", [&] {
    MB_CHECK(config.gradient_accumulation_steps >= 1,
             "[Accelerator] gradient_accumulation_steps must be >= 1, got {}",
             config.gradient_accumulation_steps);
    if (config.device) {
      const Device d = *config.device;
      MB_CHECK(!d.is_meta(), "[Accelerator] device must be cpu or cuda:N, got meta");
      MB_CHECK(!(config.cpu && d.is_cuda()),
               "[Accelerator] cpu = true and device = {} disagree: give one of them", d.str());
      MB_CHECK(!d.is_cuda() || d.index < cuda_device_count(),
               "[Accelerator] device {} is not present ({} CUDA device(s) here)", d.str(),
               cuda_device_count());
      device_ = d;
    } else {
      device_ = !config.cpu && cuda_available() ? cuda_device(0) : kCPU;
    }
  });
  device_ = prepare_rank(*group_, device_,
                         config.device ? DeviceIndex::Named : DeviceIndex::Default,
                         config.ddp_backend);
}

namespace {
// Note [Items by the model's ignore_index]: a micro-batch's weight is its share of the window's
// loss-bearing labels, those that are not the model's ignore_index (Note [Batch items]). The
// DataLoader counts them by its collate option; a model that ignores another value (a GPT with
// ignore_index = -1) would have its ignored labels counted, and every weight would be wrong with
// no error. The Trainer builds its loaders from the model; here the two are checked.
void check_ignore_index(std::int64_t model, std::int64_t loader) {
  MB_CHECK(model == loader,
           "[Accelerator] the DataLoader counts items with ignore_index {} but the model ignores "
           "{}: the micro-batches' weights would count labels the loss ignores; build the loader "
           "with .collate = {{.ignore_index = {}}}",
           loader, model, model);
}
}  // namespace

nn::Module& Accelerator::prepare_model(nn::Module& model) {
  group_->together("preparing its model", [&] {
    if (const auto* m = dynamic_cast<const nn::Model*>(&model)) {
      for (std::int64_t loader : loader_ignore_indices_)
        check_ignore_index(m->ignore_index(), loader);
      model_ignore_index_ = m->ignore_index();
    }
    model.to(device_);
  });
  if (group_->size() > 1) {
    for (Tensor p : model.parameters()) group_->broadcast(p);
  }
  return model;
}

WindowedLoader Accelerator::prepare(DataLoader& loader) {
  const std::int64_t counted = loader.options().collate.ignore_index;
  if (model_ignore_index_) check_ignore_index(*model_ignore_index_, counted);
  const DataLoaderOptions& o = loader.options();
  MB_CHECK(o.num_replicas == group_->size() && o.rank == group_->rank(),
           "[Accelerator] process {} of {} was given a loader sharded as rank {} of {}: build it "
           "with .num_replicas = accelerator.num_processes(), .rank = "
           "accelerator.process_index(), so that each process trains on its own share",
           group_->rank(), group_->size(), o.rank, o.num_replicas);
  WindowedLoader windows(loader, config_.gradient_accumulation_steps, device_);
  if (group_->size() > 1) windows.group_ = group_;
  loader_ignore_indices_.push_back(counted);
  return windows;
}

WindowedLoader Accelerator::prepare(std::function<std::optional<Batch>()> next) {
  WindowedLoader windows(std::move(next), config_.gradient_accumulation_steps, device_);
  if (group_->size() > 1) windows.group_ = group_;
  return windows;
}

AccumulateScope Accelerator::accumulate(const WindowBatch& batch) {
  MB_CHECK(!in_scope_, "[Accelerator] accumulate() scopes cannot nest");
  MB_CHECK(batch.from_loader(), "[Accelerator] accumulate() takes a batch from a prepared loader "
           "(accelerator.prepare(loader)): a hand-built WindowBatch belongs to no window, and the "
           "optimizer would never step");
  sync_gradients_ = batch.ends_window;
  return AccumulateScope(*this, batch.weight);
}

AccumulateScope::AccumulateScope(Accelerator& accelerator, double weight)
    : accelerator_(accelerator), weight_(weight) {
  accelerator_.in_scope_ = true;
}

AccumulateScope::~AccumulateScope() { accelerator_.in_scope_ = false; }

void Accelerator::backward(const Tensor& loss, const Tensor& grad, BackwardOptions options) {
  // Outside a scope the micro-batch's share of its window is unknown. Accelerate would use 1/N,
  // which is the rule Note [Exact accumulation] exists to avoid; with N = 1 the weight is 1.
  MB_CHECK(in_scope_ || config_.gradient_accumulation_steps == 1,
           "[Accelerator] backward() outside an accumulate() scope with "
           "gradient_accumulation_steps = {}: the micro-batch's weight in its window is unknown "
           "there; call it inside `auto scope = accelerator.accumulate(batch);`",
           config_.gradient_accumulation_steps);
  // In a data-parallel run each process's share of the window is known only inside a scope; with
  // weight 1 the sum over the processes would be num_processes() times the mean's gradient.
  MB_CHECK(in_scope_ || group_->size() == 1,
           "[Accelerator] backward() outside an accumulate() scope in a run of {} processes: this "
           "process's share of the window is unknown there, and the summed gradient would be {} "
           "times the mean's; call it inside `auto scope = accelerator.accumulate(batch);`",
           group_->size(), group_->size());
  loss.backward(grad, options);  // the scope's GradWeightGuard weighs it
}

AcceleratedOptimizer::AcceleratedOptimizer(Accelerator& accelerator, optim::Optimizer& optimizer)
    : accelerator_(accelerator), optimizer_(optimizer), index_(accelerator.prepared_.size()) {
  accelerator_.prepared_.push_back({.optimizer = &optimizer});
}

void AcceleratedOptimizer::step(optim::StepOptions options) {
  if (!accelerator_.sync_gradients()) return;
  if (accelerator_.group_->size() > 1) {
    Tensor grads = optimizer_.store().grads();
    accelerator_.group_->all_reduce_sum(grads);
  }
  const std::int64_t taken = optimizer_.step_count();
  optimizer_.step(options);
  // A skipped step (found_inf) leaves the step count as it was; the scheduler reads this.
  accelerator_.prepared_[index_].step_skipped = optimizer_.step_count() == taken;
}

void AcceleratedOptimizer::zero_grad() {
  if (accelerator_.sync_gradients()) optimizer_.zero_grad();
}

bool AcceleratedOptimizer::step_was_skipped() const {
  return accelerator_.prepared_[index_].step_skipped;
}

void AcceleratedScheduler::step() {
  // As Accelerate's AcceleratedScheduler: the schedule moves with the optimizer, so only at a
  // boundary, and not when a prepared optimizer skipped its step (REFERENCE.md, loss scaling).
  if (!accelerator_.sync_gradients()) return;
  // Its own optimizer's step decides, as Accelerate attaches a scheduler to the prepared optimizer
  // it was made for (the latest preparation of it); only a scheduler whose optimizer was not
  // prepared looks at them all.
  const auto& prepared = accelerator_.prepared_;
  for (auto it = prepared.rbegin(); it != prepared.rend(); ++it) {
    if (it->optimizer == &scheduler_.optimizer()) {
      if (!it->step_skipped) scheduler_.step();
      return;
    }
  }
  for (const auto& p : prepared) {
    if (p.step_skipped) return;
  }
  scheduler_.step();
}

}  // namespace microbatch::train
