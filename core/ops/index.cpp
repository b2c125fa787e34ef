// Filled in by the index op family.
