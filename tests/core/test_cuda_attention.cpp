// Both CUDA attention paths for f16 and bf16 — the tensor-core kernels (kernels/attention_tc.h)
// and the f32-math kernels (MB_ATTENTION_KERNEL=simt) — against attention on the CPU in f32:
// partial tiles, T != S, padded and 128-wide heads, strided heads read 16 bytes at a time or
// element by element, causal and not, forward and backward; and reruns that must give the same
// bits. The CPU emulation in test_attention_tc.cpp checks the same tensor-core code without a GPU.
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "tests/core/harness.h"

using namespace microbatch;
using namespace microbatch::testing;
using kernels::cuda::AttentionKernel;

namespace {

using V = std::vector<Tensor>;

// Selects the kernel for a scope and restores the previous choice.
class KernelScope {
 public:
  explicit KernelScope(AttentionKernel kernel) : saved_(kernels::cuda::attention_kernel()) {
    kernels::cuda::set_attention_kernel(kernel);
  }
  ~KernelScope() { kernels::cuda::set_attention_kernel(saved_); }
  KernelScope(const KernelScope&) = delete;
  KernelScope& operator=(const KernelScope&) = delete;

 private:
  AttentionKernel saved_;
};

const char* kernel_name(AttentionKernel k) { return k == AttentionKernel::tensor ? "tensor" : "simt"; }

// A (B, H, rows, D) leaf in dt, or with heads_inner a (B, rows, H, D) leaf viewed as (B, H, rows,
// D) inside the op function, as a transformer's q, k, v are.
Tensor leaf(const Shape& shape, DType dt, std::uint64_t seed, double lo, double hi) {
  Tensor t = input(shape, lo, hi, seed).detach().to(dt);
  t.requires_grad_(true);
  return t;
}

// On the CPU in f32 whatever the dtype, on CUDA in the inputs' dtype.
OpFn attention(bool causal, bool heads_inner) {
  return [causal, heads_inner](const V& in) {
    V x = in;
    if (heads_inner) {
      for (Tensor& t : x) t = t.transpose(1, 2);
    }
    AttentionOptions options;
    options.causal = causal;
    if (!in[0].device().is_cpu()) return scaled_dot_product_attention(x[0], x[1], x[2], options);
    return scaled_dot_product_attention(x[0].to(DType::f32), x[1].to(DType::f32),
                                        x[2].to(DType::f32), options)
        .to(in[0].dtype());
  };
}

// GPT's attention (nn/models.cpp): q, k and v split from one (B, T, 3C) projection, their heads
// viewed as (B, H, T, D), the output back to (B, T, C). On CUDA the kernels read the three as
// strided views of one buffer and write their gradients as slices of one (B, T, 3C) buffer.
OpFn split_attention(std::int64_t heads) {
  return [heads](const V& in) {
    const Tensor& qkv = in[0];
    const std::int64_t b = qkv.shape()[0], t = qkv.shape()[1], c = qkv.shape()[2] / 3;
    const bool cpu = qkv.device().is_cpu();
    const std::vector<Tensor> parts = split(cpu ? qkv.to(DType::f32) : qkv, c, 2);
    V x;
    for (const Tensor& p : parts) x.push_back(p.reshape({b, t, heads, c / heads}).transpose(1, 2));
    AttentionOptions options;
    options.causal = true;
    const Tensor y = scaled_dot_product_attention(x[0], x[1], x[2], options);
    return y.transpose(1, 2).reshape({b, t, c}).to(qkv.dtype());
  };
}

struct Case {
  std::int64_t b, h, t, s, d;
  bool heads_inner = false;
};

std::string describe(const Case& c, DType dt, bool causal, AttentionKernel k) {
  return std::string(kernel_name(k)) + " " + dtype_name(dt) + " B" + std::to_string(c.b) + " H" +
         std::to_string(c.h) + " T" + std::to_string(c.t) + " S" + std::to_string(c.s) + " D" +
         std::to_string(c.d) + (c.heads_inner ? " heads inner" : "") + (causal ? " causal" : "");
}

V gpu_grads(const OpFn& f, const V& inputs) {
  V on_gpu;
  for (const Tensor& t : inputs) {
    Tensor g = t.detach().to(test_gpu());
    g.requires_grad_(true);
    on_gpu.push_back(g);
  }
  Tensor out = f(on_gpu);
  Tensor r = input(out.shape(), -1, 1, 99).detach().to(out.dtype()).to(test_gpu());
  sum(out * r).backward();
  V grads{out.detach().to(kCPU)};
  for (const Tensor& t : on_gpu) grads.push_back(t.grad().to(kCPU));
  return grads;
}

}  // namespace

MB_CUDA_TEST_CASE("cuda attention in f16 and bf16, tensor-core and f32-math kernels, against the CPU") {
  const std::vector<Case> cases = {
      {1, 2, 80, 80, 64},          // a full and a partial 64-row tile
      {2, 3, 17, 45, 64},          // T < S
      {1, 2, 70, 20, 32},          // T > S: queries past the last key, D = 32
      {2, 2, 1, 40, 64},           // T = 1
      {1, 1, 40, 40, 40},          // D padded to 64: element-wise tile loads
      {2, 1, 70, 70, 128},         // D = 128: 16-row walked tiles
      {2, 3, 130, 130, 64, true},  // (B, T, H, D) read as (B, H, T, D): strided 16-byte loads
      {1, 2, 300, 300, 64},        // several walked tiles per block
      {1, 1, 5, 5, 1},             // D = 1
      {1, 2, 70, 70, 96},          // D = 96: the 128-wide kernels, zero past D
  };
  for (AttentionKernel kernel : {AttentionKernel::tensor, AttentionKernel::simt}) {
    KernelScope scope(kernel);
    for (DType dt : {DType::bf16, DType::f16}) {
      for (const Case& c : cases) {
        const Shape qs = c.heads_inner ? Shape{c.b, c.t, c.h, c.d} : Shape{c.b, c.h, c.t, c.d};
        const Shape ks = c.heads_inner ? Shape{c.b, c.s, c.h, c.d} : Shape{c.b, c.h, c.s, c.d};
        Tensor q = leaf(qs, dt, 61, -2, 2), k = leaf(ks, dt, 62, -2, 2), v = leaf(ks, dt, 63, -1, 1);
        for (bool causal : {true, false}) {
          check_cuda_parity(describe(c, dt, causal, kernel), attention(causal, c.heads_inner),
                            {q, k, v}, parity_tolerance(dt));
        }
      }
    }
  }
}

MB_CUDA_TEST_CASE("cuda attention on q, k, v split from one projection, as GPT's heads are") {
  // The gradients come back as slices of one (B, T, 3C) buffer with rows 3C apart.
  for (AttentionKernel kernel : {AttentionKernel::tensor, AttentionKernel::simt}) {
    KernelScope scope(kernel);
    for (DType dt : {DType::bf16, DType::f16}) {
      for (const Case& c : {Case{2, 4, 70, 70, 64}, Case{1, 2, 33, 33, 32}}) {
        const Shape shape{c.b, c.t, 3 * c.h * c.d};
        check_cuda_parity(describe(c, dt, true, kernel) + " split from (B, T, 3C)",
                          split_attention(c.h), {leaf(shape, dt, 64, -2, 2)}, parity_tolerance(dt));
      }
    }
  }
}

MB_CUDA_TEST_CASE("cuda tensor-core attention gives the same bits on every run") {
  KernelScope scope(AttentionKernel::tensor);
  Tensor q = leaf({2, 200, 3, 64}, DType::bf16, 71, -2, 2),
         k = leaf({2, 200, 3, 64}, DType::bf16, 72, -2, 2),
         v = leaf({2, 200, 3, 64}, DType::bf16, 73, -1, 1);
  const V first = gpu_grads(attention(true, true), {q, k, v});
  const V second = gpu_grads(attention(true, true), {q, k, v});
  REQUIRE(first.size() == second.size());
  for (std::size_t i = 0; i < first.size(); ++i)
    CHECK_MESSAGE(first[i].to_vector() == second[i].to_vector(), "output or gradient " << i);
}
