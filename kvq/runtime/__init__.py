"""kvq.runtime."""
