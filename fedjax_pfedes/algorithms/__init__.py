"""Federated algorithms, each a frozen dataclass of pure functions (see `base.Algorithm`)."""
