// Stubs for builds without the CUDA backend: one line per entry point.
#include "core/error.h"
#include "kernels/attention.h"
#include "kernels/device.h"
#include "kernels/elementwise.h"
#include "kernels/index.h"
#include "kernels/reduce.h"
#include "kernels/nn.h"
#include "kernels/gemm.h"
#include "kernels/conv.h"
#include "kernels/loss_scale.h"
#include "kernels/optim.h"

namespace microbatch::kernels::cuda {

namespace {
[[noreturn]] void no_cuda(const char* op) {
  detail::throw_error(fmt::format("[{}] this build has no CUDA backend", op));
}
}  // namespace

int device_count() { return 0; }
void set_device(int) { no_cuda("cuda::set_device"); }
void* malloc(std::size_t, int) { no_cuda("cuda::malloc"); }
void free(void*, int) noexcept {}
void memcpy_host_to_device(void*, const void*, std::size_t, int) { no_cuda("cuda::memcpy"); }
void memcpy_device_to_host(void*, const void*, std::size_t, int) { no_cuda("cuda::memcpy"); }
void memcpy_device_to_device(void*, const void*, std::size_t, int) { no_cuda("cuda::memcpy"); }
void memset_zero(void*, std::size_t, int) { no_cuda("cuda::memset"); }
void synchronize(int) { no_cuda("cuda::synchronize"); }
std::uintptr_t current_stream_id(int) { return 0; }
void memory_info(int, std::size_t*, std::size_t*) { no_cuda("cuda::memory_info"); }

// ---- elementwise, reduce, index (kernels/elementwise.h, reduce.h, index.h) ----
void synchronize_checked(int) { no_cuda("cuda::synchronize_checked"); }
void unary(UnaryOp, const StridedView&, const StridedView&) { no_cuda("cuda::unary"); }
void binary(BinaryOp, const StridedView&, const StridedView&, const StridedView&) { no_cuda("cuda::binary"); }
void where(const StridedView&, const StridedView&, const StridedView&, const StridedView&) { no_cuda("cuda::where"); }
void copy(const StridedView&, const StridedView&) { no_cuda("cuda::copy"); }
void fill(const StridedView&, double) { no_cuda("cuda::fill"); }
void rand_uniform(const StridedView&, PhiloxArgs) { no_cuda("cuda::rand_uniform"); }
void rand_normal(const StridedView&, PhiloxArgs) { no_cuda("cuda::rand_normal"); }
void dropout_mask(const StridedView&, PhiloxArgs, double) { no_cuda("cuda::dropout_mask"); }
void reduce_rows(ReduceOp, const StridedView&, const StridedView&, std::int64_t) { no_cuda("cuda::reduce_rows"); }
void check_index_range(const StridedView&, std::int64_t, std::int64_t, const char*) { no_cuda("cuda::check_index_range"); }
void raise_pending_index_error(int) {}  // no device, so nothing can be pending
void gather(const StridedView&, const StridedView&, const StridedView&, int) { no_cuda("cuda::gather"); }
void scatter_add(const StridedView&, const StridedView&, const StridedView&, int, double) { no_cuda("cuda::scatter_add"); }
void sum_columns(const StridedView&, const StridedView&, std::int64_t, const StridedView&) { no_cuda("cuda::sum_columns"); }
void add_column_sums(const StridedView&, const StridedView&, double, const StridedView&) { no_cuda("cuda::add_column_sums"); }
void scatter_add_sorted(const StridedView&, const StridedView&, const StridedView&, int, const StridedView&, double) {
  no_cuda("cuda::scatter_add_sorted");
}

// ---- nn, attention (kernels/nn.h, attention.h) ----
void softmax_forward(SoftmaxKind, const StridedView&, const StridedView&, std::int64_t) { no_cuda("cuda::softmax_forward"); }
void softmax_backward(SoftmaxKind, const StridedView&, const StridedView&, const StridedView&, std::int64_t) { no_cuda("cuda::softmax_backward"); }
void cross_entropy_forward(const StridedView&, const StridedView&, const StridedView&, const StridedView&, CrossEntropyArgs) { no_cuda("cuda::cross_entropy_forward"); }
void cross_entropy_backward(const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, CrossEntropyArgs) { no_cuda("cuda::cross_entropy_backward"); }
void layer_norm_forward(const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, double) { no_cuda("cuda::layer_norm_forward"); }
void layer_norm_backward(const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, double) { no_cuda("cuda::layer_norm_backward"); }
// A setting, not a launch: kept as the CUDA build keeps it, so that code choosing a kernel runs on
// either build (tests/core/test_cuda_attention.cpp's cases, rehearsed on the CPU).
namespace {
AttentionKernel g_attention_kernel = AttentionKernel::tensor;
}  // namespace
AttentionKernel attention_kernel() { return g_attention_kernel; }
void set_attention_kernel(AttentionKernel kernel) { g_attention_kernel = kernel; }
bool tensor_core_attention_here() { return false; }
void attention_forward(const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, AttentionArgs) { no_cuda("cuda::attention_forward"); }
void attention_backward(const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, const StridedView&, AttentionArgs) { no_cuda("cuda::attention_backward"); }

// ---- gemm, conv (kernels/gemm.h, conv.h) ----
void gemm(const StridedView&, const StridedView&, const StridedView&, double, double) { no_cuda("cuda::gemm"); }
void gemm_bias(const StridedView&, const StridedView&, const StridedView&, const StridedView&) {
  no_cuda("cuda::gemm_bias");
}
void gemm_bias_gelu(const StridedView&, const StridedView&, const StridedView&, const StridedView&,
                    const StridedView&) {
  no_cuda("cuda::gemm_bias_gelu");
}
void gemm_dgelu(const StridedView&, const StridedView&, const StridedView&, const StridedView&) {
  no_cuda("cuda::gemm_dgelu");
}
bool gemm_bias_epilogue() { return false; }  // no device, no epilogue
std::int64_t lt_epilogue_calls(LtCall) { return 0; }
std::string lt_last_refusal() { return {}; }
void set_gemm_bias_epilogue(bool) {}
void im2col(const StridedView&, const StridedView&, const Window2d&) { no_cuda("cuda::im2col"); }
void col2im(const StridedView&, const StridedView&, const Window2d&) { no_cuda("cuda::col2im"); }
void max_pool2d(const StridedView&, const StridedView&, const StridedView&, const Window2d&) { no_cuda("cuda::max_pool2d"); }
void max_pool2d_backward(const StridedView&, const StridedView&, const StridedView&, const Window2d&) { no_cuda("cuda::max_pool2d_backward"); }
bool has_cudnn() { return false; }
bool conv2d_forward(const StridedView&, const StridedView&, const StridedView&, const StridedView&, const Window2d&, double) { no_cuda("cuda::conv2d_forward"); }
bool conv2d_backward_data(const StridedView&, const StridedView&, const StridedView&, const StridedView&, const Window2d&) { no_cuda("cuda::conv2d_backward_data"); }
bool conv2d_backward_filter(const StridedView&, const StridedView&, const StridedView&, const StridedView&, const Window2d&) { no_cuda("cuda::conv2d_backward_filter"); }

// ---- accumulate, optim (kernels/elementwise.h accumulate, optim.h) ----
void accumulate(const StridedView&, const StridedView&, double, GradStatsBuffer*) { no_cuda("cuda::accumulate"); }
void adamw(const StridedView&, const StridedView&, const StridedView&, const StridedView&, const AdamWArgs&, const StridedView&, const DeviceGate&) { no_cuda("cuda::adamw"); }
void sgd(const StridedView&, const StridedView&, const StridedView&, const SGDArgs&, const StridedView&, const DeviceGate&) { no_cuda("cuda::sgd"); }
void sum_squares(const StridedView&, GradStatsBuffer*) { no_cuda("cuda::sum_squares"); }
void scale(const StridedView&, double) { no_cuda("cuda::scale"); }
void update_loss_scale(LossScaleState*, const GradStats*, const LossScaleRule&) { no_cuda("cuda::update_loss_scale"); }
void* host_alloc_pinned(std::size_t, int) { no_cuda("cuda::host_alloc_pinned"); }
void host_free_pinned(void*) noexcept {}
void memcpy_device_to_host_async(void*, const void*, std::size_t, int) { no_cuda("cuda::memcpy_device_to_host_async"); }
void* event_create(int) { no_cuda("cuda::event_create"); }
void event_destroy(void*) noexcept {}
void event_record(void*, int) { no_cuda("cuda::event_record"); }
void event_synchronize(void*) { no_cuda("cuda::event_synchronize"); }

}  // namespace microbatch::kernels::cuda
