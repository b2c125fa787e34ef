#include "core/tensor.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <ostream>
#include <sstream>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/ops/dispatch.h"
#include "core/rng.h"
#include "kernels/device.h"
#include "kernels/elementwise.h"
#include "kernels/index.h"

namespace microbatch {

// ---- shapes ------------------------------------------------------------------------------------

std::int64_t shape_numel(const Shape& shape, const char* op) {
  std::int64_t n = 1;
  bool overflow = false;
  for (auto s : shape) {
    if (s == 0) return 0;
    overflow |= __builtin_mul_overflow(n, s, &n);
  }
  // Checked: a wrapped count would let a view reach far past its storage.
  MB_CHECK(!overflow, "[{}] shape {} has more elements than int64 can count", op, shape_str(shape));
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  std::int64_t s = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    strides[i] = s;
    // Checked: a shape with a 0 holds nothing, yet its other dims can make strides past int64.
    MB_CHECK(i == 0 || !__builtin_mul_overflow(s, std::max<std::int64_t>(shape[i], 1), &s),
             "[tensor] shape {} has strides beyond int64's range", shape_str(shape));
  }
  return strides;
}

std::string shape_str(const Shape& shape) {
  std::string s = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

int wrap_dim(std::int64_t dim, int ndim, const char* op) {
  const int n = std::max(ndim, 1);
  MB_CHECK(dim >= -n && dim < n, "[{}] dim {} out of range for a {}-d tensor", op, dim, ndim);
  return static_cast<int>(dim < 0 ? dim + n : dim);
}

int wrap_new_dim(std::int64_t dim, int ndim, const char* op) {
  MB_CHECK(dim >= -(ndim + 1) && dim <= ndim,
           "[{}] dim {} out of range for a {}-d tensor: a new dim goes at {} to {}", op, dim, ndim,
           -(ndim + 1), ndim);
  return static_cast<int>(dim < 0 ? dim + ndim + 1 : dim);
}

namespace {
thread_local Backend g_meta_backend = Backend::cpu;
}  // namespace

Backend meta_backend() { return g_meta_backend; }
void set_meta_backend(Backend backend) { g_meta_backend = backend; }

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const std::size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    std::int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    MB_CHECK(da == db || da == 1 || db == 1, "[{}] shapes {} and {} cannot be broadcast", op,
             shape_str(a), shape_str(b));
    out[i] = da == 1 ? db : da;
  }
  return out;
}

void check_same_device(const char* op, std::initializer_list<Tensor> tensors) {
  const Tensor* first = nullptr;
  for (const Tensor& t : tensors) {
    if (!t.defined()) continue;
    if (first == nullptr) {
      first = &t;
      continue;
    }
    MB_CHECK(t.device() == first->device(), "[{}] tensors on different devices: {} and {}", op,
             first->device().str(), t.device().str());
  }
}

void check_floating(const char* op, const Tensor& t) {
  MB_CHECK(is_floating(t.dtype()), "[{}] expected a floating-point tensor, got {}", op,
           dtype_name(t.dtype()));
}

void check_fill_value(const char* op, DType dtype, double value) {
  MB_CHECK(!is_integer(dtype) || holds_value(dtype, value),
           "[{}] value {} does not fit dtype {}: an integer dtype holds whole numbers in its range",
           op, value, dtype_name(dtype));
}

// ---- storage -----------------------------------------------------------------------------------

Storage::Storage(std::size_t bytes, Device dev)
    : nbytes(bytes), device(dev), owner(&allocator(dev)) {
  data = owner->allocate(bytes);
}

Storage::~Storage() { owner->free(data); }

// ---- tensor accessors --------------------------------------------------------------------------

namespace {
const TensorImpl& checked(const std::shared_ptr<TensorImpl>& impl) {
  MB_CHECK(impl != nullptr, "[tensor] use of an undefined tensor");
  return *impl;
}
}  // namespace

const Shape& Tensor::shape() const { return checked(impl_).shape; }
const Shape& Tensor::strides() const { return checked(impl_).strides; }
std::int64_t Tensor::offset() const { return checked(impl_).offset; }
int Tensor::dim() const { return static_cast<int>(shape().size()); }
std::int64_t Tensor::numel() const { return shape_numel(shape()); }
DType Tensor::dtype() const { return checked(impl_).dtype; }
Device Tensor::device() const { return checked(impl_).storage->device; }
const std::shared_ptr<Storage>& Tensor::storage() const { return checked(impl_).storage; }

std::int64_t Tensor::size(std::int64_t d) const {
  MB_CHECK(dim() > 0, "[size] dimension specified as {} but the tensor has no dimensions", d);
  return shape()[wrap_dim(d, dim(), "size")];
}

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;
  std::int64_t expected = 1;
  for (int i = dim() - 1; i >= 0; --i) {
    if (shape()[i] != 1 && strides()[i] != expected) return false;
    expected *= shape()[i];
  }
  return true;
}

void* Tensor::raw_data() const {
  const auto& st = storage();
  if (st->data == nullptr || device().is_meta()) return nullptr;
  return static_cast<char*>(st->data) + offset() * static_cast<std::int64_t>(dtype_size(dtype()));
}

kernels::StridedView Tensor::kview() const {
  MB_CHECK(dim() <= kernels::kMaxDims, "[tensor] at most {} dims are supported, got {}",
           kernels::kMaxDims, dim());
  kernels::StridedView v;
  v.data = raw_data();
  v.dtype = dtype();
  v.ndim = dim();
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = shape()[i];
    v.strides[i] = strides()[i];
  }
  return v;
}

double Tensor::item() const {
  MB_CHECK(numel() == 1, "[item] expected a one-element tensor, got shape {}", shape_str(shape()));
  return to_vector()[0];
}

std::int64_t Tensor::item_i64() const {
  MB_CHECK(numel() == 1, "[item] expected a one-element tensor, got shape {}", shape_str(shape()));
  MB_ASSERT(!is_floating(dtype()), "[item] item_i64 of a {} tensor", dtype_name(dtype()));
  MB_CHECK(!device().is_meta(), "[item] a meta tensor has no values");
  return to(kCPU, DType::i64).data<std::int64_t>()[0];
}

std::vector<double> Tensor::to_vector() const {
  MB_CHECK(!device().is_meta(), "[to_vector] a meta tensor has no values");
  Tensor c = to(kCPU, DType::f64).contiguous();
  const double* p = static_cast<const double*>(c.raw_data());
  return std::vector<double>(p, p + c.numel());
}

// ---- autograd accessors ------------------------------------------------------------------------

bool Tensor::requires_grad() const { return checked(impl_).requires_grad; }

Tensor& Tensor::requires_grad_(bool on) {
  MB_CHECK(!on || is_floating(dtype()), "[requires_grad_] only floating-point tensors can require "
           "grad, got {}", dtype_name(dtype()));
  MB_CHECK(is_leaf() || on, "[requires_grad_] cannot turn off requires_grad of a non-leaf tensor; "
           "use detach()");
  impl_->requires_grad = on;
  return *this;
}

Tensor Tensor::grad() const { return Tensor(checked(impl_).grad); }

void Tensor::set_grad(const Tensor& g) const {
  checked(impl_);
  if (g.defined()) {
    MB_CHECK(g.shape() == shape(), "[set_grad] grad shape {} differs from tensor shape {}",
             shape_str(g.shape()), shape_str(shape()));
    // Backward adds into the grad with accumulate_, which takes any floating pair and nothing else.
    MB_CHECK(is_floating(dtype()) && is_floating(g.dtype()),
             "[set_grad] grad dtype {} for a tensor of dtype {}: backward accumulates only "
             "floating-point grads of floating-point tensors",
             dtype_name(g.dtype()), dtype_name(dtype()));
    MB_CHECK(g.device() == device(), "[set_grad] grad is on {}, the tensor on {}",
             g.device().str(), device().str());
    check_no_internal_overlap("set_grad", g);
  }
  impl_->grad = g.impl_ptr();
}

const std::shared_ptr<Node>& Tensor::grad_fn() const { return checked(impl_).grad_fn; }
bool Tensor::is_leaf() const { return grad_fn() == nullptr; }

void Tensor::backward(const Tensor& g, BackwardOptions options) const {
  run_backward({*this}, {g}, options);
}

Tensor Tensor::detach() const {
  return make_strided(storage(), shape(), strides(), offset(), dtype());
}

// ---- copies ------------------------------------------------------------------------------------

Tensor make_strided(std::shared_ptr<Storage> storage, const Shape& shape, const Shape& strides,
                    std::int64_t offset, DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->shape = shape;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor out = empty(shape(), {.dtype = dtype(), .device = device()});
  {
    NoGradGuard no_grad;
    out.copy_(*this);
  }
  record("clone", {*this}, out, [](const Tensor& g) { return std::vector<Tensor>{g}; });
  return out;
}

Tensor Tensor::to(DType dt) const { return cast(*this, dt); }

Tensor Tensor::to(Device dev) const { return to(dev, dtype()); }

Tensor Tensor::to(Device dev, DType dt) const {
  if (dev == device()) return cast(*this, dt);
  Tensor out = empty(shape(), {.dtype = dt, .device = dev});
  {
    NoGradGuard no_grad;
    out.copy_(*this);
  }
  const Device from = device();
  const DType from_dtype = dtype();
  record("to", {*this}, out, [from, from_dtype](const Tensor& g) {
    return std::vector<Tensor>{g.to(from, from_dtype)};
  });
  return out;
}

namespace {

// Copies between a CUDA device and the host move raw bytes between contiguous buffers: each side
// converts and re-strides on its own, staging through a contiguous temporary where needed.

// The bytes [first, last] of its storage that a non-empty tensor's elements lie within.
std::pair<std::int64_t, std::int64_t> byte_span(const Tensor& t) {
  std::int64_t first = t.offset(), last = t.offset();
  for (int i = 0; i < t.dim(); ++i) {
    const std::int64_t reach = t.strides()[i] * (t.shape()[i] - 1);
    (reach < 0 ? first : last) += reach;
  }
  const auto size = static_cast<std::int64_t>(dtype_size(t.dtype()));
  return {first * size, (last + 1) * size - 1};
}

// dst on CUDA, src on the host (already of dst's shape).
void copy_host_to_cuda(const Tensor& dst, const Tensor& src) {
  const int device = dst.device().index;
  Tensor host = src;  // contiguous, in dst's dtype
  if (host.dtype() != dst.dtype() || !host.is_contiguous()) {
    host = empty(src.shape(), {.dtype = dst.dtype()});
    kernels::cpu::copy(host.kview(), src.kview());
  }
  Tensor target = dst.is_contiguous()
                      ? dst
                      : empty(dst.shape(), {.dtype = dst.dtype(), .device = dst.device()});
  kernels::cuda::memcpy_host_to_device(target.raw_data(), host.raw_data(), host.nbytes(), device);
  if (!target.same_storage(dst)) {
    kernels::cuda::set_device(device);
    kernels::cuda::copy(dst.kview(), target.kview());
  }
}

// dst on the host, src on CUDA (already of dst's shape, not empty). Waits for the device, so it
// raises a pending index error (Note [Deferred index errors] in kernels/index.h). The bytes that
// src's elements lie within come over as they are and are re-strided on the host, straight into
// dst where they already are dst's layout and dtype: a view within twice its bytes (padded 16-bit
// rows, Note [Padded rows]; a transposed view) so takes no device memory, where GPT-2's padded
// logits for predict() would otherwise stage a second copy of themselves on the device. A sparser
// view is gathered on the device first.
void copy_cuda_to_host(const Tensor& dst, const Tensor& src) {
  const int device = src.device().index;
  auto span_of = [](const Tensor& t) {
    const auto [first, last] = byte_span(t);
    return std::pair{first, last - first + 1};
  };
  Tensor from = src;  // what comes over: src, or a dense copy of a sparse view of it
  if (span_of(src).second > 2 * static_cast<std::int64_t>(src.nbytes())) {
    from = empty(src.shape(), {.dtype = src.dtype(), .device = src.device()});
    kernels::cuda::set_device(device);
    kernels::cuda::copy(from.kview(), src.kview());
  }
  const auto [first, span] = span_of(from);
  const bool direct = from.is_contiguous() && dst.is_contiguous() && dst.dtype() == from.dtype();
  const auto size = static_cast<std::int64_t>(dtype_size(from.dtype()));
  const Tensor host = direct ? dst : empty({span / size}, {.dtype = from.dtype()});
  kernels::cuda::memcpy_device_to_host(host.raw_data(),
                                       static_cast<const char*>(from.storage()->data) + first,
                                       static_cast<std::size_t>(span), device);
  kernels::cuda::raise_pending_index_error(device);
  if (!direct) {
    const Tensor bytes = make_strided(host.storage(), from.shape(), from.strides(),
                                      from.offset() - first / size, from.dtype());
    kernels::cpu::copy(dst.kview(), bytes.kview());
  }
}

// Both on one CUDA device: one kernel (or memcpy) converts and re-strides. The source does not
// overlap the destination (copy_ stages it otherwise).
void copy_on_cuda(const Tensor& dst, const Tensor& src) {
  kernels::cuda::set_device(dst.device().index);
  kernels::cuda::copy(dst.kview(), src.kview());
}

}  // namespace

// Interleaved views that touch no common element count as overlapping; staging them is only slower.
bool may_overlap(const Tensor& a, const Tensor& b) {
  if (!a.same_storage(b)) return false;
  const auto [a_first, a_last] = byte_span(a);
  const auto [b_first, b_last] = byte_span(b);
  return a_first <= b_last && b_first <= a_last;
}

// The same elements, in the same places, of the same dtype: copying one into the other is a no-op.
bool same_elements(const Tensor& a, const Tensor& b) {
  return a.same_storage(b) && a.offset() == b.offset() && a.dtype() == b.dtype() &&
         a.shape() == b.shape() && a.strides() == b.strides();
}

bool has_internal_overlap(const Tensor& t) {
  if (t.numel() == 0) return false;
  for (int i = 0; i < t.dim(); ++i)
    if (t.shape()[i] > 1 && t.strides()[i] == 0) return true;
  return false;
}

void check_no_internal_overlap(const char* op, const Tensor& t) {
  MB_CHECK(!has_internal_overlap(t),
           "[{}] more than one element of the written-to tensor (shape {}, strides {}) refers to a "
           "single memory location; clone() it before writing",
           op, shape_str(t.shape()), shape_str(t.strides()));
}

Tensor& Tensor::copy_(const Tensor& src) {
  check_inplace(*this, "copy_");
  Shape b = broadcast_shapes(shape(), src.shape(), "copy_");
  MB_CHECK(b == shape(), "[copy_] cannot copy a tensor of shape {} into one of shape {}",
           shape_str(src.shape()), shape_str(shape()));
  check_no_internal_overlap("copy_", *this);
  const Device dst_dev = device(), src_dev = src.device();
  if (dst_dev.is_meta() || src_dev.is_meta()) {
    MB_CHECK(dst_dev.is_meta(), "[copy_] cannot copy from meta (no data) to {}", dst_dev.str());
    bump_version();
    return *this;
  }
  if (numel() > 0 && !same_elements(*this, src)) {
    NoGradGuard no_grad;  // the expand and any staging are not part of a graph
    // Its kernels and copies run here rather than through launch(): timed here, on the stream
    // of the CUDA side if any (Note [Profiler scopes] in core/profiler.h).
    std::optional<profiler::Scope> scope;
    if (profiler::enabled())
      scope.emplace("copy_", dst_dev.is_cuda() ? dst_dev : src_dev, profiler::Nesting::outermost_only);
    // The kernels write elements while reading others (on CUDA in no order), so a source that
    // overlaps the destination, as a.copy_(a.t()), is read in full into a temporary first.
    const Tensor s = (may_overlap(*this, src) ? src.clone() : src).expand(shape());
    if (dst_dev.is_cpu() && src_dev.is_cpu()) {
      kernels::cpu::copy(kview(), s.kview());
    } else if (src_dev.is_cpu()) {
      copy_host_to_cuda(*this, s);
    } else if (dst_dev.is_cpu()) {
      copy_cuda_to_host(*this, s);
    } else if (dst_dev.index == src_dev.index) {
      copy_on_cuda(*this, s);
    } else {  // between two GPUs, through host memory
      Tensor host = empty(shape(), {.dtype = s.dtype()});
      copy_cuda_to_host(host, s);
      copy_host_to_cuda(*this, host);
    }
  }
  bump_version();
  return *this;
}

Tensor& Tensor::zero_() { return fill_(0.0); }

// An expanded destination is allowed, as in PyTorch: its repeated locations all get the same
// value, so the order of the writes does not matter.
Tensor& Tensor::fill_(double value) {
  check_inplace(*this, "fill_");
  check_fill_value("fill_", dtype(), value);
  if (numel() > 0) {  // an empty tensor may have no data pointer to write through
    launch(
        "fill_", device(), [&] { kernels::cpu::fill(kview(), value); },
        [&] {
          if (value == 0.0 && !std::signbit(value) && is_contiguous()) {
            // +0 is all-zero bits in every dtype.
            kernels::cuda::memset_zero(raw_data(), nbytes(), device().index);
          } else {
            kernels::cuda::fill(kview(), value);
          }
        });
  }
  bump_version();
  return *this;
}

// ---- factories ---------------------------------------------------------------------------------

Tensor empty(const Shape& shape, TensorOptions options) {
  for (auto s : shape) MB_CHECK(s >= 0, "[empty] negative size in shape {}", shape_str(shape));
  MB_CHECK(static_cast<int>(shape.size()) <= kernels::kMaxDims,
           "[empty] at most {} dims are supported, got {}", kernels::kMaxDims, shape.size());
  // Multiplied with overflow checks: a size that wrapped around would allocate a small buffer for
  // a huge tensor.
  std::int64_t bytes = 0;
  if (std::find(shape.begin(), shape.end(), 0) == shape.end()) {
    bytes = static_cast<std::int64_t>(dtype_size(options.dtype));
    for (auto s : shape) {
      MB_CHECK(!__builtin_mul_overflow(bytes, s, &bytes),
               "[empty] shape {} of {} needs more than 2^63 bytes", shape_str(shape),
               dtype_name(options.dtype));
    }
  }
  auto storage = std::make_shared<Storage>(static_cast<std::size_t>(bytes), options.device);
  Tensor t = make_strided(std::move(storage), shape, contiguous_strides(shape), 0, options.dtype);
  if (options.requires_grad) t.requires_grad_(true);
  return t;
}

Tensor full(const Shape& shape, double value, TensorOptions options) {
  check_fill_value("full", options.dtype, value);
  const bool rg = options.requires_grad;
  options.requires_grad = false;
  Tensor t = empty(shape, options);
  if (!t.device().is_meta()) t.fill_(value);
  if (rg) t.requires_grad_(true);
  return t;
}

Tensor zeros(const Shape& shape, TensorOptions options) { return full(shape, 0.0, options); }
Tensor ones(const Shape& shape, TensorOptions options) { return full(shape, 1.0, options); }
Tensor empty_like(const Tensor& like) { return empty(like.shape(), {.dtype = like.dtype(), .device = like.device()}); }
Tensor zeros_like(const Tensor& like) { return zeros(like.shape(), {.dtype = like.dtype(), .device = like.device()}); }
Tensor ones_like(const Tensor& like) { return ones(like.shape(), {.dtype = like.dtype(), .device = like.device()}); }
Tensor scalar_tensor(double value, TensorOptions options) {
  check_fill_value("scalar_tensor", options.dtype, value);
  return full({}, value, options);
}

Tensor from_vector(const std::vector<double>& values, const Shape& shape, TensorOptions options) {
  MB_CHECK(static_cast<std::int64_t>(values.size()) == shape_numel(shape, "from_vector"),
           "[from_vector] {} values do not fill shape {}", values.size(), shape_str(shape));
  // A meta target stages on meta (without values), so that its allocations mirror a CPU target's.
  const Device stage = options.device.is_meta() ? kMeta : kCPU;
  Tensor host = empty(shape, {.dtype = DType::f64, .device = stage});
  if (!stage.is_meta()) std::copy(values.begin(), values.end(), static_cast<double*>(host.raw_data()));
  Tensor t = host.to(options.device, options.dtype);
  if (t.same_storage(host)) t = t.clone();
  if (options.requires_grad) t.requires_grad_(true);
  return t;
}

Tensor arange(double start, double end, double step, TensorOptions options) {
  MB_CHECK(std::isfinite(start) && std::isfinite(end), "[arange] unsupported range: {} -> {}",
           start, end);
  MB_CHECK(std::isfinite(step) && step != 0.0, "[arange] step must be nonzero and finite, got {}",
           step);
  // An integer dtype needs whole bounds and step. torch truncates fractions, and its integer
  // dtypes disagree on the count (arange(0, 5, 1.5) has 5 elements in int64, 4 in int32).
  MB_CHECK(!is_integer(options.dtype) ||
               (start == std::trunc(start) && end == std::trunc(end) && step == std::trunc(step)),
           "[arange] {} needs whole start, end and step, got {} -> {} in steps of {}",
           dtype_name(options.dtype), start, end, step);
  // Counted in double first: converting a count beyond int64's range to int64 is undefined.
  const double count = std::ceil((end - start) / step);
  MB_CHECK(count < 0x1p63,
           "[arange] {} -> {} in steps of {} has {} elements, more than int64 counts", start, end,
           step, count);
  const std::int64_t n = count > 0 ? static_cast<std::int64_t>(count) : 0;
  // An integer dtype with a whole start and step counts in int64: start + i * step in double
  // rounds past 2^53 (2^53 + 1 would repeat 2^53).
  const bool exact =
      is_integer(options.dtype) && holds_value(DType::i64, start) && holds_value(DType::i64, step);
  // Written into a tensor, not a std::vector, so that a count too large for memory is the
  // allocator's clear error. A meta target stages on meta, as from_vector does.
  const Device stage = options.device.is_meta() ? kMeta : kCPU;
  Tensor values = empty({n}, {.dtype = exact ? DType::i64 : DType::f64, .device = stage});
  if (!stage.is_meta() && exact) {
    const auto first = static_cast<std::int64_t>(start), stride = static_cast<std::int64_t>(step);
    std::int64_t* v = values.data<std::int64_t>();
    for (std::int64_t i = 0; i < n; ++i) {
      MB_CHECK(
          !__builtin_mul_overflow(i, stride, &v[i]) && !__builtin_add_overflow(first, v[i], &v[i]),
          "[arange] {} -> {} in steps of {} passes int64's range", start, end, step);
    }
  } else if (!stage.is_meta()) {
    double* v = static_cast<double*>(values.raw_data());
    for (std::int64_t i = 0; i < n; ++i) v[i] = start + static_cast<double>(i) * step;
  }
  Tensor t = values.to(options.device, options.dtype);
  if (options.requires_grad) t.requires_grad_(true);
  return t;
}

namespace {
using RandomKernel = void (*)(const kernels::StridedView&, kernels::PhiloxArgs);

// Both kernels give the same values for the same Philox arguments (core/rng.h).
Tensor random_tensor(const Shape& shape, TensorOptions options, int values_per_block,
                     RandomKernel cpu_kernel, RandomKernel cuda_kernel) {
  MB_CHECK(is_floating(options.dtype), "[rand] expected a floating dtype, got {}",
           dtype_name(options.dtype));
  const bool rg = options.requires_grad;
  options.requires_grad = false;
  Tensor t = empty(shape, options);
  const std::uint64_t n = static_cast<std::uint64_t>(t.numel());
  GeneratorState st = default_generator().state();
  const std::uint64_t offset = default_generator().reserve((n + values_per_block - 1) / values_per_block);
  kernels::PhiloxArgs args{st.seed, offset};
  launch(
      "rand", t.device(), [&] { cpu_kernel(t.kview(), args); },
      [&] { cuda_kernel(t.kview(), args); });
  if (rg) t.requires_grad_(true);
  return t;
}
}  // namespace

Tensor rand(const Shape& shape, TensorOptions options) {
  return random_tensor(shape, options, 4, &kernels::cpu::rand_uniform, &kernels::cuda::rand_uniform);
}

Tensor randn(const Shape& shape, TensorOptions options) {
  return random_tensor(shape, options, 2, &kernels::cpu::rand_normal, &kernels::cuda::rand_normal);
}

// ---- printing ----------------------------------------------------------------------------------

std::string Tensor::str() const {
  if (!defined()) return "tensor(undefined)";
  std::ostringstream os;
  os << "tensor(";
  if (device().is_meta()) {
    os << "..., ";
  } else {
    std::vector<double> v = to_vector();
    const Shape& s = shape();
    // Nested brackets, at most 6 values per row and 6 rows per block.
    std::function<void(int, std::int64_t)> rec = [&](int d, std::int64_t base) {
      if (d == dim()) {
        os << fmt::format("{:.4g}", v[base]);
        return;
      }
      std::int64_t inner = 1;
      for (int k = d + 1; k < dim(); ++k) inner *= s[k];
      os << "[";
      for (std::int64_t i = 0; i < s[d]; ++i) {
        if (s[d] > 6 && i == 3) {
          os << "..., ";
          i = s[d] - 3;
        }
        rec(d + 1, base + i * inner);
        if (i + 1 < s[d]) os << ", ";
      }
      os << "]";
    };
    if (numel() > 0 || dim() == 0) rec(0, 0); else os << "[]";
    os << ", ";
  }
  os << "shape=" << shape_str(shape()) << ", dtype=" << dtype_name(dtype());
  if (!device().is_cpu()) os << ", device=" << device().str();
  if (grad_fn()) os << ", grad_fn=" << grad_fn()->name();
  else if (requires_grad()) os << ", requires_grad=true";
  os << ")";
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& t) { return os << t.str(); }

}  // namespace microbatch
