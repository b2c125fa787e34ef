// Causal attention at GPT-2 small's shape, (B, 12, 1024, 64) bf16: the fused kernel's forward and
// forward + backward, medians of CUDA-event-timed repetitions, with the FLOPs counted as the two
// T x T x D products (halved for the causal mask; the backward as 2.5 forwards, FlashAttention's
// accounting). `benchmarks/torch_attention.py` times PyTorch's SDPA the same way.
//
//   bench_attention_cuda [--batch 8] [--json attention.json]
#include <cstdio>
#include <exception>

#include "benchmarks/bench_util.h"
#include "core/autograd.h"
#include "core/ops.h"

using namespace microbatch;

int main(int argc, char** argv) {
  try {
    bench::Args args(argc, argv);
    const std::int64_t b = args.get_int("--batch", 8), h = 12, t = 1024, d = 64;
    const std::string json_path = args.get("--json", "");
    MB_CHECK(args.unknown().empty(), "[bench_attention_cuda] unknown argument {}", args.unknown());
    MB_CHECK(cuda_available(), "[bench_attention_cuda] needs a CUDA device");
    const Device gpu = cuda_device(0);
    manual_seed(0);
    const TensorOptions opts{.dtype = DType::bf16, .device = gpu};
    Tensor q = randn({b, h, t, d}, opts).requires_grad_(true);
    Tensor k = randn({b, h, t, d}, opts).requires_grad_(true);
    Tensor v = randn({b, h, t, d}, opts).requires_grad_(true);
    Tensor dout = randn({b, h, t, d}, opts);
    const AttentionOptions causal{.causal = true};
    const bench::Timing fwd = bench::time_reps(gpu, 3, 20, [&] {
      NoGradGuard no_grad;
      (void)scaled_dot_product_attention(q, k, v, causal);
    });
    const bench::Timing fwd_bwd = bench::time_reps(gpu, 3, 20, [&] {
      Tensor out = scaled_dot_product_attention(q, k, v, causal);
      out.backward(dout);
    });
    const double flops_fwd = 4.0 * b * h * t * t * d / 2.0;
    const double tflops_fwd = flops_fwd / (fwd.median_ms * 1e-3) / 1e12;
    const double tflops_all = 3.5 * flops_fwd / (fwd_bwd.median_ms * 1e-3) / 1e12;
    std::printf("attention (%lld, 12, 1024, 64) bf16 causal: forward %.3f ms (%.1f TFLOP/s), "
                "forward + backward %.3f ms (%.1f TFLOP/s)\n",
                static_cast<long long>(b), fwd.median_ms, tflops_fwd, fwd_bwd.median_ms, tflops_all);
    if (!json_path.empty()) {
      bench::write_json(json_path, {{"device", bench::device_name(gpu)},
                                    {"shape", {b, h, t, d}},
                                    {"forward_ms", fwd.median_ms},
                                    {"forward_backward_ms", fwd_bwd.median_ms},
                                    {"forward_tflops", tflops_fwd},
                                    {"forward_backward_tflops", tflops_all}});
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
