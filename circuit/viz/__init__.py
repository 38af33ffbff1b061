"""circuit/viz."""
