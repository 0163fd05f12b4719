"""Vectorized hyper-parameter sweeps: R runs that differ in one float field, trained together.

`python -m launch.sweep --config=... --sweep.lam=0.1,0.5,1.0,2.0` runs one member per value. The
members share everything else — data, partition, initialization, client sampling, the system
model, batches — so in every round the same clients train in every member, from different
states. The local training, which dominates a round, then runs as ONE compiled program per
participant: the client update vmapped over a leading member axis, with the swept value a traced
input (the method is built with that field set to a tracer, so any float the client update reads
can be swept: lam, train.lr_local, proxy_lr_ratio, …). Everything else of a round — upload
checks, server step, evaluation, metrics files — is each member's own ordinary run
(`engine.loop.run_experiment` in a thread, its cohorts' `update` routed here), so every member
writes the usual workdir and its numbers equal a separate run with that value up to float
reassociation.

A field that changes shapes or control flow (proxy_dim, architectures, epochs, …) cannot be
traced: `check_field` refuses it with the field's name before anything runs.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fedjax_pfedes.algorithms.base import PyTree
from fedjax_pfedes.data.federated import FederatedData
from fedjax_pfedes.engine.callbacks import Callback, RoundEnd, RunInfo
from fedjax_pfedes.engine.ctrl_c import CtrlC
from fedjax_pfedes.errors import ConfigError, RunInterrupted
from fedjax_pfedes.execution import distributed, kernels, slot_rows
from fedjax_pfedes.execution.strategies import protocol
from fedjax_pfedes.execution.strategies.protocol import CohortRunner


def field_value(config: ml_collections.ConfigDict, dotted: str) -> Any:
    node = config
    for part in dotted.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            raise ConfigError(f"--sweep.{dotted}: config has no field '{dotted}'")
        node = node[part]
    return node


# What members may differ in: the method's own settings and its local optimizer. Everything
# else (data, partition, sampling, system model, upload pipeline) is shared by construction.
LOCAL_OPTIMIZER_FIELDS = ("train.lr_local", "train.local_momentum")


def check_float(config: ml_collections.ConfigDict, dotted: str) -> float:
    """The field's value; ConfigError naming it unless it is a float field of the method (a
    top-level field, the method's own section, or the local optimizer)."""
    from fedjax_pfedes.algorithms import registry
    current = field_value(config, dotted)
    head = dotted.split(".")[0]
    if not ("." not in dotted or head in registry.names() or dotted in LOCAL_OPTIMIZER_FIELDS):
        raise ConfigError(
            f"--sweep.{dotted}: members share the data, sampling, system model and upload "
            "pipeline, so only the method's fields (top-level ones such as lam, its own "
            f"config.<method> section) and {', '.join(LOCAL_OPTIMIZER_FIELDS)} can be swept; "
            "run separate launch.main runs for this one")
    if head in registry.names() and head != config.algorithm:
        raise ConfigError(f"--sweep.{dotted}: config.algorithm is '{config.algorithm}', which "
                          f"does not read config.{head}")
    if isinstance(current, bool) or not isinstance(current, float):
        raise ConfigError(f"--sweep.{dotted}: only float fields can be swept in one program "
                          f"(this one is {type(current).__name__} {current!r}: it may set "
                          "shapes or control flow); run separate launch.main runs for it")
    return current


def traced_algorithm(config: ml_collections.ConfigDict, data: FederatedData, dotted: str,
                     value: jax.Array):
    """The configured method built with `dotted` = `value` (a tracer inside jit / vmap)."""
    from fedjax_pfedes.engine.build import build_algorithm  # build imports the whole engine
    from fedjax_pfedes.studies.experiments import with_overrides
    return build_algorithm(with_overrides(config, {dotted: value}, type_safe=False), data)


def check_field(config: ml_collections.ConfigDict, data: FederatedData, dotted: str,
                archs: list[str]) -> None:
    """ConfigError naming the field unless it is a float the client update can take traced."""
    current = check_float(config, dotted)
    from fedjax_pfedes.engine.build import build_algorithm
    concrete = build_algorithm(config, data)
    server = concrete.init_server(jax.random.key(0), tuple(dict.fromkeys(archs)))
    rows = data.client_arrays(np.array([0]), "train")
    one = jax.tree.map(lambda a: jnp.asarray(a)[0], rows)
    try:
        for arch in dict.fromkeys(archs):
            def update(v, arch=arch):
                program = traced_algorithm(config, data, dotted, v).cohort_program(arch)
                return program.client_update(concrete.broadcast(server, arch),
                                             program.init_client(jax.random.key(0)), one,
                                             jax.random.key(1))
            jax.eval_shape(update, jnp.float32(current))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerBoolConversionError,
            jax.errors.TracerIntegerConversionError, TypeError) as e:
        raise ConfigError(
            f"--sweep.{dotted}: this field decides shapes or control flow of the client update "
            f"({type(e).__name__}), so members cannot share one compiled program; run separate "
            "launch.main runs for it") from None


# How the members' client updates share a program: 'vmap' batches them (one kernel per layer
# for all members: the accelerator choice), 'map' runs them one after another inside the
# program (`lax.map`: no grouped convolutions, which XLA:CPU runs slowly).
MEMBER_AXES = ("vmap", "map")


@dataclasses.dataclass
class _Call:
    broadcast: PyTree
    states: PyTree
    train: Any
    slots: np.ndarray
    keys: jax.Array


class Coordinator:
    """Collects the members' cohort updates of a round and computes them together.

    Every member's run calls `update(member, arch, ...)` in the same order (rounds, then cohorts);
    the call of the last active member computes all of them — one jitted call per participant,
    the client update vmapped (or `lax.map`ped) over the members — and wakes the others with
    their results. A
    member whose run ends (finished or diverged) `leave`s, and the others go on without it.

    A stop (Ctrl-C: `stop_requested`) is taken at such a meeting, where every active member is
    in the same round: `stop_round` is that round, after which each member's `_Route` ends its
    run with a checkpoint, so that all of them resume from the same round.
    """

    def __init__(self, config: ml_collections.ConfigDict, data: FederatedData, dotted: str,
                 values: list[float], member_axis: str = "vmap",
                 stop_requested: Callable[[], bool] = lambda: False):
        if member_axis not in MEMBER_AXES:
            raise ConfigError(f"--member_axis: '{member_axis}' is not one of {MEMBER_AXES}")
        self.config, self.data, self.dotted = config, data, dotted
        self.member_axis = member_axis
        self.values = np.asarray(values, np.float32)
        self.active = set(range(len(values)))
        self.pending: dict[int, tuple[str, _Call]] = {}  # member -> (cohort, its call)
        self.results: dict[int, tuple] = {}
        self.generation = 0
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.calls: dict[str, Callable] = {}
        self.shapes: dict[str, PyTree] = {}
        self.stop_requested = stop_requested
        self.stop_round: int | None = None
        self.in_round: dict[int, int] = {}  # member -> the round it is in (set by its _Route)

    def runner(self, member: int, arch: str, inner: CohortRunner) -> CohortRunner:
        """`inner` (the member's own runner, kept for evaluation) with its update routed here.

        A round that asks for per-client upload facts (`execution.strategies.protocol.Finishing`)
        gets them from a pass over the member's stacked uploads after the batched update: the
        members' finishing functions are distinct objects, so they cannot share the batched
        program."""
        def update(broadcast, states, train, slots, keys):
            finishing = broadcast if isinstance(broadcast, protocol.Finishing) else None
            if finishing is not None and finishing.reducer is not None:
                raise ConfigError("launch.sweep needs config.execution.strategy='loop' (a "
                                  "streaming reducer came with the broadcast)")
            plain = broadcast if finishing is None else finishing.broadcast
            uploads, states, metrics = self.update(
                member, arch, _Call(plain, states, train, np.asarray(slots), keys))
            if finishing is not None:
                facts = _stacked_facts(finishing.fn)(uploads, finishing.operand)
                metrics = {**metrics, protocol.UPLOAD_FACTS: facts}
            return uploads, states, metrics
        return dataclasses.replace(inner, update=update)

    def leave(self, member: int) -> None:
        with self.cond:
            self.active.discard(member)
            self._maybe_compute()
            self.cond.notify_all()

    def update(self, member: int, arch: str, call: _Call):
        with self.cond:
            generation = self.generation
            self.pending[member] = (arch, call)
            self._maybe_compute()
            while self.generation == generation and self.error is None:
                self.cond.wait()
            if self.error is not None:
                raise RuntimeError("the sweep's batched update failed") from self.error
            return self.results.pop(member)

    def _maybe_compute(self) -> None:
        if not self.active or not self.active <= set(self.pending):
            return
        members = sorted(self.active)
        archs = {self.pending[m][0] for m in members}
        if self.stop_round is None and self.stop_requested():
            self.stop_round = max(self.in_round.get(m, 0) for m in members)
        try:
            if len(archs) != 1:
                raise RuntimeError(f"members reached different cohorts: {sorted(archs)}")
            arch = archs.pop()
            calls = [self.pending[m][1] for m in members]
            for m, out in zip(members, self._compute(arch, members, calls), strict=True):
                self.results[m] = out
        except BaseException as e:  # noqa: BLE001 - handed to every waiting member
            self.error = e
        self.pending = {m: c for m, c in self.pending.items() if m not in members}
        self.generation += 1
        self.cond.notify_all()

    def _batched(self, arch: str) -> Callable:
        if arch in self.calls:
            return self.calls[arch]
        config, data, dotted = self.config, self.data, self.dotted

        def one(value, broadcast, row, train_row, key):
            program = traced_algorithm(config, data, dotted, value).cohort_program(arch)
            return program.client_update(broadcast, row, train_row, key)

        if self.member_axis == "vmap":
            mapped = jax.vmap(one, in_axes=(0, 0, 0, None, None))
        else:  # 'map': members one after another inside the one program (lax.map)
            def mapped(values, broadcasts, rows, train_row, key):
                return jax.lax.map(lambda m: one(*m, train_row, key), (values, broadcasts, rows))

        @functools.partial(jax.jit, donate_argnums=(2, 6, 7), compiler_options=(
            kernels.kernel_options(config.execution.cpu_kernels) or None))
        def step(values, broadcasts, states, train, i, key, uploads, metrics, j):
            rows = jax.tree.map(lambda *a: jnp.stack(a),
                                *[slot_rows.get_row(s, i) for s in states])
            stacked = jax.tree.map(lambda *a: jnp.stack(a), *broadcasts)
            up, new_rows, m = mapped(values, stacked, rows, slot_rows.get_row(train, i), key)
            member = lambda tree, k: jax.tree.map(lambda a: a[k], tree)  # noqa: E731
            states = tuple(slot_rows.set_row(s, i, member(new_rows, k))
                           for k, s in enumerate(states))
            uploads = tuple(slot_rows.set_row(u, j, member(up, k)) for k, u in enumerate(uploads))
            metrics = tuple(slot_rows.set_row(x, j, member(m, k)) for k, x in enumerate(metrics))
            return states, uploads, metrics

        self.calls[arch] = step
        return step

    def _compute(self, arch: str, members: list[int], calls: list[_Call]) -> list[tuple]:
        first = calls[0]
        for c in calls[1:]:  # the members' schedules are identical by construction
            if not np.array_equal(c.slots, first.slots):
                raise RuntimeError("members selected different clients in one round")
        step = self._batched(arch)
        values = jnp.asarray(self.values[members])
        broadcasts = tuple(c.broadcast for c in calls)
        states = tuple(c.states for c in calls)
        bucket = len(first.slots)
        if arch not in self.shapes:  # (upload, state, metrics) of one client
            self.shapes[arch] = jax.eval_shape(
                lambda b, s, t, k: traced_algorithm(
                    self.config, self.data, self.dotted, jnp.float32(0)
                ).cohort_program(arch).client_update(b, slot_rows.get_row(s, 0),
                                                     slot_rows.get_row(t, 0), k),
                first.broadcast, first.states, first.train, first.keys[0])
        shapes = self.shapes[arch]
        uploads = tuple(slot_rows.zeros_in_slots(shapes[0], bucket) for _ in calls)
        metrics = tuple(slot_rows.zeros_in_slots(shapes[2], bucket) for _ in calls)
        n = first.train.sizes.shape[0]
        for j in np.flatnonzero(first.slots < n):
            states, uploads, metrics = step(values, broadcasts, states, first.train,
                                            jnp.int32(first.slots[j]), first.keys[j], uploads,
                                            metrics, jnp.int32(j))
        return [(u, s, m) for u, s, m in zip(uploads, states, metrics, strict=True)]


_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fn -> its jitted pass


def _stacked_facts(fn: Callable) -> Callable:
    """(stacked uploads, operand) -> `fn`'s per-client results, stacked (one jitted pass,
    compiled once per run: a run passes the same `fn` every round)."""
    if fn not in _FACTS:
        _FACTS[fn] = jax.jit(jax.vmap(fn, in_axes=(0, None)))
    return _FACTS[fn]


class _Route(Callback):
    """Routes member m's cohorts through the coordinator's batched program, tells it the
    round the member is in, and ends the member's run after the coordinator's `stop_round`
    (`RoundEnd.interrupted`: the round is checkpointed, then the run raises RunInterrupted)."""

    def __init__(self, coordinator: Coordinator, member: int):
        self.coordinator, self.member = coordinator, member

    def on_run_start(self, run: RunInfo) -> None:
        self.coordinator.in_round[self.member] = run.first_round + 1
        for c in run.ctx.cohorts:
            c.runner = self.coordinator.runner(self.member, c.arch, c.runner)

    def on_round_end(self, run: RunInfo, end: RoundEnd) -> None:
        self.coordinator.in_round[self.member] = end.round + 1
        stop = self.coordinator.stop_round
        if stop is not None and stop <= end.round < run.rounds:
            end.interrupted = True


def _resolved_execution(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`config` with 'auto' execution settings resolved for a sweep: its members' local
    training runs participant by participant in one program of the sweep's own, so 'auto'
    strategy means 'loop' and 'auto' kernels 'xla' (give 'eigen' to compile it with those)."""
    ex = config.execution
    if ex.strategy != "auto" and ex.cpu_kernels != "auto":
        return config
    config = config.copy_and_resolve_references()
    with config.unlocked():
        if ex.strategy == "auto":
            config.execution.strategy = "loop"
        if ex.cpu_kernels == "auto":
            config.execution.cpu_kernels = "xla"
    return config


def _check_sweepable(config: ml_collections.ConfigDict, dotted: str, values: list[float]
                     ) -> None:
    """ConfigError naming the flag or field for a sweep this module cannot batch: repeated
    values, a field that is no float, several processes, other than 'loop' on device states in
    synchronous rounds, or kernels chosen by timing."""
    if len(values) < 1 or len(set(values)) != len(values):
        raise ConfigError(f"--sweep.{dotted}: give distinct values, got {values}")
    check_float(config, dotted)
    if distributed.settings(config.get("distributed")).multi_process:
        raise ConfigError("config.distributed: launch.sweep runs in one process; run each "
                          "member with launch.main across processes instead")
    ex = config.execution
    if ex.strategy != "loop" or ex.client_states != "device" or config.asynchronous.enabled:
        raise ConfigError("launch.sweep batches the members' local training participant by "
                          "participant: it needs config.execution.strategy='loop', "
                          "config.execution.client_states='device' and synchronous rounds "
                          "(config.asynchronous.enabled=False)")


def run_sweep(config: ml_collections.ConfigDict, dotted: str, values: list[float],
              workdir: str, show_progress: bool = True, member_axis: str = "vmap"
              ) -> dict[str, dict]:
    """Runs one member per value of `dotted` (workdir/<field>=<value>), their local training
    batched by a `Coordinator`; returns {member name: its `experiments.run_record`}. Ctrl-C
    stops every member after the same round, with a checkpoint of it (`RunInterrupted`); the
    same call resumes them there."""
    import os

    from fedjax_pfedes.engine.build import build_federated_data
    from fedjax_pfedes.engine.cohorts import assign_architectures
    from fedjax_pfedes.engine.loop import run_experiment
    from fedjax_pfedes.engine.validate import validate_config
    from fedjax_pfedes.studies.experiments import run_record, with_overrides

    config = _resolved_execution(config)
    _check_sweepable(config, dotted, values)
    members = {}
    for v in values:
        member = with_overrides(config, {dotted: v})
        member.train.allow_divergence = True  # a diverging member is a result of the sweep
        validate_config(member)
        members[f"{dotted}={v:g}"] = member
    data = build_federated_data(config)
    check_field(config, data, dotted, assign_architectures(config.clients.architectures,
                                                           data.num_clients))
    ctrl_c = CtrlC()
    coordinator = Coordinator(config, data, dotted, list(values), member_axis,
                              stop_requested=lambda: ctrl_c.requested)
    summaries: dict[str, dict] = {}
    errors: dict[str, BaseException] = {}

    def run(m: int, name: str, member: ml_collections.ConfigDict) -> None:
        try:
            run_dir = os.path.join(workdir, name)
            summary = run_experiment(member, run_dir, show_progress=show_progress and m == 0,
                                     callbacks=[_Route(coordinator, m)])
            summaries[name] = run_record(member, summary, run_dir)
        except BaseException as e:  # noqa: BLE001 - reported after every member ended
            errors[name] = e
        finally:
            coordinator.leave(m)

    threads = [threading.Thread(target=run, args=(m, name, member), name=name)
               for m, (name, member) in enumerate(members.items())]
    with ctrl_c:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    failed = {n: e for n, e in errors.items() if not isinstance(e, RunInterrupted)}
    if failed:
        name, e = next(iter(failed.items()))
        if isinstance(e, ConfigError):
            raise ConfigError(f"sweep member {name}: {e}") from None
        raise RuntimeError(f"sweep member {name} failed: {e}") from e
    if errors:
        raise RunInterrupted(_where_to_resume(config, workdir, coordinator.stop_round))
    return {name: summaries[name] for name in members}


def _where_to_resume(config: ml_collections.ConfigDict, workdir: str, stop_round: int) -> str:
    """What a sweep stopped by Ctrl-C left: every member's checkpoint of the same round."""
    ck = config.checkpoint
    if ck.every > 0 and ck.resume:
        return (f"the sweep in {workdir} stopped after round {stop_round}; each member's "
                "checkpoint holds that round: the same command resumes from it")
    return (f"the sweep in {workdir} stopped after round {stop_round} with no checkpoint to "
            f"resume from (config.checkpoint.every={ck.every}, resume={ck.resume}): the same "
            "command starts it over")
