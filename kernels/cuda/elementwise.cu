// kernels/cuda/elementwise.cu: filled in by the CUDA backend work.
