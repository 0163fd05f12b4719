"""A public share of the training pool, held out before partitioning.

Pretraining the proxy extractor (`launch.pretrain_proxy`) needs data that no client owns: a
seeded, class-stratified share `config.data.public_fraction` of the pool is set aside, and the
clients are partitioned from the rest, so the pretrained E_proxy never saw a client's sample.
The input-normalization statistics stay those of the whole pool (the same for both programs).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fedjax_pfedes.data.sources import CentralDataset
from fedjax_pfedes.errors import ConfigError


def public_indices(y: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Sorted pool indices of the public share: round(fraction x count) of every class, drawn
    with a generator seeded by `seed` (independent of the partition's stream)."""
    if not 0 <= fraction < 1:
        raise ConfigError(f"config.data.public_fraction must be in [0, 1), got {fraction}")
    rng = np.random.default_rng([seed, 0x5EED, 17])
    chosen = []
    for c in np.unique(y):
        members = np.flatnonzero(y == c)
        take = int(round(fraction * len(members)))
        chosen.append(rng.choice(members, size=take, replace=False))
    return np.sort(np.concatenate(chosen)) if chosen else np.zeros(0, np.int64)


def split_public(central: CentralDataset, fraction: float, seed: int
                 ) -> tuple[CentralDataset, tuple[np.ndarray, np.ndarray]]:
    """(the dataset whose pool excludes the public share, (public x, public y)). With fraction
    0 the dataset is returned unchanged and the public arrays are empty."""
    idx = public_indices(central.y_train, fraction, seed)
    keep = np.ones(len(central.y_train), bool)
    keep[idx] = False
    private = dataclasses.replace(
        central, x_train=central.x_train[keep], y_train=central.y_train[keep],
        groups_train=None if central.groups_train is None else central.groups_train[keep])
    return private, (central.x_train[idx], central.y_train[idx])
