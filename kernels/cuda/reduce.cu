// kernels/cuda/reduce.cu: filled in by the CUDA backend work.
