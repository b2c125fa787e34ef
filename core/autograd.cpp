#include "core/autograd.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "core/ops.h"
#include "core/profiler.h"

namespace microbatch {

namespace {
thread_local bool t_grad_mode = true;
thread_local double t_grad_weight = 1.0;
// The leaves whose gradients a running grad() call captures, with where it stores them, and the
// frame of the grad() call it runs inside (a checkpointed segment's backward runs inside the
// backward that reached it): a leaf captured by any of them is captured, by the innermost one
// that asks for it. Note [Captures through checkpoints].
struct CaptureFrame {
  const std::unordered_map<TensorImpl*, std::size_t>* index;
  std::vector<Tensor>* captured;
  const CaptureFrame* outer;
};
// The innermost capture on this thread (null: none).
thread_local const CaptureFrame* t_capture = nullptr;

// The slot in which a running grad() call captures t's gradient, or null.
Tensor* capture_slot(const TensorImpl* t) {
  for (const CaptureFrame* f = t_capture; f != nullptr; f = f->outer) {
    auto it = f->index->find(const_cast<TensorImpl*>(t));
    if (it != f->index->end()) return &(*f->captured)[it->second];
  }
  return nullptr;
}
// Whether the innermost backward running on this thread keeps its graph (retain_graph).
thread_local bool t_retaining_graph = false;
std::atomic<std::uint64_t> g_sequence{0};
}  // namespace

bool grad_mode_enabled() { return t_grad_mode; }
NoGradGuard::NoGradGuard() : previous_(t_grad_mode) { t_grad_mode = false; }
NoGradGuard::~NoGradGuard() { t_grad_mode = previous_; }
EnableGradGuard::EnableGradGuard() : previous_(t_grad_mode) { t_grad_mode = true; }
EnableGradGuard::~EnableGradGuard() { t_grad_mode = previous_; }
GradWeightGuard::GradWeightGuard(double weight) : previous_(t_grad_weight) { t_grad_weight = weight; }
GradWeightGuard::~GradWeightGuard() { t_grad_weight = previous_; }
double grad_weight() { return t_grad_weight; }
bool retaining_graph() { return t_retaining_graph; }

// ---- nodes -------------------------------------------------------------------------------------

Node::Node(std::string name, std::vector<Edge> next_edges, BackwardFn fn, int num_outputs,
           std::vector<InputMeta> inputs)
    : name_(std::move(name)),
      next_edges_(std::move(next_edges)),
      fn_(std::move(fn)),
      num_outputs_(num_outputs),
      sequence_nr_(g_sequence.fetch_add(1)),
      inputs_(std::move(inputs)) {
  MB_ASSERT(inputs_.empty() || inputs_.size() == next_edges_.size(),
            "{}: {} input records for {} edges", name_, inputs_.size(), next_edges_.size());
}

std::vector<InputMeta> input_meta(const std::vector<Tensor>& inputs) {
  std::vector<InputMeta> meta(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    // Only an input that takes a gradient is checked (it has an edge): no copy for the others.
    if (inputs[i].defined() && inputs[i].requires_grad())
      meta[i] = {inputs[i].shape(), inputs[i].device()};
  }
  return meta;
}

namespace {
// Whether a tensor of shape `from` broadcasts to shape `to`.
bool expands_to(const Shape& from, const Shape& to) {
  if (from.size() > to.size()) return false;
  const std::size_t lead = to.size() - from.size();
  for (std::size_t i = 0; i < from.size(); ++i) {
    if (from[i] != 1 && from[i] != to[lead + i]) return false;
  }
  return true;
}
}  // namespace

std::vector<Tensor> Node::apply(std::vector<Tensor> grad_outputs) {
  MB_CHECK(fn_ != nullptr,
           "[backward] trying to backward through {} a second time: its saved tensors were freed "
           "after the first backward. Pass BackwardOptions{{.retain_graph = true}} the first time.",
           name_);
  std::vector<Tensor> grads = fn_(std::move(grad_outputs));
  // Note [Checking returned gradients].
  MB_CHECK(grads.size() == next_edges_.size(),
           "[backward] {} returned an incorrect number of gradients (expected {}, got {})", name_,
           next_edges_.size(), grads.size());
  for (std::size_t i = 0; i < inputs_.size(); ++i) {
    Tensor& g = grads[i];
    if (!g.defined() || !next_edges_[i].fn) continue;
    const InputMeta& in = inputs_[i];
    MB_CHECK(is_floating(g.dtype()),
             "[backward] {} returned a gradient of dtype {} at index {}; gradients are floating",
             name_, dtype_name(g.dtype()), i);
    MB_CHECK(g.device() == in.device,
             "[backward] {} returned a gradient on {} at index {} for an input on {}", name_,
             g.device().str(), i, in.device.str());
    if (g.shape() != in.shape) {
      MB_CHECK(expands_to(in.shape, g.shape()),
               "[backward] {} returned an invalid gradient at index {}: got shape {} but expected "
               "a shape compatible with {}",
               name_, i, shape_str(g.shape()), shape_str(in.shape));
      g = sum_to(g, in.shape);
    }
  }
  return grads;
}

void Node::release() { fn_ = nullptr; }

AccumulateGrad::AccumulateGrad(const std::shared_ptr<TensorImpl>& leaf)
    : Node("AccumulateGrad", {}, nullptr, 1), leaf_(leaf) {}

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor> grad_outputs) {
  auto leaf_impl = leaf_.lock();
  const Tensor& g = grad_outputs[0];
  // A leaf whose requires_grad was turned off after the forward takes no gradient (as torch's).
  if (!leaf_impl || !leaf_impl->requires_grad || !g.defined()) return {};
  Tensor leaf(leaf_impl);
  MB_ASSERT(g.shape() == leaf.shape(), "gradient shape {} for a leaf of shape {}",
            shape_str(g.shape()), shape_str(leaf.shape()));
  const double w = grad_weight();
  Tensor existing = leaf.grad();
  if (existing.defined()) {
    accumulate_(existing, g, w);  // in place: the grad may be a view into an arena
  } else {
    Tensor fresh = zeros(leaf.shape(), {.dtype = leaf.dtype(), .device = leaf.device()});
    accumulate_(fresh, g, w);
    leaf.set_grad(fresh);
  }
  return {};
}

// ---- saved tensors -----------------------------------------------------------------------------

SavedTensor::SavedTensor(const Tensor& t, const char* op)
    : tensor_(t), version_(t.defined() ? t.version() : 0), op_(op) {}

Tensor SavedTensor::get() const {
  MB_CHECK(!taken_,
           "[backward] trying to backward through {} a second time: it wrote its gradient over "
           "a tensor it saved",
           op_);
  if (tensor_.defined()) {
    MB_CHECK(tensor_.version() == version_,
             "[autograd] a tensor that {} saved for backward was modified in place since "
             "(version {}, expected {}); clone it before modifying it",
             op_, tensor_.version(), version_);
  }
  return tensor_;
}

bool SavedTensor::only_handle() const {
  return !retaining_graph() && !taken_ && tensor_.defined() &&
         tensor_.impl_ptr().use_count() == 1 && tensor_.storage().use_count() == 1;
}

Tensor SavedTensor::take() {
  MB_ASSERT(!retaining_graph(), "[autograd] {} took a saved tensor of a retained graph", op_);
  Tensor t = get();
  tensor_ = Tensor();
  taken_ = true;
  return t;
}

// ---- recording ---------------------------------------------------------------------------------

bool needs_grad(const std::vector<Tensor>& inputs) {
  if (!grad_mode_enabled()) return false;
  return std::any_of(inputs.begin(), inputs.end(),
                     [](const Tensor& t) { return t.defined() && t.requires_grad(); });
}

bool needs_grad(std::initializer_list<Tensor> inputs) {
  return needs_grad(std::vector<Tensor>(inputs));
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  if (t.grad_fn()) return Edge{t.grad_fn(), t.impl()->output_nr};
  TensorImpl* impl = t.impl();
  std::shared_ptr<Node> acc = impl->grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    impl->grad_accumulator = acc;
  }
  return Edge{acc, 0};
}

void record_multi(const char* op, const std::vector<Tensor>& inputs, std::vector<Tensor>& outputs,
                  BackwardFn backward) {
  if (!needs_grad(inputs)) return;
  std::vector<Edge> edges;
  edges.reserve(inputs.size());
  for (const Tensor& t : inputs) edges.push_back(gradient_edge(t));
  set_history(outputs, std::make_shared<Node>(op, std::move(edges), std::move(backward),
                                              static_cast<int>(outputs.size()),
                                              input_meta(inputs)));
}

void set_history(std::vector<Tensor>& outputs, const std::shared_ptr<Node>& node) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].defined() || !is_floating(outputs[i].dtype())) continue;
    outputs[i].impl()->grad_fn = node;
    outputs[i].impl()->output_nr = static_cast<int>(i);
    outputs[i].impl()->requires_grad = true;
  }
}

void record(const char* op, const std::vector<Tensor>& inputs, Tensor& out,
            std::function<std::vector<Tensor>(const Tensor&)> backward) {
  if (!needs_grad(inputs)) return;
  std::vector<Tensor> outputs{out};
  record_multi(op, inputs, outputs,
               [backward = std::move(backward)](const std::vector<Tensor>& grads) {
                 return backward(grads[0]);
               });
}

bool accumulates_in_place(const Tensor& t) {
  if (!t.defined() || !t.requires_grad() || !t.is_leaf() || !t.grad().defined()) return false;
  return capture_slot(t.impl()) == nullptr;
}

Tensor grad_leaf(const Tensor& t) {
  return t.defined() && t.requires_grad() && t.is_leaf() ? t : Tensor();
}

Tensor in_place_grad(const Tensor& t) {
  if (!accumulates_in_place(t)) return Tensor();
  Tensor grad = t.grad();
  const DType dt = grad.dtype();
  const bool fits = grad.is_contiguous() && grad.shape() == t.shape() &&
                    (dt == t.dtype() || dt == DType::f32 || dt == DType::f64);
  return fits ? grad : Tensor();
}

void set_view_base(const Tensor& view, const Tensor& base) {
  const TensorImpl* b = base.impl();
  std::shared_ptr<TensorImpl> kept = b->no_grad_base;
  if (!kept && !grad_mode_enabled() && b->requires_grad) kept = base.impl_ptr();
  view.impl()->no_grad_base = std::move(kept);
}

void check_inplace(const Tensor& t, const char* op) {
  if (!grad_mode_enabled()) return;
  MB_CHECK(!t.requires_grad(),
           "[{}] in-place change of a tensor that requires grad; do it under NoGradGuard or on a "
           "detached copy",
           op);
  // Note [Views made under no_grad].
  const TensorImpl* base = t.impl()->no_grad_base.get();
  MB_CHECK(base == nullptr || !base->requires_grad,
           "[{}] in-place change, with grad mode on, of a view made under NoGradGuard of a tensor "
           "that requires grad; make the change under NoGradGuard too, or on a clone()",
           op);
}

// ---- the engine --------------------------------------------------------------------------------

namespace {

struct NodeOrder {
  bool operator()(const Node* a, const Node* b) const { return a->sequence_nr() < b->sequence_nr(); }
};

// Note [Summing gradients in place]: where two gradients reach the same input (a residual
// stream's branches, a tensor used twice), the engine adds the second into the first when nothing
// else can see the first: the buffer's handle is the only one on the tensor and on its memory (no
// view of it, no other buffer, no caller's variable, no node's saved tensor), and it is a dense
// tensor of the second's shape, dtype and device. The sum then costs no memory of its own, and an
// activation-sized buffer less is live while it runs. `slot += 1 * g` rounds as `slot + g` does
// (the product by 1 is exact, and 16-bit sums are rounded once from f32 either way), so the bits
// are those of the out-of-place sum, which every other case still takes.
bool can_add_in_place(const Tensor& slot, const Tensor& g) {
  return slot.impl_ptr().use_count() == 1 && slot.storage().use_count() == 1 &&
         slot.is_contiguous() && is_floating(slot.dtype()) && slot.dtype() == g.dtype() &&
         slot.shape() == g.shape() && slot.device() == g.device();
}

void add_into(Tensor& slot, const Tensor& g) {
  if (!slot.defined()) {
    slot = g;
    return;
  }
  std::optional<profiler::Scope> scope;
  if (profiler::enabled()) scope.emplace("grad_sum", g.device(), profiler::Nesting::always);
  if (can_add_in_place(slot, g)) {
    accumulate_(slot, g, 1.0);
  } else {
    slot = add(slot, g);
  }
}

// Times a node's run as "<op> backward" (Note [Profiler scopes]), on the device of its first
// incoming gradient; AccumulateGrad keeps its own name.
void open_scope(std::optional<profiler::Scope>& scope, const Node& node,
                const std::vector<Tensor>& grads) {
  Device device = kCPU;
  for (const Tensor& g : grads) {
    if (g.defined()) {
      device = g.device();
      break;
    }
  }
  const bool sink = dynamic_cast<const AccumulateGrad*>(&node) != nullptr;
  scope.emplace(node.name(), device, profiler::Nesting::always, sink ? "" : " backward");
}

// Runs the graph below roots. When `capture` is given, the gradients reaching those leaves' sinks
// are stored in `captured` instead of being accumulated.
void execute(std::vector<Tensor> roots, std::vector<Tensor> grad_roots,
             BackwardOptions options, const std::vector<Tensor>* capture,
             std::vector<Tensor>* captured) {
  MB_CHECK(roots.size() == grad_roots.size(), "[backward] {} roots but {} root gradients",
           roots.size(), grad_roots.size());
  NoGradGuard no_grad;  // backward formulas are not themselves recorded
  struct RestoreRetain {
    bool previous;
    ~RestoreRetain() { t_retaining_graph = previous; }
  } restore_retain{t_retaining_graph};
  t_retaining_graph = options.retain_graph;

  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  std::vector<std::shared_ptr<Node>> keep_alive;
  std::vector<Edge> root_edges;
  for (std::size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    MB_CHECK(r.requires_grad(), "[backward] the tensor does not require grad and has no grad_fn");
    Tensor g = grad_roots[i];
    if (!g.defined()) {
      MB_CHECK(r.numel() == 1, "[backward] grad can be created implicitly only for a one-element "
               "output, got shape {}", shape_str(r.shape()));
      g = ones(r.shape(), {.dtype = r.dtype(), .device = r.device()});
    } else {
      MB_CHECK(g.shape() == r.shape(), "[backward] gradient shape {} differs from output shape {}",
               shape_str(g.shape()), shape_str(r.shape()));
      MB_CHECK(g.device() == r.device(), "[backward] gradient on {} for an output on {}",
               g.device().str(), r.device().str());
      if (g.dtype() != r.dtype()) g = g.to(r.dtype());  // as torch: the output's dtype
    }
    Edge e = gradient_edge(r);
    root_edges.push_back(e);
    auto& buf = buffers[e.fn.get()];
    buf.resize(e.fn->num_outputs());
    add_into(buf[e.input_nr], g);
  }
  // From here on the buffers and the graph hold what is needed; dropping our handles lets the
  // roots and their gradients die as soon as the nodes that use them have run.
  roots.clear();
  grad_roots.clear();

  // Count, for every node reachable from the roots, how many edges lead into it.
  std::unordered_map<Node*, int> dependencies;
  std::vector<Node*> stack;
  std::unordered_set<Node*> seen;
  for (const Edge& e : root_edges) {
    if (seen.insert(e.fn.get()).second) stack.push_back(e.fn.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next_edges()) {
      if (!e.fn) continue;
      ++dependencies[e.fn.get()];
      if (seen.insert(e.fn.get()).second) stack.push_back(e.fn.get());
    }
  }

  // Note [Captures through checkpoints]: a grad() call captures its inputs' gradients wherever
  // they reach a sink, in this execute or in one it starts (a checkpointed segment's backward is a
  // grad() call of its own, run by a node of this graph, and the parameters inside the segment
  // reach their sinks there). Every frame of the chain is searched; the innermost that asks for a
  // leaf gets it, undone by the guard. Captured leaves are never written in place either.
  std::unordered_map<TensorImpl*, std::size_t> capture_index;
  CaptureFrame frame{&capture_index, captured, t_capture};
  struct RestoreCapture {
    const CaptureFrame* previous;
    ~RestoreCapture() { t_capture = previous; }
  } restore{t_capture};
  if (capture) {
    for (std::size_t i = 0; i < capture->size(); ++i) capture_index[(*capture)[i].impl()] = i;
    captured->assign(capture->size(), Tensor());
    t_capture = &frame;
  }

  std::priority_queue<Node*, std::vector<Node*>, NodeOrder> ready;
  for (const Edge& e : root_edges) {
    if (dependencies[e.fn.get()] == 0) {
      dependencies[e.fn.get()] = -1;  // queued
      ready.push(e.fn.get());
    }
    keep_alive.push_back(e.fn);
  }

  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    std::vector<Tensor> grads = std::move(buffers[node]);
    buffers.erase(node);
    grads.resize(node->num_outputs());

    if (t_capture != nullptr) {
      if (auto* acc = dynamic_cast<AccumulateGrad*>(node)) {
        auto leaf = acc->leaf();
        if (Tensor* slot = leaf ? capture_slot(leaf.get()) : nullptr; slot != nullptr) {
          add_into(*slot, grads[0]);
          continue;
        }
      }
    }
    // A node that no gradient reached (every one it was given undefined, as a custom node may
    // return) is not run, as torch's; the nodes below it still count it as done.
    std::vector<Tensor> input_grads;
    const bool reached =
        std::any_of(grads.begin(), grads.end(), [](const Tensor& g) { return g.defined(); });
    if (reached) {
      std::optional<profiler::Scope> scope;
      if (profiler::enabled()) open_scope(scope, *node, grads);
      input_grads = node->apply(std::move(grads));
    }
    if (!options.retain_graph) node->release();

    const auto& edges = node->next_edges();
    for (std::size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.fn) continue;
      if (i < input_grads.size() && input_grads[i].defined()) {
        auto& buf = buffers[e.fn.get()];
        buf.resize(e.fn->num_outputs());
        add_into(buf[e.input_nr], input_grads[i]);
      }
      if (--dependencies[e.fn.get()] == 0) ready.push(e.fn.get());
    }
  }
}

}  // namespace

void run_backward(std::vector<Tensor> roots, std::vector<Tensor> grad_roots,
                  BackwardOptions options) {
  execute(std::move(roots), std::move(grad_roots), options, nullptr, nullptr);
}

std::vector<Tensor> grad(std::vector<Tensor> roots, std::vector<Tensor> grad_roots,
                         const std::vector<Tensor>& inputs, BackwardOptions options) {
  for (const Tensor& t : inputs) {
    MB_CHECK(t.defined() && t.requires_grad() && t.is_leaf(),
             "[grad] inputs must be leaf tensors that require grad");
  }
  // An input named twice gets its gradient at every place it is named (one capture per leaf).
  std::vector<Tensor> unique;
  std::vector<std::size_t> place;  // inputs[i] is unique[place[i]]
  for (const Tensor& t : inputs) {
    std::size_t j = 0;
    while (j < unique.size() && unique[j].impl() != t.impl()) ++j;
    if (j == unique.size()) unique.push_back(t);
    place.push_back(j);
  }
  std::vector<Tensor> captured;
  execute(std::move(roots), std::move(grad_roots), options, &unique, &captured);
  std::vector<Tensor> out;
  for (std::size_t j : place) out.push_back(captured[j]);
  return out;
}

}  // namespace microbatch
