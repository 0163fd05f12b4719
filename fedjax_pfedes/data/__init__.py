"""Datasets, non-IID partitions and padded per-client arrays."""
