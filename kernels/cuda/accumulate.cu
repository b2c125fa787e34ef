// kernels/cuda/accumulate.cu: filled in by the CUDA backend work.
