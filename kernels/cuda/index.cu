// kernels/cuda/index.cu: filled in by the CUDA backend work.
