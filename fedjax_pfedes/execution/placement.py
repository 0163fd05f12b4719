"""Where a cohort's arrays live on a one-axis device mesh ('clients'): the mesh itself, the
placement of stacked per-client rows (split by client where the count allows) and of replicated
values, and a process's local copy of them. Used by the 'shard' strategy and the run's build."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fedjax_pfedes.algorithms.base import PyTree
from fedjax_pfedes.errors import ConfigError

CLIENT_AXIS = "clients"  # the mesh axis the participant slots are split over


def client_mesh(devices: int) -> Mesh:
    """A one-axis mesh ('clients') over the first `devices` local devices (0 = all of them);
    in a run over several processes (`distributed`), over all devices of all processes.
    Auto axis types: the runner states its shardings itself (`shard_map`)."""
    if jax.process_count() > 1:
        return Mesh(np.array(jax.devices()), (CLIENT_AXIS,), axis_types=(AxisType.Auto,))
    available = jax.local_devices()
    if devices < 0 or devices > len(available):
        raise ConfigError(f"config.execution.devices={devices}: this process sees "
                         f"{len(available)} device(s) ({available[0].platform}); use 0 for all "
                         f"or a number up to {len(available)}")
    chosen = available[: devices or len(available)]
    return Mesh(np.array(chosen), (CLIENT_AXIS,), axis_types=(AxisType.Auto,))


def row_spec(shape: tuple[int, ...], mesh: Mesh) -> P:
    """Where a stacked per-client array ([clients, ...]) lives on the mesh: split by client
    when the count is a multiple of the mesh size (each device, and each process, holds its
    share), else replicated. A function of the shape alone, so every round and every process
    agree."""
    return P(CLIENT_AXIS) if len(shape) and shape[0] % mesh.size == 0 else P()


def _placed(x, mesh: Mesh, spec: P):
    if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and (
            x.sharding.mesh == mesh or not x.is_fully_addressable):
        return x  # already on the mesh
    sharding = NamedSharding(mesh, spec)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    # Several processes: every process holds the whole value (all of them compute it,
    # `distributed`) and places the parts its own devices hold.
    x = jnp.asarray(x)
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [jax.device_put(x[index], d)
                            for d, index in sharding.addressable_devices_indices_map(
                                x.shape).items()])


def replicated(tree: PyTree, mesh: Mesh) -> PyTree:
    """`tree` replicated on every device of `mesh` (arrays already on the mesh stay as they
    are)."""
    return jax.tree.map(lambda x: _placed(x, mesh, P()), tree)


def client_rows(tree: PyTree, mesh: Mesh) -> PyTree:
    """Stacked per-client arrays placed on `mesh` as `row_spec` says (arrays already on the
    mesh stay as they are)."""
    return jax.tree.map(lambda x: _placed(x, mesh, row_spec(np.shape(x), mesh)), tree)


def local_copy(tree: PyTree) -> PyTree:
    """This process's copy of arrays replicated on a mesh, on its first local device."""
    device = jax.local_devices()[0]

    def local(x):
        if x.is_fully_addressable:
            return jax.device_put(x, device)
        return jax.device_put(x.addressable_shards[0].data, device)

    return jax.tree.map(local, tree)
