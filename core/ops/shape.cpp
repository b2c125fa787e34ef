// Filled in by the shape op family.
