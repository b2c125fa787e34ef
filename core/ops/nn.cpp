// Filled in by the nn op family.
