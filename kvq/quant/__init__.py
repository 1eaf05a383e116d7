"""The numeric core: pure torch, no model knowledge."""
