"""kvq.manifests."""
