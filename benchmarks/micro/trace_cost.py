"""Python-side cost of a cohort's first local update: tracing and lowering, per architecture.

  python -m benchmarks.micro.trace_cost                          # the quick start's pFedES cohorts
  python -m benchmarks.micro.trace_cost --algorithm=fedavg --repeats=3

For every architecture of configs/quickstart.py, traces one client's `client_update` of a
freshly built cohort program (nothing cached) and lowers it to StableHLO; prints the seconds of
each, the best of `--repeats`, and a hash of the lowered module (equal hashes: the same
program, hence the same numbers, e.g. before and after a change to how the program is traced).
XLA compiling comes after this and is not included (benchmarks.micro.compile_events reports it for a
whole run).
"""

from __future__ import annotations

import hashlib
import time

import jax
from absl import app, flags

from benchmarks.micro import cohort_inputs
from configs import quickstart

_ALGORITHM = flags.DEFINE_string("algorithm", "pfedes", "config.algorithm")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Traces per architecture (best is printed).")


def main(argv: list[str]) -> None:
    del argv
    config = quickstart.get_config()
    config.algorithm = _ALGORITHM.value
    algorithm, cohorts = cohort_inputs.first_clients(config)
    print(f"{config.algorithm}, JAX {jax.__version__}\n| architecture | trace s | lower s | "
          "lowered module |\n|---|---|---|---|")
    total = [0.0, 0.0]
    for arch, _, args in cohorts:
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
