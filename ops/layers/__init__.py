"""ops/layers."""
