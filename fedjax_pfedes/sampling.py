"""Which clients take part in a round."""

from __future__ import annotations

import numpy as np


def participants_per_round(num_clients: int, fraction: float) -> int:
    """m = max(1, round(C * N)) participants per round."""
    return max(1, int(round(fraction * num_clients)))


def uniform_sample(seed: int, round_index: int, num_clients: int, fraction: float) -> np.ndarray:
    """Sorted ids of m clients drawn uniformly without replacement.

    The draw depends only on (seed, round_index), so a resumed run samples the same clients.
    """
    rng = np.random.default_rng([seed, round_index])
    m = participants_per_round(num_clients, fraction)
    return np.sort(rng.choice(num_clients, size=m, replace=False))


def poisson_sample(seed: int, round_index: int, num_clients: int, fraction: float
                   ) -> np.ndarray:
    """Sorted ids of the clients that take part, each independently with probability C
    (Poisson sampling, as assumed by the DP accountant's PoissonSampledDpEvent; may be empty)."""
    rng = np.random.default_rng([seed, round_index, 1])
    return np.flatnonzero(rng.random(num_clients) < fraction)


SAMPLERS = {"uniform": uniform_sample, "poisson": poisson_sample}
