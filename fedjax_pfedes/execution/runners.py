"""Running one client's function over a cohort: `vmap` under jit, or a loop of jitted calls.

Like FedJAX's `for_each_client`, this separates WHAT a client computes (written once, for one
client, in `CohortProgram`) from HOW a cohort runs it. Both strategies take the same inputs and
give the same numbers (up to float reassociation):

* 'vmap': one jitted call maps the client function over the round's participant slots. Slots are
  padded to a fixed bucket with an out-of-range index, so the shapes never change after round 1;
  padded slots read a real client's data (clipped gather) but their results are dropped on the
  scatter and carry zero aggregation weight.
* 'loop': one jitted call per real participant, which reads and writes its row of the stacked
  state in place (the state buffer is donated). Padded slots cost nothing. With `threads` > 1
  (`config.execution.loop_threads`) the participants are split over that many host threads,
  each running its clients' calls one after another while the others run theirs (a CPU's cores
  then train several clients at once), and one jitted call writes all their rows back.
* 'shard': 'vmap' with the participant slots split over a one-axis `jax.sharding.Mesh` of the
  local devices (`shard_map`): each device vmaps its share of the slots; the stacked states and
  samples are split over the mesh by client when the cohort's client count is a multiple of the
  mesh size (else replicated, `row_spec`); uploads and metrics come back to the default device
  for the server step. The bucket is a multiple of the mesh size (`cohorts.build_cohorts` pads it).
  Over several processes (`distributed`) the mesh spans all their devices.
* 'scan': one jitted call runs a `lax.scan` over the participant slots, one client (or a chunk
  of `config.execution.scan_chunk` vmapped clients) per iteration, with the stacked states as
  the carry (`_scan_runner`): one program per round like 'vmap', but only one client's model is
  live at a time, and no per-client dispatch as in 'loop' (the cross-device regime: many small
  clients per round).

Which one is faster depends on the models, the bucket and the backend (on CPU vmapped per-client
convolutions become grouped convolutions); 'auto' measures both per cohort at start-up
(`execution.choice`), see benchmarks/micro/execution_strategies.py for the side-by-side numbers.

On a CPU backend the client programs can also be compiled with two kernel libraries
(`config.execution.cpu_kernels`, `kernel_options`): which is faster depends on the CPU and the
layers, so 'auto' times both per cohort too. A runner's `name` says both choices: the strategy,
and '/eigen' when the Eigen kernels were chosen ('loop', 'loop/eigen', 'vmap', ...).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax

from fedjax_pfedes.algorithms.base import CohortProgram
from fedjax_pfedes.execution import eval_memory, strategies  # noqa: F401  (the built-ins)
from fedjax_pfedes.execution.kernels import kernel_options
from fedjax_pfedes.execution.placement import Mesh
from fedjax_pfedes.execution.strategies.protocol import (
    CohortRunner,
    RunnerOptions,
    finishing_program,
    strategy,
)


def default_loop_threads() -> int:
    """`config.execution.loop_threads` = 0: the CPU cores this process may use when the
    backend is the CPU (each thread trains its own clients), else 1 (an accelerator runs one
    program at a time anyway)."""
    if jax.default_backend() != "cpu":
        return 1
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def make_runner(program: CohortProgram, strategy_name: str, mesh: Mesh | None = None,
                loop_threads: int = 1, cpu_kernels: str = "xla", scan_chunk: int = 1,
                eval_memory_budget_gb: float = eval_memory.DEFAULT_BUDGET_GB) -> CohortRunner:
    """Builds the jitted update/evaluate functions of a cohort.

    Args:
      program: the cohort's per-client functions.
      strategy_name: a registered strategy ('loop', 'vmap', 'scan', 'shard', ...; one that
        `needs_mesh` needs `mesh`).
      mesh: the mesh of `client_mesh` ('shard' only).
      loop_threads: host threads of 'loop' (0 = `default_loop_threads()`).
      cpu_kernels: see `kernel_options`.
      scan_chunk: participants vmapped together per iteration of 'scan' (1 = one at a time).
      eval_memory_budget_gb: memory one evaluation call of 'vmap' / 'shard' may take; a
        cohort that needs more is evaluated in chunks of clients (same numbers).

    Returns:
      The cohort's `CohortRunner`.
    """
    program = finishing_program(program)
    options = kernel_options(cpu_kernels)
    jit = functools.partial(jax.jit, compiler_options=options or None)
    # Off the CPU backend the option does not exist: the runner's kernels are XLA's own.
    with_kernels = functools.partial(dataclasses.replace,
                                     kernels=cpu_kernels if options else "xla")
    if strategy_name == "auto":
        raise ValueError("make_runner: 'auto' is resolved per cohort by execution.choice")
    chosen = strategy(strategy_name)
    if chosen.needs_mesh and mesh is None:
        raise ValueError(f"make_runner: strategy '{strategy_name}' needs a mesh "
                         "(execution.client_mesh)")
    runner = chosen.build(program, RunnerOptions(mesh, loop_threads or default_loop_threads(),
                                                 scan_chunk, jit,
                                                 eval_memory_budget_gb * 2**30))
    return with_kernels(runner, strategy=chosen.name)
