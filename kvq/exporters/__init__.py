"""kvq.exporters."""
