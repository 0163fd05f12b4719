"""The algorithm interface every federated method implements.

Modelled on optax's `GradientTransformation` and FedJAX's `FederatedAlgorithm`: a frozen dataclass
of pure functions over explicit pytree state. The per-client functions are written for ONE client;
`fedjax_pfedes.execution` runs them over a cohort by `jax.vmap` or by a loop with identical results.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

PyTree = Any
Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class CohortProgram:
    """What the clients of one architecture run.

    Attributes:
      init_client: rng -> ClientState of one client.
      client_update: (broadcast, client_state, train_arrays, rng) -> (upload, client_state,
        metrics). `train_arrays` is one client's padded `ClientArrays`.
      evaluate: (broadcast, client_state, test_arrays, global_x, global_y) -> metrics of one
        client on its local test split and on the global test set.
    """

    init_client: Callable[[jax.Array], PyTree]
    client_update: Callable[[PyTree, PyTree, PyTree, jax.Array], tuple[PyTree, PyTree, Metrics]]
    evaluate: Callable[[PyTree, PyTree, PyTree, jax.Array, jax.Array], Metrics]


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """A federated algorithm.

    Attributes:
      name: config name.
      init_server: rng -> ServerState.
      broadcast: ServerState -> what every participant receives this round.
      upload_template: ServerState -> the tree every upload must match (structure, shapes, dtypes).
      server_update: (ServerState, [(stacked uploads, weights) per cohort]) -> ServerState; pure
        and jittable.
      cohort_program: architecture name -> CohortProgram.
    """

    name: str
    init_server: Callable[[jax.Array], PyTree]
    broadcast: Callable[[PyTree], PyTree]
    upload_template: Callable[[PyTree], PyTree]
    server_update: Callable[[PyTree, list[tuple[PyTree, jax.Array]]], PyTree]
    cohort_program: Callable[[str], CohortProgram]
