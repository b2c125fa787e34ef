// Filled in by the index kernels.
