"""One run over several processes (hosts) with JAX's own multi-controller runtime.

Every process runs the same program (`python -m launch.main ...` once per process, SPMD): it
loads and partitions the data itself (same seed, same result), keeps the server state and the
sampler, and runs the same server step. What is split is the work of each round's participants
and the clients: under `config.execution.strategy='shard'` the mesh spans the devices of all
processes, so each process's devices train their share of the participant slots and hold their
share of the clients' states and samples (when a cohort's client count is a multiple of the
device count, `execution.runners.row_spec`; else every device holds all of them); uploads and
metrics are gathered back to every process (`execution`). Only process 0 writes the run's files
(metrics, summary, report inputs, checkpoints); the others write into a temporary folder that is
removed at the end. On resume process 0 picks the checkpoint (integrity checks, corrupt steps
set aside) and tells the others its round; every process then reads that checkpoint from
process 0's workdir, so across hosts the workdir must be on a filesystem they all share (or not
checkpoint).

`config.distributed`:
  coordinator_address: '' = one process (the default); 'host:port' of process 0's
    coordinator; 'auto' = let `jax.distributed.initialize` read the cluster's environment (Cloud
    TPU pods, SLURM, Open MPI, ...; then num_processes / process_id are ignored).
  num_processes, process_id: this run's process count and this process's index (0-based).
  cpu_collectives: collectives between CPU processes ('gloo'; 'mpi' needs an MPI library);
    ignored on GPU / TPU.

Not yet across processes (each refused with one line): client states off the device,
asynchronous rounds, 'loop' / 'vmap' / 'auto' strategies, and `launch.sweep`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from fedjax_pfedes.config import fields
from fedjax_pfedes.config.defaults import DistributedSection
from fedjax_pfedes.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Settings:
    coordinator_address: str = DistributedSection.coordinator_address
    num_processes: int = DistributedSection.num_processes
    process_id: int = DistributedSection.process_id
    cpu_collectives: str = DistributedSection.cpu_collectives

    @property
    def multi_process(self) -> bool:
        return self.coordinator_address == "auto" or self.num_processes > 1


CPU_COLLECTIVES = ("gloo", "mpi")


def settings(section: DistributedSection | ml_collections.ConfigDict | None) -> Settings:
    """`Settings` from the config's `distributed` section (built, or the config's to build),
    checked (ConfigError naming the field); one process when the section is absent (None)."""
    if section is None:
        return Settings()
    if not isinstance(section, DistributedSection):  # not built yet: before validation
        section = fields.build(DistributedSection, section.to_dict())
    s = Settings(**dataclasses.asdict(section))
    if s.coordinator_address == "auto":
        return s
    if not 0 <= s.process_id < s.num_processes:
        raise ConfigError(f"config.distributed.process_id={s.process_id} is out of range for "
                         f"config.distributed.num_processes={s.num_processes} (0.."
                         f"{s.num_processes - 1}): give each process its own index")
    if s.num_processes > 1 and ":" not in s.coordinator_address:
        raise ConfigError("config.distributed.coordinator_address: several processes need "
                         "process 0's 'host:port' (or 'auto' on a TPU pod / SLURM), got "
                         f"{s.coordinator_address!r}")
    if s.cpu_collectives not in CPU_COLLECTIVES:
        raise ConfigError(f"config.distributed.cpu_collectives must be one of {CPU_COLLECTIVES},"
                         f" got {s.cpu_collectives!r}")
    return s


def initialize(s: Settings) -> None:
    """Joins this process to the run's other processes (`jax.distributed.initialize`) before
    anything touches a JAX backend; nothing for a one-process run. Idempotent."""
    if not s.multi_process or jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", s.cpu_collectives)
    if s.coordinator_address == "auto":
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(s.coordinator_address, s.num_processes, s.process_id)


def is_writer() -> bool:
    """Whether this process writes the run's files (process 0, or the only process)."""
    return jax.process_index() == 0


def from_process_0(value: int) -> int:
    """Process 0's `value` on every process (a collective: all processes call it); `value` as
    it is in a one-process run."""
    if jax.process_count() == 1:
        return value
    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def process_local(tree: Any) -> Any:
    """What a checkpoint saves and restores over several processes: every array as a whole
    numpy copy on this process (orbax saves only numpy from one process of several). Arrays
    split over the processes' devices are gathered: a collective, so every process calls this
    at the same point. One process: `tree` as it is."""
    if jax.process_count() == 1:
        return tree

    def local(x):
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_shards[0].data)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(local, tree)
