"""What an execution strategy is and how it plugs in: the `Strategy` record and its registry
(`config.execution.strategy`), the `CohortRunner` it builds, the options it is built with, and
`Finishing`, the broadcast that lets a strategy finish each participant's upload inside the
client program. The built-in strategies register themselves in the modules beside this one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from flax import struct
from jax.sharding import Mesh

from fedjax_pfedes.algorithms.base import CohortProgram, Metrics, PyTree
from fedjax_pfedes.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class RunnerOptions:
    """What a strategy's runner is built with (`make_runner`).

    Attributes:
      mesh: the device mesh of `client_mesh` (strategies that `needs_mesh`), else None.
      loop_threads: host threads of 'loop' and of 'scan''s lanes (already resolved: >= 1).
      scan_chunk: participants vmapped together per iteration of the scan.
      jit: `jax.jit` with the run's compiler options (CPU kernels).
      eval_budget_bytes: the memory one mapped evaluation call may take ('vmap', 'shard':
        `eval_memory.clients_per_call`).
    """

    mesh: Mesh | None
    loop_threads: int
    scan_chunk: int
    jit: Callable
    eval_budget_bytes: float


@dataclasses.dataclass(frozen=True)
class Strategy:
    """An execution strategy: how a cohort's per-client functions run over the participants
    (`config.execution.strategy`). Every strategy must compute the same numbers up to float
    reassociation (tests/execution/test_execution.py and tests/execution/test_sharding.py
    check the shipped four against each other; a new one needs its own such test).

    Attributes:
      name: the config name.
      build: (program, RunnerOptions) -> CohortRunner.
      cost: how `execution.choice` prices a round from one timed call: 'per_participant' (each
        participant's own steps: loop, scan) or 'longest_schedule' (every slot iterates until
        the bucket's longest schedule ends: vmap, shard).
      needs_mesh: runs over a device mesh (states and samples are put on it; buckets are
        multiples of its size); 'auto' considers it only with more than one device.
      streams_uploads: sums the uploads as they are made when the server step allows it
        (`upload.streaming`).
      auto: a candidate of `strategy='auto'`.
    """

    name: str
    build: Callable[[CohortProgram, RunnerOptions], CohortRunner]
    cost: str = "per_participant"
    needs_mesh: bool = False
    streams_uploads: bool = False
    auto: bool = True

    def __post_init__(self):
        if self.cost not in ("per_participant", "longest_schedule"):
            raise ValueError(f"strategy '{self.name}': cost must be 'per_participant' or "
                             f"'longest_schedule', got '{self.cost}'")


_STRATEGIES: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy) -> Strategy:
    """Makes an execution strategy usable by name in `config.execution.strategy`.

    Args:
      strategy: its name, runner factory, cost model and needs.

    Returns:
      `strategy`. A name may be taken once.
    """
    if strategy.name == "auto":
        raise ValueError("execution strategy 'auto' is reserved (the per-cohort choice)")
    if strategy.name in _STRATEGIES:
        raise ValueError(f"execution strategy '{strategy.name}' is registered twice")
    _STRATEGIES[strategy.name] = strategy
    return strategy


def strategy(name: str) -> Strategy:
    """The registered strategy `name` (ValueError naming the config field when unknown)."""
    if name not in _STRATEGIES:
        raise ConfigError(f"config.execution.strategy: unknown strategy '{name}'; "
                         f"known: {['auto', *_STRATEGIES]}")
    return _STRATEGIES[name]


def strategy_names() -> tuple[str, ...]:
    """Every registered strategy's name, in registration order."""
    return tuple(_STRATEGIES)


def resolve_strategy(name: str) -> str:
    """Checks `config.execution.strategy`: a registered strategy, or 'auto' (chosen per
    cohort by timing the applicable ones on the run's backend, see `execution.choice`)."""
    if name != "auto":
        strategy(name)
    return name


def needs_mesh(requested: str) -> bool:
    """Whether `config.execution.strategy` = `requested` builds a device mesh."""
    return requested == "auto" or strategy(requested).needs_mesh


def auto_candidates(mesh: Mesh | None) -> tuple[str, ...]:
    """The strategies 'auto' times: those on a mesh only when it has more than one device."""
    multi_device = mesh is not None and mesh.size > 1
    return tuple(s.name for s in _STRATEGIES.values()
                 if s.auto and (multi_device or not s.needs_mesh))


@dataclasses.dataclass(frozen=True)
class CohortRunner:
    """Executes a cohort's `CohortProgram` with one strategy.

    update(broadcast, states, train, slots, keys) -> (uploads, states, metrics):
      `states` and `train` are stacked over the cohort's clients; `slots` [bucket] holds the local
      indices of this round's participants, padded with `num_clients` (out of range); `keys`
      [bucket] are the participants' RNG keys. Returned uploads and metrics are stacked over the
      bucket (zeros in padded slots); states of non-participants are unchanged.
    evaluate(broadcast, states, test, global_x=None, global_y=None) -> metrics stacked over all
      clients: the program's local-test metrics, and 'global_accuracy' (`base.global_accuracy`)
      when a global test set is given.
    evaluate_slots(broadcast, states, test, slots, global_x=None, global_y=None) -> the same for
      the clients in `slots` only, stacked over the bucket (zeros in padded slots); the
      per-round monitoring (loss before / after aggregation) uses it without a global set.
      The local metrics and the global accuracy are separate compiled programs, so the
      monitoring's program is the evaluation's, compiled once.
    computed_steps(steps, bucket) -> local steps the hardware executed for a round whose real
      participants ran `steps` [participants] steps in `bucket` slots: their sum for 'loop'; for
      'vmap' every slot iterates until the longest schedule ends, bucket * max(steps).
    prefetch(states, local_indices) -> None, or None for runners that have nothing to prefetch:
      a hint that these clients will probably train next; a runner whose states live on disk
      starts reading their rows while the current round computes. It never changes results.
    kernels: the CPU kernels its programs were compiled with ('xla' or 'eigen', `kernel_options`).
    """

    strategy: str
    update: Callable[..., tuple[PyTree, PyTree, Metrics]]
    evaluate: Callable[..., Metrics]
    evaluate_slots: Callable[..., Metrics]
    computed_steps: Callable[[np.ndarray, int], float]
    prefetch: Callable[[PyTree, np.ndarray], None] | None = None
    kernels: str = "xla"

    @property
    def name(self) -> str:
        """The strategy, with '/eigen' when the client programs use XLA's Eigen kernels: what
        summary.json and a checkpoint record, and how `execution.choice` tells runners apart."""
        return self.strategy if self.kernels == "xla" else f"{self.strategy}/{self.kernels}"


def evaluating_every_client(evaluate_slots: Callable[..., Metrics]) -> Callable[..., Metrics]:
    """`CohortRunner.evaluate` of a runner whose `evaluate_slots` takes any slots at once: the
    slots of every client of the cohort, in order.

    Args:
      evaluate_slots: the runner's `evaluate_slots`.

    Returns:
      evaluate(broadcast, states, test, global_x=None, global_y=None).
    """
    def evaluate(broadcast, states, test, global_x=None, global_y=None):
        every = np.arange(test.sizes.shape[0], dtype=np.int32)
        return evaluate_slots(broadcast, states, test, every, global_x, global_y)

    return evaluate


UPLOAD_FACTS = "upload_facts"  # the metrics entry of `Finishing.fn`'s per-client results


@struct.dataclass
class Finishing:
    """A broadcast that asks the cohort's program to finish each participant's upload too.

    Passed to `CohortRunner.update` instead of the plain broadcast, it makes every strategy run
    `fn(upload, operand)` right after the client's local update, inside the same compiled
    program, while the upload is in cache: its per-client results (a dict of scalars, e.g. the
    update norm and the upload checks' facts) come back stacked under `metrics[UPLOAD_FACTS]`.
    Without it, a pass over the stacked uploads computes them afterwards. `fn` is static (part
    of the compiled program's identity): pass the same function object every round.

    With a `reducer` (the 'scan' strategy only; `upload.streaming`), the uploads are not
    stacked at all: each is added into the reducer's carry as it is made, and the update
    returns the final carry in the uploads' place.

    Attributes:
      broadcast: what the clients receive (`Algorithm.broadcast`).
      operand: a pytree `fn` reads besides the upload (e.g. `Algorithm.upload_template`).
      fn: (upload, operand) -> {name: scalar} for one client.
      reducer: None, or an object with `init(operand) -> carry` and `add(carry, upload, facts,
        size, position, valid, operand) -> carry`, `facts` being `fn`'s result and `position`
        the client's slot in the bucket (`upload.streaming.StreamingMean`,
        `StreamingClippedSum`).
    """

    broadcast: PyTree
    operand: PyTree
    fn: Callable = struct.field(pytree_node=False)
    reducer: object = struct.field(pytree_node=False, default=None)


def refuse_reducer(broadcast, strategy: str) -> None:
    if isinstance(broadcast, Finishing) and broadcast.reducer is not None:
        raise ValueError(f"a streaming reducer needs the 'scan' strategy, not '{strategy}' "
                         "(config.execution.strategy)")


def finishing_program(program: CohortProgram) -> CohortProgram:
    """`program` whose client update also accepts a `Finishing` broadcast (see there); with a
    plain broadcast it is `program.client_update` itself. A program that already accepts one
    is returned as it is: the runners of one cohort then share one function, and so JAX's trace
    of it (`execution.choice` reads the same trace the chosen runner compiles)."""
    if getattr(program.client_update, "accepts_finishing", False):
        return program

    def client_update(broadcast, state, data, rng):
        if not isinstance(broadcast, Finishing):
            return program.client_update(broadcast, state, data, rng)
        upload, state, metrics = program.client_update(broadcast.broadcast, state, data, rng)
        return upload, state, {**metrics, UPLOAD_FACTS: broadcast.fn(upload, broadcast.operand)}

    client_update.accepts_finishing = True
    return dataclasses.replace(program, client_update=client_update)
