"""Python-side cost of a cohort's first local update: tracing and lowering, per architecture.

  python -m benchmarks.trace_cost                          # the quick start's pFedES cohorts
  python -m benchmarks.trace_cost --algorithm=fedavg --repeats=3

For every architecture of configs/quickstart.py, traces one client's `client_update` of a
freshly built cohort program (nothing cached) and lowers it to StableHLO; prints the seconds of
each, the best of `--repeats`, and a hash of the lowered module (equal hashes: the same
program, hence the same numbers, e.g. before and after a change to how the program is traced).
XLA compiling comes after this and is not included (benchmarks.compile_events reports it for a
whole run).
"""

from __future__ import annotations

import hashlib
import time

import jax
from absl import app, flags

from configs import quickstart
from fedjax_pfedes.builders import build_algorithm, build_federated_data
from fedjax_pfedes.cohorts import assign_architectures

_ALGORITHM = flags.DEFINE_string("algorithm", "pfedes", "config.algorithm")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Traces per architecture (best is printed).")


def main(argv: list[str]) -> None:
    del argv
    config = quickstart.get_config()
    config.algorithm = _ALGORITHM.value
    data = build_federated_data(config)
    algorithm = build_algorithm(config, data)
    archs = assign_architectures(config.clients.architectures, data.num_clients)
    server = algorithm.init_server(jax.random.key(0), tuple(dict.fromkeys(archs)))
    print(f"{config.algorithm}, JAX {jax.__version__}\n| architecture | trace s | lower s | "
          "lowered module |\n|---|---|---|---|")
    total = [0.0, 0.0]
    for arch in dict.fromkeys(archs):
        program = algorithm.cohort_program(arch)
        first = archs.index(arch)
        train = jax.tree.map(lambda a: a[0], data.client_arrays([first], "train"))
        args = (algorithm.broadcast(server, arch), program.init_client(jax.random.key(1)),
                train, jax.random.key(2))
        best = [float("inf"), float("inf")]
        for _ in range(_REPEATS.value):
            # A fresh program each time: JAX caches traces by function, nested jits included.
            fresh = algorithm.cohort_program(arch)
            t0 = time.perf_counter()
            traced = jax.jit(fresh.client_update).trace(*args)
            t1 = time.perf_counter()
            lowered = traced.lower()
            t2 = time.perf_counter()
            best = [min(best[0], t1 - t0), min(best[1], t2 - t1)]
        digest = hashlib.sha256(lowered.as_text().encode()).hexdigest()[:12]
        total = [total[0] + best[0], total[1] + best[1]]
        print(f"| {arch} | {best[0]:.2f} | {best[1]:.2f} | {digest} |")
    print(f"| all | {total[0]:.2f} | {total[1]:.2f} | |")


if __name__ == "__main__":
    app.run(main)
