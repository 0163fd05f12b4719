"""One client's local-update inputs per architecture cohort, for benchmarks that compile or
time a cohort's `client_update` on its own (`trace_cost`, `roofline`)."""

from __future__ import annotations

from collections.abc import Iterator

import jax

from fedjax_pfedes.algorithms.base import Algorithm, CohortProgram
from fedjax_pfedes.engine.build import build_algorithm, build_federated_data
from fedjax_pfedes.engine.cohorts import assign_architectures


def first_clients(config) -> tuple[Algorithm, Iterator[tuple[str, CohortProgram, tuple]]]:
    """(algorithm, iterator of (architecture, cohort program, client_update arguments)) for the
    first client of each architecture of `config`'s run: the broadcast of a fresh server state,
    a fresh client state, the client's padded train arrays and a key."""
    data = build_federated_data(config)
    algorithm = build_algorithm(config, data)
    archs = assign_architectures(config.clients.architectures, data.num_clients)
    server = algorithm.init_server(jax.random.key(0), tuple(dict.fromkeys(archs)))

    def cohorts():
        for arch in dict.fromkeys(archs):
            program = algorithm.cohort_program(arch)
            train = jax.tree.map(lambda a: a[0], data.client_arrays([archs.index(arch)], "train"))
            yield arch, program, (algorithm.broadcast(server, arch),
                                  program.init_client(jax.random.key(1)), train,
                                  jax.random.key(2))

    return algorithm, cohorts()
