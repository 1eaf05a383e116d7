"""kvq.cli."""
