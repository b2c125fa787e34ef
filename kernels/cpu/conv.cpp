// Filled in by the conv kernels.
