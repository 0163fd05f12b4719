"""Small federated fixtures shared by the baseline tests: a 5-feature tabular spec, FedAvg-family
configs and one client's padded arrays."""

import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.algorithms.fedavg import FedAvgConfig
from fedjax_pfedes.data.federated import ClientArrays
from fedjax_pfedes.data.spec import InputSpec

SPEC = InputSpec("tabular", (5,), "float32", (0.0,) * 5, (1.0,) * 5)


def fedavg_config(**kw) -> FedAvgConfig:
    base = dict(num_classes=3, input_spec=SPEC, lr_local=0.1, batch_size=8, local_epochs=1)
    base.update(kw)
    return FedAvgConfig(**base)


def client_data(n=8, capacity=8, seed=0) -> ClientArrays:
    """n real rows of Gaussian features and labels in {0, 1, 2}, padded to `capacity`."""
    rng = np.random.default_rng(seed)
    x = np.zeros((capacity, 5), np.float32)
    y = np.zeros((capacity,), np.int32)
    x[:n] = rng.normal(size=(n, 5))
    y[:n] = rng.integers(0, 3, n)
    return ClientArrays(jnp.asarray(x), jnp.asarray(y), jnp.int32(n))
