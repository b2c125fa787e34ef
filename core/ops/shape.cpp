// Joining ops, cat and stack, and their inverse, split (and chunk). cat allocates its output once
// and copies each input into its slice; its backward hands each input its slice of the gradient (a
// view; overwrites, nothing saved but sizes). stack is cat of unsqueezed inputs, so it shares that
// backward. split's pieces are views; its backward is cat's forward: one buffer of the input's
// shape, each piece's gradient copied into its slice (overwrites), unless the gradients already
// are the slices of one such buffer (Note [Pieces that tile their input]).
#include <algorithm>

#include "core/autograd.h"
#include "core/ops.h"
#include "core/ops/dispatch.h"

namespace microbatch {

namespace {

// One dtype and one device for all; names the op and the offending tensor's index.
void check_same_kind(const char* op, const std::vector<Tensor>& tensors) {
  MB_CHECK(!tensors.empty(), "[{}] expected a non-empty list of tensors", op);
  const Tensor& first = tensors[0];
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    MB_CHECK(tensors[i].defined(), "[{}] tensor {} is undefined", op, i);
    MB_CHECK(tensors[i].dtype() == first.dtype(), "[{}] tensor {} has dtype {} but tensor 0 has {}",
             op, i, dtype_name(tensors[i].dtype()), dtype_name(first.dtype()));
    MB_CHECK(tensors[i].device() == first.device(),
             "[{}] tensor {} is on {} but tensor 0 is on {}", op, i, tensors[i].device().str(),
             first.device().str());
  }
}

// Note [Pieces that tile their input]: when split's pieces' gradients are the slices of one dense
// buffer of the input's shape (the fused attention writes dq, dk and dv so, Note [Attention
// outputs where the inputs lie] in core/ops/attention.cpp), that buffer is the input's gradient
// and nothing is copied. Every gradient must be defined and lie exactly where its slice of a dense
// tensor of shape `from` starting at the first one's offset would: then the slices cover that
// region once and nothing else.
Tensor tiled_gradient(const std::vector<Tensor>& grads, const Shape& from, DType dtype,
                      const std::vector<std::int64_t>& sizes, int d) {
  if (grads.empty() || !grads[0].defined()) return {};
  const Shape dense = contiguous_strides(from);
  const Tensor& first = grads[0];
  std::int64_t start = 0;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!g.defined() || !g.same_storage(first) || g.dtype() != dtype) return {};
    if (g.offset() != first.offset() + start * dense[d]) return {};
    for (std::size_t j = 0; j < from.size(); ++j) {
      const std::int64_t size = static_cast<int>(j) == d ? sizes[i] : from[j];
      if (g.shape()[j] != size) return {};
      if (size > 1 && g.strides()[j] != dense[j]) return {};
    }
    start += sizes[i];
  }
  return make_strided(first.storage(), from, dense, first.offset(), dtype);
}

}  // namespace

std::vector<Tensor> split(const Tensor& a, const std::vector<std::int64_t>& sizes, std::int64_t dim) {
  MB_CHECK(a.dim() > 0, "[split] a zero-dimensional tensor cannot be split");
  const int d = wrap_dim(dim, a.dim(), "split");
  std::int64_t total = 0;
  for (std::int64_t n : sizes) {
    MB_CHECK(n >= 0, "[split] split sizes must be non-negative, got {}", n);
    MB_CHECK(!__builtin_add_overflow(total, n, &total),
             "[split] split sizes {} add up to more than int64 holds, but dim {} of {} has size {}",
             shape_str(sizes), d, shape_str(a.shape()), a.shape()[d]);
  }
  MB_CHECK(total == a.shape()[d],
           "[split] split sizes add up to {} but dim {} of {} has size {}", total, d,
           shape_str(a.shape()), a.shape()[d]);
  std::vector<Tensor> pieces;
  {
    NoGradGuard no_grad;  // one node below records them all
    std::int64_t start = 0;
    for (std::int64_t n : sizes) {
      pieces.push_back(a.slice(d, start, start + n));
      start += n;
    }
  }
  for (const Tensor& p : pieces) set_view_base(p, a);  // as made in the caller's grad mode
  record_multi("split", {a}, pieces,
               [from = a.shape(), dtype = a.dtype(), device = a.device(), sizes,
                d](std::vector<Tensor> grads) {
                 if (Tensor tiled = tiled_gradient(grads, from, dtype, sizes, d); tiled.defined())
                   return std::vector<Tensor>{tiled};
                 Tensor full = empty(from, {.dtype = dtype, .device = device});  // overwritten
                 std::int64_t start = 0;
                 for (std::size_t i = 0; i < sizes.size(); ++i) {
                   Tensor slot = full.slice(d, start, start + sizes[i]);
                   if (grads[i].defined()) {
                     slot.copy_(grads[i]);
                   } else if (sizes[i] > 0) {
                     slot.zero_();
                   }
                   start += sizes[i];
                 }
                 return std::vector<Tensor>{full};
               });
  return pieces;
}

std::vector<Tensor> split(const Tensor& a, std::int64_t split_size, std::int64_t dim) {
  MB_CHECK(a.dim() > 0, "[split] a zero-dimensional tensor cannot be split");
  const std::int64_t n = a.shape()[wrap_dim(dim, a.dim(), "split")];
  MB_CHECK(split_size > 0 || (split_size == 0 && n == 0),
           "[split] split_size must be positive, got {}", split_size);
  std::vector<std::int64_t> sizes;
  // Stepped by the piece, not by split_size, which could take start past int64's range.
  for (std::int64_t start = 0; start < n; start += sizes.back())
    sizes.push_back(std::min(split_size, n - start));
  if (sizes.empty()) sizes.push_back(0);  // as torch: one empty piece of an empty dim
  return split(a, sizes, dim);
}

std::vector<Tensor> chunk(const Tensor& a, std::int64_t chunks, std::int64_t dim) {
  MB_CHECK(chunks > 0, "[chunk] chunks must be positive, got {}", chunks);
  MB_CHECK(a.dim() > 0, "[chunk] a zero-dimensional tensor cannot be chunked");
  const std::int64_t n = a.shape()[wrap_dim(dim, a.dim(), "chunk")];
  // ceil(n / chunks), without n + chunks - 1, which overflows for chunks near int64's maximum.
  return split(a, n == 0 ? 0 : (n - 1) / chunks + 1, dim);
}

Tensor cat(const std::vector<Tensor>& tensors, std::int64_t dim) {
  check_same_kind("cat", tensors);
  const Tensor& first = tensors[0];
  MB_CHECK(first.dim() > 0, "[cat] tensor 0 is zero-dimensional and cannot be concatenated");
  const int d = wrap_dim(dim, first.dim(), "cat");
  Shape out_shape = first.shape();
  out_shape[d] = 0;
  std::vector<std::int64_t> sizes;  // each input's extent along d
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const Shape& s = tensors[i].shape();
    bool match = s.size() == first.shape().size();
    for (std::size_t k = 0; match && k < s.size(); ++k) {
      match = static_cast<int>(k) == d || s[k] == first.shape()[k];
    }
    MB_CHECK(match, "[cat] tensor {} has shape {} but tensor 0 has shape {}; shapes must match "
             "except in dim {}", i, shape_str(s), shape_str(first.shape()), d);
    sizes.push_back(s[d]);
    MB_CHECK(!__builtin_add_overflow(out_shape[d], s[d], &out_shape[d]),
             "[cat] the sizes along dim {} add up to more than int64 holds", d);
  }

  Tensor out = empty(out_shape, {.dtype = first.dtype(), .device = first.device()});
  {
    NoGradGuard no_grad;  // the slices and copies are this op's own business
    std::int64_t start = 0;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      if (sizes[i] > 0) out.slice(d, start, start + sizes[i]).copy_(tensors[i]);
      start += sizes[i];
    }
  }

  record("cat", tensors, out, [sizes, d](const Tensor& g) {
    std::vector<Tensor> grads;
    std::int64_t start = 0;
    for (auto n : sizes) {
      grads.push_back(g.slice(d, start, start + n));
      start += n;
    }
    return grads;
  });
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, std::int64_t dim) {
  check_same_kind("stack", tensors);
  const Shape& first = tensors[0].shape();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    MB_CHECK(tensors[i].shape() == first,
             "[stack] tensor {} has shape {} but tensor 0 has shape {}; all shapes must be equal",
             i, shape_str(tensors[i].shape()), shape_str(first));
  }
  const int d = wrap_new_dim(dim, tensors[0].dim(), "stack");
  MB_CHECK(tensors[0].dim() < kernels::kMaxDims, "[stack] at most {} dims are supported, got {}",
           kernels::kMaxDims, tensors[0].dim() + 1);
  std::vector<Tensor> parts;  // each (..., 1, ...): views, so cat still allocates the only copy
  parts.reserve(tensors.size());
  for (const Tensor& t : tensors) parts.push_back(t.unsqueeze(d));
  return cat(parts, d);
}

}  // namespace microbatch
