// kernels/cuda/gemm.cu: filled in by the CUDA backend work.
