"""circuit/passes."""
