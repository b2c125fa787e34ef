// kernels/cuda/conv.cu: filled in by the CUDA backend work.
