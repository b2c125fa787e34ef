// Devices, streams, library handles, raw memory and copies (Note [One stream per device] in
// kernels/device.h).
#include <algorithm>
#include <mutex>
#include <vector>

#include "kernels/cuda/runtime.h"
#include "kernels/device.h"

namespace microbatch::kernels::cuda {

namespace {

constexpr std::size_t kCublasWorkspaceBytes = std::size_t{32} << 20;  // as cuBLAS on Hopper wants

struct PerDevice {
  cudaStream_t stream = nullptr;  // nullptr: the legacy default stream
  cublasHandle_t cublas = nullptr;
  void* cublas_workspace = nullptr;
  cublasLtHandle_t cublaslt = nullptr;
  int sm_count = 0;
#ifdef MB_HAVE_CUDNN
  cudnnHandle_t cudnn = nullptr;
#endif
};

std::mutex g_create_mutex;  // guards the lazy creation of a device's handles

// One entry per visible device, made once, so that the lookup on every launch takes no lock and a
// reference stays valid. Handles live for the whole process (released by the driver at exit), like
// the allocators.
PerDevice& per_device(int device) {
  static std::vector<PerDevice>* all = new std::vector<PerDevice>(std::max(device_count(), 1));
  MB_ASSERT(device >= 0 && device < static_cast<int>(all->size()), "cuda:{} of {} devices", device,
            all->size());
  return (*all)[device];
}

int current_device() {
  int device = 0;
  MB_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: clear the sticky status, report none
    return 0;
  }
  return n;
}

void set_device(int device) { MB_CUDA_CHECK(cudaSetDevice(device)); }

cudaStream_t current_stream() { return per_device(current_device()).stream; }

void set_current_stream(cudaStream_t stream) {
  PerDevice& d = per_device(current_device());
  std::lock_guard lock(g_create_mutex);
  d.stream = stream;
  if (d.cublas != nullptr) {
    // cublasSetStream puts the handle back on cuBLAS's own workspace pool: ours is set again.
    MB_CUBLAS_CHECK(cublasSetStream(d.cublas, stream));
    MB_CUBLAS_CHECK(cublasSetWorkspace(d.cublas, d.cublas_workspace, kCublasWorkspaceBytes));
  }
#ifdef MB_HAVE_CUDNN
  if (d.cudnn != nullptr) MB_CUDNN_CHECK(cudnnSetStream(d.cudnn, stream));
#endif
}

std::uintptr_t current_stream_id(int device) {
  return reinterpret_cast<std::uintptr_t>(per_device(device).stream);
}

cublasHandle_t cublas_handle() {
  PerDevice& d = per_device(current_device());
  std::lock_guard lock(g_create_mutex);
  if (d.cublas == nullptr) {
    MB_CUBLAS_CHECK(cublasCreate(&d.cublas));
    MB_CUDA_CHECK(cudaMalloc(&d.cublas_workspace, kCublasWorkspaceBytes));
    // Tensor cores for f32 GEMMs stay off: f32 means f32 (TF32 would break the 1e-3 parity).
    MB_CUBLAS_CHECK(cublasSetMathMode(d.cublas, CUBLAS_DEFAULT_MATH));
    MB_CUBLAS_CHECK(cublasSetStream(d.cublas, d.stream));  // set_current_stream keeps it current
    // After the stream: cublasSetStream resets the handle to cuBLAS's own workspace pool.
    MB_CUBLAS_CHECK(cublasSetWorkspace(d.cublas, d.cublas_workspace, kCublasWorkspaceBytes));
  }
  return d.cublas;
}

cublasLtHandle_t cublaslt_handle() {
  PerDevice& d = per_device(current_device());
  std::lock_guard lock(g_create_mutex);
  if (d.cublaslt == nullptr) MB_CUBLAS_CHECK(cublasLtCreate(&d.cublaslt));
  return d.cublaslt;
}

void* cublas_workspace(std::size_t* bytes) {
  (void)cublas_handle();  // makes the workspace with the handle
  *bytes = kCublasWorkspaceBytes;
  return per_device(current_device()).cublas_workspace;
}

int multiprocessor_count() {
  const int device = current_device();
  PerDevice& d = per_device(device);
  if (d.sm_count == 0) {
    MB_CUDA_CHECK(cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, device));
  }
  return d.sm_count;
}

unsigned grid_for(long long n, int threads) {
  const long long needed = ceil_div(n < 1 ? 1 : n, threads);
  const long long cap = static_cast<long long>(multiprocessor_count()) * 32;
  return static_cast<unsigned>(needed < cap ? needed : cap);
}

const char* cublas_status_name(cublasStatus_t status) { return cublasGetStatusString(status); }

#ifdef MB_HAVE_CUDNN
cudnnHandle_t cudnn_handle() {
  PerDevice& d = per_device(current_device());
  std::lock_guard lock(g_create_mutex);
  if (d.cudnn == nullptr) {
    MB_CUDNN_CHECK(cudnnCreate(&d.cudnn));
    MB_CUDNN_CHECK(cudnnSetStream(d.cudnn, d.stream));  // set_current_stream keeps it current
  }
  return d.cudnn;
}
#endif

void* malloc(std::size_t bytes, int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  void* ptr = nullptr;
  cudaError_t status = cudaMalloc(&ptr, bytes);
  if (status == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    return nullptr;  // the allocator turns this into OutOfMemoryError with its statistics
  }
  MB_CUDA_CHECK(status);
  return ptr;
}

void free(void* ptr, int device) noexcept {
  if (cudaSetDevice(device) == cudaSuccess) (void)cudaFree(ptr);
}

void memcpy_host_to_device(void* dst, const void* src, std::size_t bytes, int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  // From pageable memory this returns once the source has been staged, so the caller may free it.
  MB_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, current_stream()));
}

void memcpy_device_to_host(void* dst, const void* src, std::size_t bytes, int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t stream = current_stream();
  MB_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  MB_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void memcpy_device_to_device(void* dst, const void* src, std::size_t bytes, int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  MB_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, current_stream()));
}

void memset_zero(void* dst, std::size_t bytes, int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  MB_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, current_stream()));
}

void synchronize(int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  MB_CUDA_CHECK(cudaDeviceSynchronize());
}

void memory_info(int device, std::size_t* free_bytes, std::size_t* total_bytes) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  MB_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
}

}  // namespace microbatch::kernels::cuda
