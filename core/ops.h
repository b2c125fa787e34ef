// Every differentiable op, as a table of contents. Each family lives in core/ops/<family>.cpp:
// argument checks, output shape and dtype, dispatch to kernels, and the backward right below.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

#include "core/autograd.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace microbatch {

// ---- element-wise (core/ops/elementwise.cpp); binary ops broadcast and promote as torch -------
// (a 0-d operand decides the dtype only from a higher category: Note [0-d operands in promotion])
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
/// a ** b, element-wise.
Tensor pow(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, double exponent);
/// The larger element of each pair (NaN wins); as torch 1.13, the gradient goes to each side that
/// does not lose the comparison, halved at a tie, so to both sides of a pair with a NaN.
Tensor maximum(const Tensor& a, const Tensor& b);
/// The smaller element of each pair; the gradient as maximum's.
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor neg(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor sqrt(const Tensor& a);
/// 1 / sqrt(a).
Tensor rsqrt(const Tensor& a);
Tensor abs(const Tensor& a);
Tensor tanh(const Tensor& a);
/// 1 / (1 + exp(-a)).
Tensor sigmoid(const Tensor& a);
/// max(a, 0); the gradient at 0 is 0.
Tensor relu(const Tensor& a);
enum class GeluApproximate { None, Tanh };
/// a * Phi(a) (exact, erf) or its tanh approximation.
Tensor gelu(const Tensor& a, GeluApproximate approximate = GeluApproximate::None);
/// a * sigmoid(a).
Tensor silu(const Tensor& a);
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
/// cond ? a : b, element-wise with broadcasting; cond is bool.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
/// a with `value` wherever mask (bool, broadcast to a) is true.
Tensor masked_fill(const Tensor& a, const Tensor& mask, double value);
/// Conversion to another dtype; differentiable between floating dtypes.
Tensor cast(const Tensor& a, DType dtype);
/// In place, not recorded: dst += weight * src (src is cast to dst's dtype; shapes equal). As
/// copy_, refused with grad mode on for a dst that requires grad (or a no_grad view of one).
void accumulate_(Tensor& dst, const Tensor& src, double weight);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);

// ---- reductions (core/ops/reduce.cpp) ----------------------------------------------------------
struct ReduceOptions {
  bool keepdim = false;
};
/// Sum over dims (all dims when empty).
Tensor sum(const Tensor& a, const std::vector<std::int64_t>& dims = {}, ReduceOptions options = {});
Tensor mean(const Tensor& a, const std::vector<std::int64_t>& dims = {}, ReduceOptions options = {});
/// Largest value along dim; the gradient goes to the first maximal element.
Tensor max(const Tensor& a, std::int64_t dim, ReduceOptions options = {});
/// Largest value of all elements (0-d); the gradient is shared evenly among all the maximal
/// elements (all the NaNs when it is NaN), as torch.
Tensor max(const Tensor& a);
/// Index (i64) of the first largest value along dim.
Tensor argmax(const Tensor& a, std::int64_t dim, ReduceOptions options = {});
struct VarOptions {
  std::int64_t correction = 1;  // divide by N - correction (1 = unbiased, as torch.var)
  bool keepdim = false;
};
Tensor var(const Tensor& a, const std::vector<std::int64_t>& dims = {}, VarOptions options = {});
/// Sums a broadcast gradient back down to `shape` (the backward of broadcasting).
Tensor sum_to(const Tensor& a, const Shape& shape);

// ---- linear algebra (core/ops/linalg.cpp) ------------------------------------------------------
/// Matrix product with torch.matmul's rules: 1-D promotion, batch dims broadcast.
Tensor matmul(const Tensor& a, const Tensor& b);
/// x @ weight^T + bias; x (*, in), weight (out, in), bias (out) or undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {});
/// A transformer's MLP, linear(gelu(linear(x, w1, b1), Tanh), w2, b2): x (*, in), w1 (hidden, in),
/// b1 (hidden), w2 (out, hidden), b2 (out). On CUDA one node whose GEMMs apply the bias and GELU,
/// and in the backward GELU's derivative, in cuBLASLt's epilogues (Note [MLP in GEMM epilogues]);
/// elsewhere that composition.
Tensor gelu_mlp(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                const Tensor& b2);

// ---- shape (core/ops/shape.cpp; the views are Tensor methods, core/ops/view.cpp) ----------------
Tensor cat(const std::vector<Tensor>& tensors, std::int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, std::int64_t dim = 0);
/// Views of consecutive pieces of `a` along dim, as torch.split: pieces of split_size (the last
/// one smaller when split_size does not divide the dim), or of the given sizes (which must add up
/// to the dim). One backward node for all of them writes their gradients into one buffer of a's
/// shape (zeros where a piece got none), instead of a zero-filled buffer per piece.
std::vector<Tensor> split(const Tensor& a, std::int64_t split_size, std::int64_t dim = 0);
std::vector<Tensor> split(const Tensor& a, const std::vector<std::int64_t>& sizes,
                          std::int64_t dim = 0);
/// A braced list is sizes, as torch.split(a, [n]), even with one element: without this overload
/// split(a, {n}) would take {n} as a split_size.
inline std::vector<Tensor> split(const Tensor& a, std::initializer_list<std::int64_t> sizes,
                                 std::int64_t dim = 0) {
  return split(a, std::vector<std::int64_t>(sizes), dim);
}
/// torch.chunk: `chunks` pieces of ceil(size / chunks) along dim (fewer when they run out).
std::vector<Tensor> chunk(const Tensor& a, std::int64_t chunks, std::int64_t dim = 0);

// ---- indexing (core/ops/index.cpp) -------------------------------------------------------------
/// Rows of weight (V, C) picked by integer indices (*) -> (*, C).
Tensor embedding(const Tensor& weight, const Tensor& indices);
/// out[i][j] = a[index[i][j]][j] for dim 0, and so on (torch.gather).
Tensor gather(const Tensor& a, std::int64_t dim, const Tensor& index);
/// Entries of a along dim at the 1-D integer index.
Tensor index_select(const Tensor& a, std::int64_t dim, const Tensor& index);

// ---- neural-network functions (core/ops/nn.cpp) ------------------------------------------------
Tensor softmax(const Tensor& a, std::int64_t dim);
Tensor log_softmax(const Tensor& a, std::int64_t dim);
enum class Reduction { None, Sum, Mean };
struct CrossEntropyOptions {
  std::int64_t ignore_index = -100;
  Reduction reduction = Reduction::Mean;
  double label_smoothing = 0.0;
  /// The dtype of the returned loss: the logits' by default, as PyTorch. The kernels compute in f32
  /// (f64 for f64) whatever the logits, so a 16-bit model asks for f32 here to get its loss
  /// unrounded without an f32 copy of the logits (and of their gradient).
  std::optional<DType> loss_dtype;
};
/// Cross-entropy of logits (N, C) against class indices (N); mean over non-ignored targets.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, CrossEntropyOptions options = {});
/// Normalizes over the trailing dims `normalized_shape`; weight and bias may be undefined.
Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = {},
                  const Tensor& bias = {}, double eps = 1e-5);
/// Zeroes each element with probability p and scales the rest by 1 / (1 - p) (Philox draws).
Tensor dropout(const Tensor& x, double p);

// ---- attention (core/ops/attention.cpp) --------------------------------------------------------
struct AttentionOptions {
  bool causal = true;
  double dropout_p = 0.0;
  std::optional<double> scale;  // default 1 / sqrt(head_dim)
};
/// softmax(q k^T * scale + mask) v over (B, H, T, D) tensors.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    AttentionOptions options = {});

// ---- convolution and pooling (core/ops/conv.cpp) -----------------------------------------------
struct Conv2dOptions {
  std::int64_t stride = 1;
  std::int64_t padding = 0;
};
/// x (N, C, H, W), weight (O, C, kH, kW), bias (O) or undefined -> (N, O, H', W').
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = {},
              Conv2dOptions options = {});
struct MaxPool2dOptions {
  std::int64_t kernel_size = 2;
  std::int64_t stride = 0;  // 0 = kernel_size
  std::int64_t padding = 0;
};
Tensor max_pool2d(const Tensor& x, MaxPool2dOptions options = {});

}  // namespace microbatch
