// kernels/cuda/nn.cu: filled in by the CUDA backend work.
