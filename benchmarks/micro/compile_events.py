"""Where a run's first-call time goes: JAX's tracing, lowering, compiling and cache loading.

  python -m benchmarks.micro.compile_events --config=configs/quickstart.py --workdir=/tmp/q \
      --config.execution.compilation_cache_dir=/tmp/cache     # run it twice: first, second run

Runs `launch.main` with the given flags (any of its flags and config overrides) and, at the end,
prints the sum and count of every duration event JAX reports through `jax.monitoring`:
`jaxpr_trace_duration` (Python tracing; a nested jit's trace counts again inside its caller's),
`jaxpr_to_mlir_module_duration` (lowering), `backend_compile_duration` (XLA compiling, or loading
from the persistent cache), `cache_retrieval_time_sec` and `compile_time_saved_sec` (the
persistent compilation cache's hits). The numbers behind docs/performance.md's compile tables.
"""

from __future__ import annotations

import collections
import sys

import jax
from absl import app

_PREFIXES = ("/jax/core/compile/", "/jax/compilation_cache/")


def main() -> None:
    sums: dict[str, float] = collections.defaultdict(float)
    counts: collections.Counter = collections.Counter()

    def listen(event: str, duration: float, **_) -> None:
        if event.startswith(_PREFIXES):
            sums[event] += duration
            counts[event] += 1

    jax.monitoring.register_event_duration_secs_listener(listen)
    from fedjax_pfedes.launch import cli
    from fedjax_pfedes.launch import main as launch_main  # flags are defined on import

    try:
        app.run(launch_main.main, argv=["launch.main", *sys.argv[1:]],
                flags_parser=cli.parse_flags)
    finally:
        if sums:  # nothing when the run stopped before compiling (e.g. a bad flag)
            print("| JAX event | count | seconds |\n|---|---|---|")
            for event in sorted(sums):
                print(f"| `{event.rsplit('/', 1)[-1]}` | {counts[event]} | {sums[event]:.2f} |")


if __name__ == "__main__":
    main()
