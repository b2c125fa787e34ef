// Filled in by the conv op family.
