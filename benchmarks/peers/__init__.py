"""Beside other FL engines: the same works in PyTorch, pfl-research, Flower and plain JAX."""
