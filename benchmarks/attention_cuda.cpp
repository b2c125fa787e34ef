// Causal attention at GPT-2 small's shape, (B, 12, 1024, 64) bf16: forward and forward + backward
// of both CUDA kernels — tensor cores (the default for 16-bit) and f32 math (MB_ATTENTION_KERNEL=
// simt) — medians of CUDA-event-timed repetitions, with the FLOPs counted as the two T x T x D
// products (halved for the causal mask; the backward as 2.5 forwards, FlashAttention's
// accounting). The two kernels' outputs and gradients are compared (the largest difference
// relative to the largest value, printed and recorded). The f32-math kernel runs and is timed
// first, the tensor-core one after it, so that a device fault in the newer kernel, which is
// sticky, leaves the other's figures. `benchmarks/torch_attention.py` times PyTorch's SDPA the
// same way.
//
//   bench_attention_cuda [--batch 8] [--json attention.json]
//
// The JSON's top-level figures are the tensor-core kernel's; "simt" holds the other's. The
// comparison and each kernel's timing fail alone: a failed one is recorded as its "error" (at the
// top level for the tensor-core kernel's timing) and the rest still runs. The exit status is 1,
// once the JSON is written, when one failed or the kernels differ by more than kTolerance.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <optional>
#include <vector>

#include "benchmarks/bench_util.h"
#include "core/autograd.h"
#include "core/ops.h"
#include "kernels/attention.h"

using namespace microbatch;

namespace {

// The largest tensor-vs-simt difference, relative to the largest value, that passes: the bf16
// tolerance tests/core/test_cuda_attention.cpp holds both kernels to against the CPU in f32
// (parity_tolerance: rtol = atol = 4e-2), here taken at the largest value. Rounding P and dS to
// bf16 costs about 3e-3 on a like measure (tests/core/test_attention_tc.cpp); a wrong row, column
// or mask costs about the largest value itself.
constexpr double kTolerance = 4e-2;

}  // namespace

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
    using kernels::cuda::AttentionKernel;
    nlohmann::json results = {{"device", bench::device_name(gpu)},
                              {"shape", {b, h, t, d}},
                              {"kernel", "tensor"},
                              {"tensor_vs_simt_tolerance", kTolerance}};
    bool failed = false;

    // out, dq, dk, dv with one kernel, in f32 on the host.
    auto run = [&](AttentionKernel kernel) {
      kernels::cuda::set_attention_kernel(kernel);
      Tensor out = scaled_dot_product_attention(q, k, v, causal);
      std::vector<Tensor> g = grad({out}, {dout}, {q, k, v});
      std::vector<std::vector<double>> values{out.detach().to(kCPU).to(DType::f32).to_vector()};
      for (const Tensor& x : g) values.push_back(x.to(kCPU).to(DType::f32).to_vector());
      return values;
    };

    // The kernel's figures, or {"error"} when it failed.
    const double flops_fwd = 4.0 * b * h * t * t * d / 2.0;
    auto time_kernel = [&](AttentionKernel kernel, const char* name) -> nlohmann::json {
      try {
        kernels::cuda::set_attention_kernel(kernel);
        const bench::Timing fwd = bench::time_reps(gpu, 3, 20, [&] {
          NoGradGuard no_grad;
          (void)scaled_dot_product_attention(q, k, v, causal);
        });
        const bench::Timing fwd_bwd = bench::time_reps(gpu, 3, 20, [&] {
          Tensor out = scaled_dot_product_attention(q, k, v, causal);
          out.backward(dout);
        });
        const double forward_tflops = flops_fwd / (fwd.median_ms * 1e-3) / 1e12;
        const double forward_backward_tflops = 3.5 * flops_fwd / (fwd_bwd.median_ms * 1e-3) / 1e12;
        std::printf(
            "attention (%lld, 12, 1024, 64) bf16 causal, %s: forward %.3f ms (%.1f TFLOP/s), "
            "forward + backward %.3f ms (%.1f TFLOP/s)\n",
            static_cast<long long>(b), name, fwd.median_ms, forward_tflops, fwd_bwd.median_ms,
            forward_backward_tflops);
        return {{"forward_ms", fwd.median_ms},
                {"forward_backward_ms", fwd_bwd.median_ms},
                {"forward_tflops", forward_tflops},
                {"forward_backward_tflops", forward_backward_tflops}};
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[bench_attention_cuda] timing the %s kernel failed: %s\n", name,
                     e.what());
        failed = true;
        return {{"error", e.what()}};
      }
    };

    // The f32-math kernel's values and figures first, then the tensor-core kernel's: a device fault
    // in the newer tensor-core kernels is sticky, and would take the other's with it.
    std::optional<std::vector<std::vector<double>>> simt_values;
    nlohmann::json agreement;
    try {
      simt_values = run(AttentionKernel::simt);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[bench_attention_cuda] the f32-math kernel failed: %s\n", e.what());
      agreement = {{"error", e.what()}};
      failed = true;
    }
    const nlohmann::json simt = time_kernel(AttentionKernel::simt, "f32 math");
    if (simt_values) {  // compared only when there is something to compare against
      try {
        const auto tensor_values = run(AttentionKernel::tensor);
        const auto& simt_values_ = *simt_values;
        const char* names[] = {"out", "dq", "dk", "dv"};
        for (std::size_t i = 0; i < tensor_values.size(); ++i) {
          double scale = 0.0, worst = 0.0;
          for (std::size_t j = 0; j < simt_values_[i].size(); ++j) {
            scale = std::max(scale, std::abs(simt_values_[i][j]));
            const double diff = std::abs(tensor_values[i][j] - simt_values_[i][j]);
            // std::max would pass over a NaN, and a kernel that writes NaNs must not look exact.
            worst = std::isnan(diff) ? INFINITY : std::max(worst, diff);
          }
          const double relative = scale > 0.0 ? worst / scale : worst;
          std::printf("tensor vs simt %s: largest difference %.3g of the largest value\n", names[i],
                      relative);
          agreement[names[i]] = relative;  // infinity is written as null
          if (!(relative <= kTolerance)) {
            std::fprintf(stderr,
                         "[bench_attention_cuda] tensor vs simt %s: largest difference %.3g of the "
                         "largest value, over the tolerance %.3g\n",
                         names[i], relative, kTolerance);
            failed = true;
          }
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[bench_attention_cuda] comparing the kernels failed: %s\n", e.what());
        agreement = {{"error", e.what()}};
        failed = true;
      }
    }
    results["tensor_vs_simt"] = agreement;

    results.update(time_kernel(AttentionKernel::tensor, "tensor cores"));
    results["simt"] = simt;
    kernels::cuda::set_attention_kernel(AttentionKernel::tensor);
    bench::write_json(json_path, results);
    return failed ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
