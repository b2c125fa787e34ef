// Tensor: a cheap handle to shape, strides, offset, dtype, device and shared Storage.
// Views share storage (and its version counter). Autograd state lives on the handle's impl.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "core/allocator.h"
#include "core/device.h"
#include "core/dtype.h"
#include "kernels/view.h"

namespace microbatch {

using Shape = std::vector<std::int64_t>;

/// The number of elements of `shape`; refuses, naming `op`, a count past int64's range (a shape
/// with a 0 holds nothing, whatever its other sizes, as torch).
std::int64_t shape_numel(const Shape& shape, const char* op = "tensor");
Shape contiguous_strides(const Shape& shape);
/// "(2, 3)".
std::string shape_str(const Shape& shape);
/// Wraps a possibly negative dim into [0, ndim); `op` names the caller in the error. A 0-d tensor
/// accepts dim 0 or -1, as PyTorch's reductions do, so a caller that then reads shape()[dim] must
/// refuse 0-d tensors first.
int wrap_dim(std::int64_t dim, int ndim, const char* op);
/// Wraps the position of a dim to insert into a tensor of ndim dims (unsqueeze, stack): one of
/// [-(ndim + 1), ndim], into [0, ndim].
int wrap_new_dim(std::int64_t dim, int ndim, const char* op);

/// Bytes on a device, returned to its allocator when the last tensor using them dies.
/// The version counter is bumped by in-place ops; autograd compares it on unpacking.
struct Storage {
  Storage(std::size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data = nullptr;
  std::size_t nbytes = 0;
  Device device;
  std::int64_t version = 0;
  // The allocator `data` came from and returns to: meta has one per backend it mirrors, and the
  // mirrored backend may change while the storage lives.
  Allocator* owner = nullptr;
};

class Node;
struct TensorImpl;

struct TensorOptions {
  DType dtype = DType::f32;
  Device device = kCPU;
  bool requires_grad = false;
};

struct BackwardOptions {
  bool retain_graph = false;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const;
  const Shape& strides() const;
  std::int64_t offset() const;
  std::int64_t size(std::int64_t dim) const;
  int dim() const;
  std::int64_t numel() const;
  DType dtype() const;
  Device device() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype()); }
  /// Row-major dense; an empty tensor is contiguous whatever its strides (nothing to misplace).
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const;
  bool same_storage(const Tensor& other) const { return storage() == other.storage(); }
  /// Pointer to the first element (offset applied); nullptr on meta.
  void* raw_data() const;
  /// Typed pointer to the first element; checks dtype and that the tensor is on the CPU.
  template <class T> T* data() const;
  /// The value of a one-element tensor, as a double.
  double item() const;
  /// The value as a T; an integer T reads an integer or bool element exactly (a double rounds
  /// past 2^53).
  template <class T>
  T item() const {
    if constexpr (std::is_integral_v<T>) {
      if (!is_floating(dtype())) return static_cast<T>(item_i64());
    }
    return static_cast<T>(item());
  }
  /// All values in row-major order as doubles (copies from any device but meta).
  std::vector<double> to_vector() const;
  kernels::StridedView kview() const;

  // autograd
  bool requires_grad() const;
  Tensor& requires_grad_(bool on = true);
  Tensor grad() const;
  /// Sets (or, given an undefined tensor, clears) the gradient that backward accumulates into. Any
  /// floating dtype is accepted, as accumulate_ converts: f32 accumulators for 16-bit weights,
  /// 16-bit ones for ParamStore's grad_dtype. It must be on this tensor's device and writable
  /// (no two elements in one memory location).
  void set_grad(const Tensor& grad) const;
  const std::shared_ptr<Node>& grad_fn() const;
  bool is_leaf() const;
  std::int64_t version() const { return storage()->version; }
  void bump_version() const { ++storage()->version; }
  /// Backpropagates from this tensor (a scalar, unless `grad` is given).
  void backward(const Tensor& grad = {}, BackwardOptions options = {}) const;
  void backward(BackwardOptions options) const { backward(Tensor(), options); }
  /// Same data, no history, requires_grad false.
  Tensor detach() const;

  // views (core/ops/view.cpp)
  Tensor view(const Shape& shape) const;
  Tensor reshape(const Shape& shape) const;
  Tensor transpose(std::int64_t dim0, std::int64_t dim1) const;
  /// Transpose of a 2-D tensor.
  Tensor t() const;
  Tensor permute(const std::vector<std::int64_t>& dims) const;
  /// Elements start, start+step, ... < end along dim (negative start/end count from the end).
  Tensor slice(std::int64_t dim, std::int64_t start, std::int64_t end, std::int64_t step = 1) const;
  /// Index `index` along dim, removing that dim.
  Tensor select(std::int64_t dim, std::int64_t index) const;
  Tensor expand(const Shape& shape) const;
  Tensor squeeze(std::int64_t dim) const;
  Tensor unsqueeze(std::int64_t dim) const;
  Tensor flatten(std::int64_t start_dim = 0, std::int64_t end_dim = -1) const;

  // copies
  Tensor contiguous() const;
  Tensor clone() const;
  Tensor to(Device device) const;
  Tensor to(DType dtype) const;
  Tensor to(Device device, DType dtype) const;

  // in place (not recorded by autograd; with grad mode on, refused on tensors that require grad
  // and on views made under no_grad of such tensors: Note [Views made under no_grad])
  Tensor& zero_();
  /// Sets every element to value, which an integer dtype must hold (holds_value).
  Tensor& fill_(double value);
  /// Copies src (broadcast, cast, across devices) into this tensor. A source that overlaps it in
  /// memory is read in full before anything is written.
  Tensor& copy_(const Tensor& src);

  std::string str() const;
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

 private:
  std::int64_t item_i64() const;  // the value of a one-element integer or bool tensor

  std::shared_ptr<TensorImpl> impl_;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape;
  Shape strides;
  std::int64_t offset = 0;  // in elements
  DType dtype = DType::f32;
  bool requires_grad = false;
  std::shared_ptr<TensorImpl> grad;
  std::shared_ptr<Node> grad_fn;  // null for leaves
  int output_nr = 0;              // which output of grad_fn this tensor is
  std::weak_ptr<Node> grad_accumulator;
  // Set on a view made under no_grad of a tensor that requires grad (or of such a view): that
  // tensor, whose requires_grad decides whether in-place ops may write this view in grad mode
  // (Note [Views made under no_grad] in core/autograd.h).
  std::shared_ptr<TensorImpl> no_grad_base;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);

/// Whether two elements of t share one memory location: a dim of size > 1 and stride 0, as expand
/// makes (the only repetition the view ops can produce). An empty tensor has none.
bool has_internal_overlap(const Tensor& t);
/// Whether writing a may change what reading b sees: shared storage whose byte spans meet.
bool may_overlap(const Tensor& a, const Tensor& b);
/// The same elements in the same places, of the same dtype (writing one into the other is a no-op).
bool same_elements(const Tensor& a, const Tensor& b);
/// Refuses t as the destination of an in-place write when has_internal_overlap(t): the result
/// would depend on the order in which its elements are written.
void check_no_internal_overlap(const char* op, const Tensor& t);

// ---- factories ---------------------------------------------------------------------------------
Tensor empty(const Shape& shape, TensorOptions options = {});
Tensor zeros(const Shape& shape, TensorOptions options = {});
Tensor ones(const Shape& shape, TensorOptions options = {});
/// Every element `value`, which an integer dtype must hold (holds_value).
Tensor full(const Shape& shape, double value, TensorOptions options = {});
/// start, start+step, ... < end; an integer dtype needs whole start, end and step (exact in int64).
Tensor arange(double start, double end, double step = 1.0, TensorOptions options = {});
/// Uniform in [0, 1), from the default Philox generator.
Tensor rand(const Shape& shape, TensorOptions options = {});
/// Standard normal, from the default Philox generator.
Tensor randn(const Shape& shape, TensorOptions options = {});
/// A tensor holding `values` (row-major), converted to options.dtype.
Tensor from_vector(const std::vector<double>& values, const Shape& shape, TensorOptions options = {});
/// A tensor with the shape and options of `like`.
Tensor empty_like(const Tensor& like);
Tensor zeros_like(const Tensor& like);
Tensor ones_like(const Tensor& like);
/// A 0-d tensor.
Tensor scalar_tensor(double value, TensorOptions options = {});

/// An uninitialized tensor whose storage is allocated on `device`, with explicit strides.
Tensor make_strided(std::shared_ptr<Storage> storage, const Shape& shape, const Shape& strides,
                    std::int64_t offset, DType dtype);

template <class T>
T* Tensor::data() const {
  MB_CHECK(dtype_of<T>::value == dtype(), "[data] tensor has dtype {}, asked for {}",
           dtype_name(dtype()), dtype_name(dtype_of<T>::value));
  MB_CHECK(device().is_cpu(), "[data] tensor is on {}, not cpu", device().str());
  return static_cast<T*>(raw_data());
}

}  // namespace microbatch
