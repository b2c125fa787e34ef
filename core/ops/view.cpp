// Views: new shape and strides over the same storage, no copy. Each backward maps the gradient
// back to the input's shape (overwrites; no saved tensors, only shapes).
#include <algorithm>
#include <numeric>
#include <optional>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/ops/dispatch.h"

namespace microbatch {

namespace {

Tensor as_view(const Tensor& base, const Shape& shape, const Shape& strides, std::int64_t offset) {
  Tensor view = make_strided(base.storage(), shape, strides, offset, base.dtype());
  set_view_base(view, base);  // Note [Views made under no_grad] in core/autograd.h
  return view;
}

// A view's shape must be one the kernels take (kview refuses more dims only at the next op).
void check_view_dims(const Shape& shape, const char* op) {
  MB_CHECK(static_cast<int>(shape.size()) <= kernels::kMaxDims,
           "[{}] at most {} dims are supported, got {} (shape {})", op, kernels::kMaxDims,
           shape.size(), shape_str(shape));
}

// Resolves one -1 in a requested shape against numel.
Shape infer_shape(const Shape& requested, std::int64_t numel, const char* op, const Shape& from) {
  check_view_dims(requested, op);
  Shape shape = requested;
  int infer = -1;
  std::int64_t known = 1;
  bool overflow = false, has_zero = false;  // a 0 among the sizes makes any overflow moot
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      MB_CHECK(infer < 0, "[{}] only one dimension can be -1, got {}", op, shape_str(requested));
      infer = static_cast<int>(i);
    } else {
      MB_CHECK(shape[i] >= 0, "[{}] invalid size in {}", op, shape_str(requested));
      has_zero |= shape[i] == 0;
      overflow |= __builtin_mul_overflow(known, shape[i], &known);
    }
  }
  // Checked: a wrapped product could match numel, and the view reach far past its storage.
  MB_CHECK(has_zero || !overflow, "[{}] shape {} has more elements than int64 can count", op,
           shape_str(requested));
  if (has_zero) known = 0;
  if (infer >= 0) {
    MB_CHECK(known != 0 && numel % known == 0, "[{}] cannot view {} as {}", op, shape_str(from),
             shape_str(requested));
    shape[infer] = numel / known;
  }
  MB_CHECK(shape_numel(shape) == numel, "[{}] shape {} is invalid for input of shape {} ({} elements)",
           op, shape_str(requested), shape_str(from), numel);
  return shape;
}

// Strides that show a tensor of (shape, strides) as `target` without moving data, or nullopt when
// the target would merge dims that are not laid out one after the other. Dims are consumed in
// chunks of memory-contiguous dims; within a chunk any split or merge is a view.
std::optional<Shape> view_strides(const Shape& shape, const Shape& strides, const Shape& target) {
  if (shape_numel(shape) == 0 || shape.empty()) return contiguous_strides(target);
  Shape out(target.size(), 1);
  int view_d = static_cast<int>(target.size()) - 1;
  std::int64_t chunk_base = strides.back();
  std::int64_t tensor_numel = 1, view_numel = 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    tensor_numel *= shape[d];
    const bool chunk_ends = d == 0 || (shape[d - 1] != 1 && strides[d - 1] != tensor_numel * chunk_base);
    if (!chunk_ends) continue;
    while (view_d >= 0 && (view_numel < tensor_numel || target[view_d] == 1)) {
      out[view_d] = view_numel * chunk_base;
      view_numel *= target[view_d];
      --view_d;
    }
    if (view_numel != tensor_numel) return std::nullopt;
    if (d > 0) {
      chunk_base = strides[d - 1];
      tensor_numel = 1;
      view_numel = 1;
    }
  }
  if (view_d != -1) return std::nullopt;
  return out;
}

}  // namespace

Tensor Tensor::view(const Shape& requested) const {
  const Shape shape = infer_shape(requested, numel(), "view", this->shape());
  std::optional<Shape> st = is_contiguous() ? contiguous_strides(shape) : view_strides(this->shape(), strides(), shape);
  MB_CHECK(st.has_value(), "[view] input of shape {} is not contiguous in the dims that {} merges; use reshape()",
           shape_str(this->shape()), shape_str(shape));
  Tensor out = as_view(*this, shape, *st, offset());
  record("view", {*this}, out, [from = this->shape()](const Tensor& g) {
    return std::vector<Tensor>{g.reshape(from)};
  });
  return out;
}

Tensor Tensor::reshape(const Shape& requested) const {
  if (is_contiguous()) return view(requested);
  const Shape shape = infer_shape(requested, numel(), "reshape", this->shape());
  if (view_strides(this->shape(), strides(), shape)) return view(shape);  // no copy needed
  return contiguous().view(shape);
}

Tensor Tensor::transpose(std::int64_t dim0, std::int64_t dim1) const {
  const int d0 = wrap_dim(dim0, dim(), "transpose"), d1 = wrap_dim(dim1, dim(), "transpose");
  if (dim() == 0) return *this;
  Shape shape = this->shape(), st = strides();
  std::swap(shape[d0], shape[d1]);
  std::swap(st[d0], st[d1]);
  Tensor out = as_view(*this, shape, st, offset());
  record("transpose", {*this}, out, [d0, d1](const Tensor& g) {
    return std::vector<Tensor>{g.transpose(d0, d1)};
  });
  return out;
}

Tensor Tensor::t() const {
  MB_CHECK(dim() == 2, "[t] expected a 2-d tensor, got shape {}", shape_str(shape()));
  return transpose(0, 1);
}

Tensor Tensor::permute(const std::vector<std::int64_t>& dims) const {
  MB_CHECK(static_cast<int>(dims.size()) == dim(), "[permute] {} dims given for a {}-d tensor",
           dims.size(), dim());
  std::vector<std::int64_t> inverse(dims.size(), -1);
  Shape shape(dims.size()), st(dims.size());
  for (std::size_t i = 0; i < dims.size(); ++i) {
    const int d = wrap_dim(dims[i], dim(), "permute");
    MB_CHECK(inverse[d] < 0, "[permute] dim {} repeated", d);
    inverse[d] = static_cast<std::int64_t>(i);
    shape[i] = this->shape()[d];
    st[i] = strides()[d];
  }
  Tensor out = as_view(*this, shape, st, offset());
  record("permute", {*this}, out, [inverse](const Tensor& g) {
    return std::vector<Tensor>{g.permute(inverse)};
  });
  return out;
}

Tensor Tensor::slice(std::int64_t dim_, std::int64_t start, std::int64_t end, std::int64_t step) const {
  MB_CHECK(dim() > 0, "[slice] cannot be applied to a 0-d tensor");
  const int d = wrap_dim(dim_, dim(), "slice");
  MB_CHECK(step > 0, "[slice] step must be positive, got {}", step);
  const std::int64_t n = shape()[d];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<std::int64_t>(start, 0, n);
  end = std::clamp<std::int64_t>(end, start, n);
  Shape shape = this->shape(), st = strides();
  // Not (end - start + step - 1) / step, which overflows for a step near int64's maximum.
  shape[d] = end == start ? 0 : (end - start - 1) / step + 1;
  // A dim of at most one element never steps, and stride * step could overflow there.
  if (shape[d] > 1) st[d] = strides()[d] * step;
  Tensor out = as_view(*this, shape, st, offset() + start * strides()[d]);
  record("slice", {*this}, out, [from = this->shape(), dtype = dtype(), d, start, end, step](const Tensor& g) {
    Tensor full_grad = zeros(from, {.dtype = dtype, .device = g.device()});
    full_grad.slice(d, start, end, step).copy_(g);
    return std::vector<Tensor>{full_grad};
  });
  return out;
}

Tensor Tensor::select(std::int64_t dim_, std::int64_t index) const {
  MB_CHECK(dim() > 0, "[select] cannot be applied to a 0-d tensor");
  const int d = wrap_dim(dim_, dim(), "select");
  const std::int64_t n = shape()[d];
  MB_CHECK(index >= -n && index < n, "[select] index {} out of range for dim {} of size {}", index, d, n);
  if (index < 0) index += n;
  return slice(d, index, index + 1).squeeze(d);
}

Tensor Tensor::expand(const Shape& target) const {
  MB_CHECK(target.size() >= shape().size(), "[expand] cannot expand shape {} to {}",
           shape_str(shape()), shape_str(target));
  if (target == shape()) return *this;
  const std::size_t lead = target.size() - shape().size();
  Shape st(target.size(), 0);
  Shape out_shape = target;
  for (std::size_t i = 0; i < target.size(); ++i) {
    MB_CHECK(target[i] >= -1, "[expand] invalid size {} in {}: sizes are >= 0, or -1 to keep a dim",
             target[i], shape_str(target));
    if (i < lead) {
      MB_CHECK(target[i] != -1,
               "[expand] the expanded size -1 is not allowed in the leading, new dim {} of {}", i,
               shape_str(target));
      continue;
    }
    const std::int64_t have = shape()[i - lead];
    if (target[i] == -1 || target[i] == have) {
      out_shape[i] = have;
      st[i] = strides()[i - lead];
    } else {
      MB_CHECK(have == 1, "[expand] cannot expand shape {} to {}", shape_str(shape()),
               shape_str(target));
    }
  }
  check_view_dims(out_shape, "expand");
  shape_numel(out_shape, "expand");  // refuses a count past int64, which numel() would wrap
  Tensor out = as_view(*this, out_shape, st, offset());
  record("expand", {*this}, out, [from = shape()](const Tensor& g) {
    return std::vector<Tensor>{sum_to(g, from)};
  });
  return out;
}

Tensor Tensor::squeeze(std::int64_t dim_) const {
  const int d = wrap_dim(dim_, dim(), "squeeze");
  if (dim() == 0 || shape()[d] != 1) return *this;
  Shape shape = this->shape(), st = strides();
  shape.erase(shape.begin() + d);
  st.erase(st.begin() + d);
  Tensor out = as_view(*this, shape, st, offset());
  record("squeeze", {*this}, out, [from = this->shape()](const Tensor& g) {
    return std::vector<Tensor>{g.reshape(from)};
  });
  return out;
}

Tensor Tensor::unsqueeze(std::int64_t dim_) const {
  const int d = wrap_new_dim(dim_, dim(), "unsqueeze");
  Shape shape = this->shape(), st = strides();
  const std::int64_t stride = d < dim() ? strides()[d] * this->shape()[d] : 1;
  shape.insert(shape.begin() + d, 1);
  st.insert(st.begin() + d, stride);
  check_view_dims(shape, "unsqueeze");
  Tensor out = as_view(*this, shape, st, offset());
  record("unsqueeze", {*this}, out, [from = this->shape()](const Tensor& g) {
    return std::vector<Tensor>{g.reshape(from)};
  });
  return out;
}

Tensor Tensor::flatten(std::int64_t start_dim, std::int64_t end_dim) const {
  if (dim() == 0) return reshape({1});
  const int s = wrap_dim(start_dim, dim(), "flatten"), e = wrap_dim(end_dim, dim(), "flatten");
  MB_CHECK(s <= e, "[flatten] start_dim {} is after end_dim {}", s, e);
  Shape shape(this->shape().begin(), this->shape().begin() + s);
  // Checked: with a 0 in another dim, the merged dims may hold more than int64 counts.
  shape.push_back(
      shape_numel(Shape(this->shape().begin() + s, this->shape().begin() + e + 1), "flatten"));
  shape.insert(shape.end(), this->shape().begin() + e + 1, this->shape().end());
  return reshape(shape);
}

}  // namespace microbatch
