// Raw device memory for the caching allocator, and copies. Device selection is per call.
#include "kernels/cuda/check.h"
#include "kernels/device.h"

namespace microbatch::kernels::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: clear the sticky status, report none
    return 0;
  }
  return n;
}

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
  MB_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

void memcpy_device_to_host(void* dst, const void* src, std::size_t bytes, int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  MB_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

void memcpy_device_to_device(void* dst, const void* src, std::size_t bytes, int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  MB_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice));
}

void memset_zero(void* dst, std::size_t bytes, int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  MB_CUDA_CHECK(cudaMemset(dst, 0, bytes));
}

void synchronize(int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  MB_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace microbatch::kernels::cuda
