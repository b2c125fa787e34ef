// Filled in by the attention op family.
