// The profiler's device clock on CUDA (core/profiler_events.h). Compiled in CUDA builds only, like
// the .cu files; it includes kernels/cuda/runtime.h for current_stream(), host declarations only.
#include <cuda_runtime.h>

#include "core/profiler_events.h"
#include "kernels/cuda/runtime.h"

namespace microbatch::profiler::events {

namespace {
cudaEvent_t as_cuda(Event e) { return static_cast<cudaEvent_t>(e); }
}  // namespace

Event create(int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  cudaEvent_t e = nullptr;
  MB_CUDA_CHECK(cudaEventCreate(&e));  // with timing (cudaEventDisableTiming not set)
  return e;
}

void record(Event e, int device) {
  MB_CUDA_CHECK(cudaSetDevice(device));
  MB_CUDA_CHECK(cudaEventRecord(as_cuda(e), kernels::cuda::current_stream()));
}

bool done(Event e) {
  const cudaError_t status = cudaEventQuery(as_cuda(e));
  if (status == cudaErrorNotReady) {
    // "Not ready" is an answer, not a failure, but the runtime also keeps it as this thread's
    // last error: cleared here (only that one), or the next launch check would report it as its
    // own. A real asynchronous error is sticky and shows again at the next call.
    if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
    return false;
  }
  MB_CUDA_CHECK(status);
  return true;
}

void wait(Event e) { MB_CUDA_CHECK(cudaEventSynchronize(as_cuda(e))); }

double elapsed_ms(Event start, Event end) {
  float ms = 0.0f;
  MB_CUDA_CHECK(cudaEventElapsedTime(&ms, as_cuda(start), as_cuda(end)));
  return ms;
}

}  // namespace microbatch::profiler::events
