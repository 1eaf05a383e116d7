"""kvq.eval."""
