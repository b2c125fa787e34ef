// kernels/cuda/attention.cu: filled in by the CUDA backend work.
