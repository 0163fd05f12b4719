"""Flax client models (backbone + projection head + classifier) and proxy extractors."""
