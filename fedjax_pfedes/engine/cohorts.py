"""Clients grouped by architecture: each cohort's private states are stacked on a client axis."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.algorithms.base import CohortProgram, PyTree
from fedjax_pfedes.data.federated import ClientArrays, FederatedData
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.execution import offload as client_states
from fedjax_pfedes.execution.strategies.protocol import CohortRunner
from fedjax_pfedes.io import storage
from fedjax_pfedes.models.architectures import check_architecture
from fedjax_pfedes.tree_util import tree_size


def assign_architectures(spec: str, num_clients: int) -> list[str]:
    """Architecture of every client from a spec string.

    'a,b,c' cycles (client k gets the (k mod 3)-th name, as the published pFedES assigns CNN-1..5);
    'a:8,b:6,c:6' gives consecutive blocks of the stated sizes, which must sum to `num_clients`.
    """
    field = "config.clients.architectures"
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise ConfigError(f"{field} is empty; e.g. 'convnet3,convnet5,vit'")
    if all(":" not in s for s in items):
        for name in items:
            check_architecture(name, field)
        return [items[k % len(items)] for k in range(num_clients)]
    archs: list[str] = []
    for s in items:
        name, _, count = s.partition(":")
        check_architecture(name.strip(), field)
        if not count.strip().isdigit():
            raise ConfigError(f"{field}: '{s}' needs the form name:count, or give names only")
        archs += [name.strip()] * int(count)
    if len(archs) != num_clients:
        raise ConfigError(f"{field}: counts sum to {len(archs)} but config.data.num_clients is "
                         f"{num_clients}")
    return archs


@dataclasses.dataclass
class Cohort:
    """The clients of one architecture.

    Attributes:
      arch: architecture name.
      client_ids: global ids of the members, ascending; member j is row j of every stacked array.
      train, test: padded local train / test arrays (on device).
      program, runner: what the members run and how.
      bucket: fixed number of participant slots per round (no re-compilation).
      wrap: what a runner is wrapped in to run this cohort (offloaded states: gathered per
        round, `execution.offload.offloaded_runner`; else as it is): `use` applies it.
    """

    arch: str
    client_ids: np.ndarray
    train: ClientArrays
    test: ClientArrays
    program: CohortProgram
    runner: CohortRunner
    bucket: int
    wrap: Callable[[CohortRunner], CohortRunner] = dataclasses.field(default=lambda r: r)

    def use(self, runner: CohortRunner) -> None:
        """Runs the cohort with `runner` (wrapped as the cohort's states need)."""
        self.runner = self.wrap(runner)

    def slots(self, participants: np.ndarray) -> np.ndarray:
        """Local indices of this round's participants, padded with len(client_ids)."""
        local = np.flatnonzero(np.isin(self.client_ids, participants)).astype(np.int32)
        padded = np.full(self.bucket, len(self.client_ids), np.int32)
        padded[: len(local)] = local
        return padded


# Initialization runs once: XLA backend optimization level 1 compiles it faster than the
# default level with identical values; level 0 changes the last bit of some initial weights
# (measurements: docs/performance_history.md, "What did not help" and the set-up table).
@functools.partial(jax.jit, static_argnums=0,
                   compiler_options={"xla_backend_optimization_level": 1})
def _init_states(init_client, rng: jax.Array, ids: jax.Array) -> PyTree:
    """Private states of the clients `ids`, each initialized with the key rng folded with its id."""
    return jax.vmap(lambda k: init_client(jax.random.fold_in(rng, k)))(ids)


def _same_states(init_states, first: int, ids: jax.Array) -> PyTree:
    """`init_states` of `ids` as if every one of them were client `first`."""
    return init_states(jnp.full_like(jnp.asarray(ids), first))


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where offloaded client states go (`config.execution.client_states='offload'`):
    host memory up to `budget_gb` for all cohorts together, memory-mapped files under
    `directory` (one folder per cohort) above it."""

    budget_gb: float
    directory: str


def build_cohorts(data: FederatedData, archs: list[str], programs: dict[str, CohortProgram],
                  runners: dict[str, CohortRunner], participants_per_round: int,
                  rng: jax.Array, bucket_multiple: int = 1, offload: Offload | None = None,
                  same_init: bool = False) -> tuple[list[Cohort], dict[str, PyTree]]:
    """Groups clients by architecture (in order of first appearance); returns the cohorts and
    their initial private states (architecture -> states stacked over the members).

    `bucket_multiple`: every cohort's participant slots are rounded up to a multiple of it
    (the 'shard' strategy splits the slots evenly over the devices of its mesh; the extra
    slots are padding, they take no steps and carry no weight).
    `offload`: keep states and data on the host (`execution.offload`); the cohorts' runners are
    wrapped to gather each round's participants. None: everything stacked on the device.
    `same_init`: every client of an architecture starts from the same private state (the key
    of the cohort's first client), as the published pFedES runs do; else each its own."""
    members = {a: np.array([k for k, x in enumerate(archs) if x == a])
               for a in dict.fromkeys(archs)}
    buckets = {a: -(-min(len(ids), participants_per_round) // bucket_multiple) * bucket_multiple
               for a, ids in members.items()}
    in_memory = True
    if offload is not None:
        rows = {a: jax.eval_shape(programs[a].init_client, rng) for a in members}
        in_memory = client_states.check_budget(rows, {a: len(i) for a, i in members.items()},
                                               buckets, offload.budget_gb)
        if not in_memory:
            storage.check_states_space(offload.directory, sum(
                tree_size(rows[a])[1] * len(ids) for a, ids in members.items()))
    cohorts, states_of = [], {}
    for arch, ids in members.items():
        init = functools.partial(_init_states, programs[arch].init_client, rng)
        if same_init:
            init = functools.partial(_same_states, init, int(ids[0]))
        runner = runners[arch]
        if offload is None:
            # One compiled call per cohort (eager initialization compiles every op separately).
            states_of[arch] = init(jnp.asarray(ids))
            train = jax.device_put(data.client_arrays(ids, "train"))
            test = jax.device_put(data.client_arrays(ids, "test"))
        else:
            store = client_states.allocate(
                rows[arch], len(ids),
                None if in_memory else os.path.join(offload.directory, arch))
            states_of[arch] = client_states.initialize(init, ids, store)
            train, test = (client_states.RaggedClientArrays.from_indices(
                data.central.x_train, data.central.y_train,
                [chosen[int(k)] for k in ids])
                for chosen in (data.train_indices, data.test_indices))
        wrap = ((lambda r: r) if offload is None else functools.partial(
            client_states.offloaded_runner, bucket=buckets[arch], on_disk=not in_memory))
        cohorts.append(Cohort(arch=arch, client_ids=ids, train=train, test=test,
                              program=programs[arch], runner=wrap(runner), bucket=buckets[arch],
                              wrap=wrap))
    return cohorts, states_of
