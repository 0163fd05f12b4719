"""The 'shard' strategy: 'vmap' with the participant slots split over a one-axis device mesh
(`jax.shard_map`), each device vmapping its share; states and samples split over the mesh by
client where `placement.row_spec` allows."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fedjax_pfedes.execution.placement import CLIENT_AXIS
from fedjax_pfedes.execution.strategies.mapped import mapped_runner
from fedjax_pfedes.execution.strategies.protocol import Strategy, register_strategy


def _sharded(fn: Callable, in_axes: tuple, mesh: Mesh) -> Callable:
    """`fn` vmapped over the slots of each device's share (axes None: replicated)."""
    specs = tuple(P() if a is None else P(CLIENT_AXIS) for a in in_axes)
    return jax.shard_map(jax.vmap(fn, in_axes=in_axes), mesh=mesh, in_specs=specs,
                         out_specs=P(CLIENT_AXIS), check_vma=False)


register_strategy(Strategy("shard", lambda program, o: mapped_runner(
    program, "shard", functools.partial(_sharded, mesh=o.mesh), o.mesh, jit=o.jit,
    eval_budget_bytes=o.eval_budget_bytes), cost="longest_schedule", needs_mesh=True))
