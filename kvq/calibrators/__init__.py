"""kvq.calibrators."""
