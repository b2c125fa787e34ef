// kernels/cuda/optim.cu: filled in by the CUDA backend work.
