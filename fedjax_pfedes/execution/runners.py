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
(`execution.choice`), see benchmarks/execution_strategies.py for the side-by-side numbers.

On a CPU backend the client programs can also be compiled with two kernel libraries
(`config.execution.cpu_kernels`, `kernel_options`): which is faster depends on the CPU and the
layers, so 'auto' times both per cohort too. A runner's `name` says both choices: the strategy,
and '/eigen' when the Eigen kernels were chosen ('loop', 'loop/eigen', 'vmap', ...).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fedjax_pfedes.algorithms.base import CohortProgram, Metrics, PyTree, global_accuracy
from fedjax_pfedes.execution import eval_memory
from fedjax_pfedes.tree_util import put_rows, take_rows

CPU_KERNELS = ("xla", "eigen")
KERNEL_SETTINGS = CPU_KERNELS + ("auto",)  # what config.execution.cpu_kernels accepts
CLIENT_AXIS = "clients"  # the mesh axis the participant slots are split over


@dataclasses.dataclass(frozen=True)
class RunnerOptions:
    """What a strategy's runner is built with (`make_runner`).

    Attributes:
      mesh: the device mesh of `client_mesh` (strategies that `needs_mesh`), else None.
      loop_threads: host threads of the loop (already resolved: >= 1).
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
        raise ValueError(f"config.execution.strategy: unknown strategy '{name}'; "
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


def kernel_options(cpu_kernels: str) -> dict[str, str]:
    """XLA compiler options of the client programs (local update, evaluation) for
    `config.execution.cpu_kernels`: 'xla' (none: XLA:CPU's own choice, which in jaxlib 0.10
    hands convolutions and matrix products to YNNPACK fusions) or 'eigen' (YNNPACK fusions off:
    XLA's Eigen-based kernels). Which is faster depends on the CPU and the layers
    (docs/performance.md); the two agree up to float reassociation. Empty off the CPU backend."""
    if cpu_kernels not in CPU_KERNELS:
        raise ValueError(f"config.execution.cpu_kernels must be one of {list(CPU_KERNELS)} "
                         f"('auto' picks one per cohort, `kernel_candidates`), got "
                         f"{cpu_kernels!r}")
    if cpu_kernels == "xla" or jax.default_backend() != "cpu":
        return {}
    return {"xla_cpu_experimental_ynn_fusion_type": ""}


def kernel_candidates(cpu_kernels: str) -> tuple[str, ...]:
    """The kernel choices a run compiles for `config.execution.cpu_kernels`: the one given, or
    for 'auto' both of `CPU_KERNELS` on a CPU backend (timed per cohort, `execution.choice`) and
    'xla' elsewhere (the option only exists for XLA:CPU)."""
    if cpu_kernels == "auto":
        return CPU_KERNELS if jax.default_backend() == "cpu" else ("xla",)
    kernel_options(cpu_kernels)  # refuses a name it does not know
    return (cpu_kernels,)


def auto_candidates(mesh: Mesh | None) -> tuple[str, ...]:
    """The strategies 'auto' times: those on a mesh only when it has more than one device."""
    multi_device = mesh is not None and mesh.size > 1
    return tuple(s.name for s in _STRATEGIES.values()
                 if s.auto and (multi_device or not s.needs_mesh))


def client_mesh(devices: int) -> Mesh:
    """A one-axis mesh ('clients') over the first `devices` local devices (0 = all of them);
    in a run over several processes (`distributed`), over all devices of all processes.
    Auto axis types: the runner states its shardings itself (`shard_map`)."""
    if jax.process_count() > 1:
        return Mesh(np.array(jax.devices()), (CLIENT_AXIS,), axis_types=(AxisType.Auto,))
    available = jax.local_devices()
    if devices < 0 or devices > len(available):
        raise ValueError(f"config.execution.devices={devices}: this process sees "
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


def _refuse_reducer(broadcast, strategy: str) -> None:
    if isinstance(broadcast, Finishing) and broadcast.reducer is not None:
        raise ValueError(f"a streaming reducer needs the 'scan' strategy, not '{strategy}' "
                         "(config.execution.strategy)")


def finishing_program(program: CohortProgram) -> CohortProgram:
    """`program` whose client update also accepts a `Finishing` broadcast (see there); with a
    plain broadcast it is `program.client_update` itself."""
    def client_update(broadcast, state, data, rng):
        if not isinstance(broadcast, Finishing):
            return program.client_update(broadcast, state, data, rng)
        upload, state, metrics = program.client_update(broadcast.broadcast, state, data, rng)
        return upload, state, {**metrics, UPLOAD_FACTS: broadcast.fn(upload, broadcast.operand)}

    return dataclasses.replace(program, client_update=client_update)


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


def _vmapped(fn: Callable, in_axes: tuple) -> Callable:
    return jax.vmap(fn, in_axes=in_axes)


def _sharded(fn: Callable, in_axes: tuple, mesh: Mesh) -> Callable:
    """`fn` vmapped over the slots of each device's share (axes None: replicated)."""
    specs = tuple(P() if a is None else P(CLIENT_AXIS) for a in in_axes)
    return jax.shard_map(jax.vmap(fn, in_axes=in_axes), mesh=mesh, in_specs=specs,
                         out_specs=P(CLIENT_AXIS), check_vma=False)


def _mapped_runner(program: CohortProgram, name: str, map_clients: Callable,
                   mesh: Mesh | None = None, jit: Callable = jax.jit,
                   eval_budget_bytes: float = eval_memory.DEFAULT_BUDGET_GB * 2**30
                   ) -> CohortRunner:
    """'vmap' and 'shard': one jitted call maps the client function over all slots;
    `map_clients(fn, in_axes)` says how (plain vmap, or vmap per device under shard_map).
    `jit`: `jax.jit` with the client programs' compiler options (`kernel_options`).
    Evaluation maps over as many clients per call as `eval_budget_bytes` allows
    (`eval_memory.clients_per_call`): all of them in one call when they fit."""
    client_update = map_clients(program.client_update, (None, 0, 0, 0))
    client_evaluate = map_clients(program.evaluate, (None, 0, 0))
    client_global = map_clients(functools.partial(global_accuracy, program), (None, 0, None, None))
    # 'shard': the cohort's samples and stacked states live on the mesh, split by client where
    # `row_spec` allows (put there once, `engine.build.build_context`); a broadcast, the sizes and
    # this round's slots are replicated per call; uploads and metrics go back to the default
    # device, where the server step runs.
    on_mesh = (lambda tree: tree) if mesh is None else functools.partial(replicated, mesh=mesh)
    rows_on_mesh = (lambda tree: tree) if mesh is None else functools.partial(client_rows,
                                                                              mesh=mesh)
    data_on_mesh = (lambda data: data) if mesh is None else (  # samples split, sizes replicated
        lambda data: on_mesh(data.replace(x=rows_on_mesh(data.x), y=rows_on_mesh(data.y))))
    home = (lambda tree: tree) if mesh is None else local_copy
    # The updated states keep their placement (split by client where `row_spec` says so).
    kept = (lambda tree: tree) if mesh is None else (lambda tree: jax.tree.map(
        lambda a: jax.lax.with_sharding_constraint(
            a, NamedSharding(mesh, row_spec(a.shape, mesh))), tree))
    # Over several processes the slots' results must reach every process: gathered (replicated
    # on the mesh) inside the program, then each process takes its local copy.
    gathered = (lambda tree: tree) if mesh is None or jax.process_count() == 1 else (
        lambda tree: jax.lax.with_sharding_constraint(tree, NamedSharding(mesh, P())))

    @functools.partial(jit, donate_argnums=1)
    def mapped_update(broadcast, states, train, slots, keys):
        valid = slots < train.sizes.shape[0]
        rows = take_rows(train, slots)
        # Padded slots hold no samples, so they take no local steps (their results are dropped).
        rows = rows.replace(sizes=jnp.where(valid, rows.sizes, 0))
        uploads, new_rows, metrics = client_update(broadcast, take_rows(states, slots), rows, keys)
        zero_padded = lambda a: jnp.where(valid.reshape((-1,) + (1,) * (a.ndim - 1)), a,  # noqa: E731
                                          jnp.zeros((), a.dtype))  # keeps bools bools
        return (gathered(jax.tree.map(zero_padded, uploads)),
                kept(put_rows(states, slots, new_rows)),
                gathered(jax.tree.map(zero_padded, metrics)))

    @jit
    def mapped_evaluate_slots(broadcast, states, test, slots):
        valid = slots < test.sizes.shape[0]
        metrics = client_evaluate(broadcast, take_rows(states, slots), take_rows(test, slots))
        return gathered(jax.tree.map(lambda a: jnp.where(valid, a, 0), metrics))

    @jit
    def mapped_global_slots(broadcast, states, sizes, slots, global_x, global_y):
        valid = slots < sizes.shape[0]
        accuracy = client_global(broadcast, take_rows(states, slots), global_x, global_y)
        return gathered(jnp.where(valid, accuracy, 0))

    def update(broadcast, states, train, slots, keys):
        _refuse_reducer(broadcast, name)
        uploads, states, metrics = mapped_update(on_mesh(broadcast), rows_on_mesh(states),
                                                 data_on_mesh(train),
                                                 on_mesh(jnp.asarray(slots)), on_mesh(keys))
        return home(uploads), states, home(metrics)

    def evaluate_slots(broadcast, states, test, slots, global_x=None, global_y=None):
        broadcast, states, slots = on_mesh(broadcast), rows_on_mesh(states), on_mesh(
            jnp.asarray(slots))
        metrics = home(mapped_evaluate_slots(broadcast, states, data_on_mesh(test), slots))
        if global_x is None:
            return metrics
        return {**metrics, "global_accuracy": home(mapped_global_slots(
            broadcast, states, on_mesh(test.sizes), slots, *on_mesh((global_x, global_y))))}

    widths: dict = {}  # per shapes of the evaluation: clients per call

    def evaluate(broadcast, states, test, global_x=None, global_y=None):
        n = test.sizes.shape[0]
        multiple = 1 if mesh is None else mesh.size  # shard_map splits the slots evenly
        padded = -(-n // multiple) * multiple  # slots past n are out of range: zeros
        global_rows = 0 if global_x is None else int(global_x.shape[0])
        key = (jax.tree.structure(states), tuple(test.x.shape), global_rows,
               tuple(np.shape(a) for a in jax.tree.leaves(broadcast)))
        if key not in widths:
            widths[key] = eval_memory.clients_per_call(program, broadcast, states, test,
                                                       global_rows, eval_budget_bytes,
                                                       multiple)
        width = min(widths[key], padded)
        outs = [evaluate_slots(broadcast, states, test,
                               np.arange(start, start + width, dtype=np.int32), global_x,
                               global_y) for start in range(0, n, width)]
        out = outs[0] if len(outs) == 1 else jax.tree.map(
            lambda *parts: jnp.concatenate(parts), *outs)
        return out if len(outs) * width == n else jax.tree.map(lambda a: a[:n], out)

    def computed_steps(steps: np.ndarray, bucket: int) -> float:
        return float(bucket * np.max(steps)) if len(steps) else 0.0

    return CohortRunner(name, update, evaluate, evaluate_slots, computed_steps)


def _scan_runner(program: CohortProgram, chunk: int = 1, jit: Callable = jax.jit
                 ) -> CohortRunner:
    """'scan': a cohort's participants pass through one compiled `lax.scan`, `chunk` of them
    per iteration (one at a time: the client function itself; more: vmapped over the chunk).

    The stacked private states are the scan's carry, updated row by row in place (the buffer is
    donated); uploads and metrics are its stacked outputs. One program per round however many
    participants: no per-client dispatch as in 'loop', and at `chunk` = 1 only one client's model
    and activations are live at a time instead of the bucket's copies of 'vmap' (a small model
    then stays in cache). Padded slots (out of range) hold no samples, take no local step, write
    nothing and return zeros. Evaluation maps the per-client programs the same way (`lax.map`).
    `jit`: `jax.jit` with the client programs' compiler options (`kernel_options`)."""
    if chunk < 1:
        raise ValueError(f"config.execution.scan_chunk must be >= 1, got {chunk}")
    per_chunk = (lambda fn, in_axes: fn) if chunk == 1 else (
        lambda fn, in_axes: jax.vmap(fn, in_axes=in_axes))
    client_update = per_chunk(program.client_update, (None, 0, 0, 0))

    def chunked(slots: jax.Array, n: int) -> jax.Array:
        """[bucket] -> [bucket / chunk, chunk] (padded out of range), or [bucket] at chunk 1."""
        if chunk == 1:
            return slots
        pad = -slots.shape[0] % chunk
        return jnp.concatenate([slots, jnp.full((pad,), n, slots.dtype)]).reshape(-1, chunk)

    def unchunked(tree: PyTree, bucket: int) -> PyTree:
        if chunk == 1:
            return tree
        return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:])[:bucket], tree)

    def rows_at(tree: PyTree, slot: jax.Array) -> PyTree:
        return _row(tree, slot) if chunk == 1 else take_rows(tree, slot)

    def write_rows(tree: PyTree, slot: jax.Array, valid: jax.Array, rows: PyTree) -> PyTree:
        if chunk > 1:
            return put_rows(tree, slot, rows)  # out-of-range slots are dropped
        i = jnp.minimum(slot, jax.tree.leaves(tree)[0].shape[0] - 1)
        return jax.tree.map(lambda a, r: jax.lax.dynamic_update_index_in_dim(
            a, jnp.where(valid, r, jax.lax.dynamic_index_in_dim(a, i, keepdims=False)), i, 0),
            tree, rows)

    def zero_padded(tree: PyTree, valid: jax.Array) -> PyTree:
        return jax.tree.map(lambda a: jnp.where(
            valid.reshape(valid.shape + (1,) * (a.ndim - valid.ndim)), a,
            jnp.zeros((), a.dtype)), tree)  # a bool stays a bool

    @functools.partial(jit, donate_argnums=1)
    def scanned_update(broadcast, states, train, slots, keys):
        n = train.sizes.shape[0]
        bucket = slots.shape[0]
        padded_keys = keys if chunk == 1 else jnp.concatenate(
            [keys, keys[jnp.zeros(-bucket % chunk, jnp.int32)]]).reshape(-1, chunk)

        reducer = broadcast.reducer if isinstance(broadcast, Finishing) else None

        def reduce(carry, upload, metrics, sizes, position, valid):
            facts = metrics[UPLOAD_FACTS]
            template = broadcast.operand
            if chunk == 1:
                return reducer.add(carry, upload, facts, sizes, position, valid, template)
            return jax.lax.scan(lambda c, xs: (reducer.add(c, *xs, template), None), carry,
                                (upload, facts, sizes, position, valid))[0]

        def body(carry, xs):
            states, reduced = carry
            slot, key, position = xs
            valid = slot < n
            rows = rows_at(train, slot)
            # A padded slot holds no samples, so it takes no local step.
            rows = rows.replace(sizes=jnp.where(valid, rows.sizes, 0))
            upload, new_rows, metrics = client_update(broadcast, rows_at(states, slot), rows, key)
            states = write_rows(states, slot, valid, new_rows)
            if reducer is None:  # the uploads are stacked outputs
                return (states, reduced), (zero_padded(upload, valid),
                                           zero_padded(metrics, valid))
            reduced = reduce(reduced, upload, metrics, rows.sizes, position, valid)
            return (states, reduced), (None, zero_padded(metrics, valid))

        start = None if reducer is None else reducer.init(broadcast.operand)
        positions = chunked(jnp.arange(bucket, dtype=jnp.int32), bucket)  # slot j of the bucket
        (states, reduced), (uploads, metrics) = jax.lax.scan(
            body, (states, start), (chunked(slots, n), padded_keys, positions))
        uploads = unchunked(uploads, bucket) if reducer is None else reduced
        return uploads, states, unchunked(metrics, bucket)

    def mapped(fn: Callable, slots: jax.Array, n: int) -> PyTree:
        """fn(slot) -> per-client pytree, over `slots`, `chunk` at a time; zeros where padded."""
        def one(slot):
            return zero_padded(fn(jnp.minimum(slot, n - 1)), slot < n)
        return jax.lax.map(one, slots, batch_size=chunk if chunk > 1 else None)

    @jit
    def scanned_evaluate_slots(broadcast, states, test, slots):
        n = test.sizes.shape[0]
        return mapped(lambda i: program.evaluate(broadcast, _row(states, i), _row(test, i)),
                      slots, n)

    @jit
    def scanned_global_slots(broadcast, states, sizes, slots, global_x, global_y):
        return mapped(lambda i: global_accuracy(program, broadcast, _row(states, i), global_x,
                                                global_y), slots, sizes.shape[0])

    def update(broadcast, states, train, slots, keys):
        return scanned_update(broadcast, states, train, jnp.asarray(slots, jnp.int32), keys)

    def evaluate_slots(broadcast, states, test, slots, global_x=None, global_y=None):
        slots = jnp.asarray(slots, jnp.int32)
        metrics = scanned_evaluate_slots(broadcast, states, test, slots)
        if global_x is None:
            return metrics
        return {**metrics, "global_accuracy": scanned_global_slots(
            broadcast, states, test.sizes, slots, global_x, global_y)}

    def evaluate(broadcast, states, test, global_x=None, global_y=None):
        every = np.arange(test.sizes.shape[0], dtype=np.int32)
        return evaluate_slots(broadcast, states, test, every, global_x, global_y)

    def computed_steps(steps: np.ndarray, bucket: int) -> float:
        del bucket  # padded slots take no step
        if chunk == 1 or not len(steps):
            return float(np.sum(steps))
        # A chunk iterates until its longest schedule ends (participants fill the first slots).
        padded = np.concatenate([steps, np.zeros(-len(steps) % chunk)]).reshape(-1, chunk)
        return float(chunk * padded.max(axis=1).sum())

    return CohortRunner("scan", update, evaluate, evaluate_slots, computed_steps)


def balanced_groups(slots: np.ndarray, weights: np.ndarray, groups: int) -> list[np.ndarray]:
    """Positions of `slots` split into `groups` lists of nearly equal total weight (longest
    first onto the lightest list; ties in slot order), each list in ascending position order.
    The 'loop' strategy's threads take one list each."""
    lists: list[list[int]] = [[] for _ in range(groups)]
    load = np.zeros(groups)
    for j in sorted(range(len(slots)), key=lambda j: (-weights[j], j)):
        g = int(np.argmin(load))
        lists[g].append(j)
        load[g] += weights[j]
    return [np.asarray(sorted(g), np.int64) for g in lists]


def _loop_runner(program: CohortProgram, threads: int = 1, jit: Callable = jax.jit
                 ) -> CohortRunner:
    """One jitted call per participant. Each training call also writes the client's upload and
    metrics into row `j` of bucket-shaped output buffers (donated, updated in place), so a round
    runs no eager per-leaf stacking and nothing compiles after the first call. Evaluation calls
    return one client's metrics (and, given a global test set, its `global_accuracy` from a
    second program), written into the bucket by a small donated call: the monitoring of a
    round's participants and the evaluation of every client then share one compiled program.

    With `threads` > 1 the participants are split over host threads (`balanced_groups` by
    sample count); each thread's calls return the client's outputs, which the calling thread
    then writes into the bucket and the state rows (one small donated call each). Every client
    computes the same function of the same inputs, so the numbers are those of one thread.
    `jit`: `jax.jit` with the client programs' compiler options (`kernel_options`)."""

    # Traced once: the output shapes below and the jitted call share this trace.
    client_update = jax.jit(program.client_update)

    @functools.partial(jit, donate_argnums=(1, 5, 6))
    def one_client_update(broadcast, states, train, i, key, uploads, metrics, j):
        upload, new_row, m = client_update(broadcast, _row(states, i), _row(train, i), key)
        return (_set_row(uploads, j, upload), _set_row(states, i, new_row),
                _set_row(metrics, j, m))

    shapes: dict = {}  # output shapes, traced once per kind (they never change)

    def update_buffers(broadcast, states, train, keys, bucket):
        # A `Finishing` broadcast adds outputs: its function is part of the shapes' key.
        kind = ("update", broadcast.fn if isinstance(broadcast, Finishing) else None)
        if kind not in shapes:
            row = functools.partial(jax.eval_shape, lambda tree: _row(tree, 0))
            shapes[kind] = client_update.eval_shape(broadcast, row(states), row(train), keys[0])
        uploads, _, metrics = shapes[kind]
        return _zeros_in_slots((uploads, metrics), bucket)

    @jit
    def one_update(broadcast, states, train, i, key):  # the threads' calls: outputs only
        return client_update(broadcast, _row(states, i), _row(train, i), key)

    @jit
    def one_evaluate(broadcast, states, test, i):
        return program.evaluate(broadcast, _row(states, i), _row(test, i))

    def evaluate_buffer(broadcast, states, test, bucket):
        if "evaluate" not in shapes:  # the same trace as one_evaluate's first call
            shapes["evaluate"] = one_evaluate.eval_shape(broadcast, states, test, jnp.int32(0))
        return _zeros_in_slots(shapes["evaluate"], bucket)

    @jit
    def one_global(broadcast, states, i, global_x, global_y):
        return global_accuracy(program, broadcast, _row(states, i), global_x, global_y)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def put_update(uploads, states, metrics, i, j, outputs):
        upload, new_row, m = outputs
        return (_set_row(uploads, j, upload), _set_row(states, i, new_row),
                _set_row(metrics, j, m))

    put_evaluate = jax.jit(_set_row, donate_argnums=0)

    def update(broadcast, states, train, slots, keys):
        _refuse_reducer(broadcast, "loop")
        slots = np.asarray(slots)
        real = np.flatnonzero(slots < train.sizes.shape[0])
        uploads, metrics = update_buffers(broadcast, states, train, keys, len(slots))
        if pool is not None and len(real):
            sizes = np.asarray(train.sizes)[slots[real]].astype(np.float64)
            outputs = pool.run("update", lambda j: one_update(
                broadcast, states, train, jnp.int32(slots[j]), keys[j]), real, sizes)
            for j in real:
                uploads, states, metrics = put_update(uploads, states, metrics,
                                                      jnp.int32(slots[j]), jnp.int32(j),
                                                      outputs[int(j)])
            return uploads, states, metrics
        for j in real:
            uploads, states, metrics = one_client_update(
                broadcast, states, train, jnp.int32(slots[j]), keys[j], uploads, metrics,
                jnp.int32(j))
        return uploads, states, metrics

    def evaluate_slots(broadcast, states, test, slots, global_x=None, global_y=None):
        slots = np.asarray(slots)
        real = np.flatnonzero(slots < test.sizes.shape[0])
        out = evaluate_buffer(broadcast, states, test, len(slots))
        accuracy = None if global_x is None else _zeros_in_slots(
            jax.ShapeDtypeStruct((), jnp.float32), len(slots))
        if not len(real):
            return out if accuracy is None else {**out, "global_accuracy": accuracy}
        # Unlike training, the per-client programs here take no bucket-shaped buffer, so the
        # monitoring (a round's participants) and the evaluation of every client share them.
        run = (lambda kind, call, weights: pool.run(kind, call, real, weights)) if pool else (
            lambda kind, call, weights: {int(j): call(int(j)) for j in real})
        sizes = np.asarray(test.sizes)[slots[real]].astype(np.float64)
        outputs = run("evaluate", lambda j: one_evaluate(broadcast, states, test,
                                                         jnp.int32(slots[j])), sizes)
        for j in real:
            out = put_evaluate(out, jnp.int32(j), outputs[int(j)])
        if accuracy is None:
            return out
        scores = run(f"global{global_x.shape}", lambda j: one_global(  # equal work per client
            broadcast, states, jnp.int32(slots[j]), global_x, global_y), np.ones(len(real)))
        for j in real:
            accuracy = put_evaluate(accuracy, jnp.int32(j), scores[int(j)])
        return {**out, "global_accuracy": accuracy}

    def evaluate(broadcast, states, test, global_x=None, global_y=None):
        every = np.arange(test.sizes.shape[0], dtype=np.int32)
        return evaluate_slots(broadcast, states, test, every, global_x, global_y)

    def computed_steps(steps: np.ndarray, bucket: int) -> float:
        del bucket  # padded slots are never called
        return float(np.sum(steps))

    pool = _ClientThreads(threads) if threads > 1 else None
    return CohortRunner("loop", update, evaluate, evaluate_slots, computed_steps)


class _ClientThreads:
    """Host threads for the 'loop' strategy (see `_loop_runner`): `run` calls a jitted
    per-client function for every participant, split over the threads by `balanced_groups`.
    The first call of each kind runs on the calling thread alone, so the threads never compile
    the same program at once."""

    def __init__(self, threads: int):
        self.threads = threads
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.lock = threading.Lock()
        self.compiled: set[str] = set()

    def run(self, kind: str, call: Callable[[int], PyTree], real: np.ndarray,
            weights: np.ndarray) -> dict[int, PyTree]:
        """call(j) for every slot position j in `real` (its weight the expected cost);
        {j: output}, each output computed."""
        out: dict[int, PyTree] = {}
        todo = real
        if kind not in self.compiled or len(real) == 1:
            out[int(real[0])] = jax.block_until_ready(call(int(real[0])))
            self.compiled.add(kind)
            todo, weights = real[1:], weights[1:]
        groups = [g for g in balanced_groups(todo, weights, self.threads) if len(g)]
        if not groups:
            return out

        def work(group: np.ndarray) -> dict[int, PyTree]:
            return {int(todo[p]): jax.block_until_ready(call(int(todo[p]))) for p in group}

        with self.lock:
            if self.pool is None:
                self.pool = concurrent.futures.ThreadPoolExecutor(
                    self.threads, thread_name_prefix="loop_client")
            for done in self.pool.map(work, groups):
                out.update(done)
        return out


def evaluate_in_buckets(evaluate_slots: Callable[..., Metrics], broadcast, states, test,
                        members: np.ndarray, bucket: int, global_x=None, global_y=None
                        ) -> dict[str, np.ndarray]:
    """Metrics of the cohort members `members` (local indices), host-side, computed `bucket`
    slots per `evaluate_slots` call (one compiled shape; the last call padded out of range)."""
    num_clients = test.sizes.shape[0]
    parts = []
    for start in range(0, len(members), bucket):
        chunk = members[start:start + bucket]
        slots = np.full(bucket, num_clients, np.int32)
        slots[:len(chunk)] = chunk
        m = jax.device_get(evaluate_slots(broadcast, states, test, slots, global_x, global_y))
        parts.append({k: np.asarray(v)[:len(chunk)] for k, v in m.items()})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _set_row(tree: PyTree, i: jax.Array, row: PyTree) -> PyTree:
    return jax.tree.map(lambda a, r: a.at[i].set(r), tree, row)


def _row(tree: PyTree, i: jax.Array) -> PyTree:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


@functools.cache
def _zeros_program(treedef, leaves: tuple[tuple[tuple[int, ...], str], ...]) -> Callable:
    return jax.jit(lambda: jax.tree.unflatten(treedef, [jnp.zeros(shape, dtype)
                                                        for shape, dtype in leaves]))


def _zeros_in_slots(shapes: PyTree, bucket: int) -> PyTree:
    """Zeros [bucket, *shape] for every leaf of `shapes`: one compiled program per tree of
    shapes (one per leaf shape compiled ~20 small programs in round 1 of the quick start)."""
    leaves, treedef = jax.tree.flatten(shapes)
    return _zeros_program(treedef, tuple(((bucket,) + tuple(s.shape), jnp.dtype(s.dtype).name)
                                         for s in leaves))()


register_strategy(Strategy("vmap", lambda program, o: _mapped_runner(
    program, "vmap", _vmapped, jit=o.jit, eval_budget_bytes=o.eval_budget_bytes),
    cost="longest_schedule"))
register_strategy(Strategy("loop", lambda program, o: _loop_runner(
    program, o.loop_threads, jit=o.jit)))
register_strategy(Strategy("scan", lambda program, o: _scan_runner(
    program, o.scan_chunk, jit=o.jit), streams_uploads=True))
register_strategy(Strategy("shard", lambda program, o: _mapped_runner(
    program, "shard", functools.partial(_sharded, mesh=o.mesh), o.mesh, jit=o.jit,
    eval_budget_bytes=o.eval_budget_bytes), cost="longest_schedule", needs_mesh=True))
