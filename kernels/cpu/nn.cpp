// Filled in by the nn kernels.
