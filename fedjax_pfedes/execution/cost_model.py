"""Prices a cohort's execution strategies and CPU kernel sets before any of them is compiled.

`config.execution.strategy='auto'` and `cpu_kernels='auto'` (the defaults) ask this model first;
`execution.choice` times only what the model cannot tell apart (`contenders`) and only where a
timing is cheap, so most cohorts are decided without compiling a loser.

The model has two halves:

* **The work** (`work_of`): one client's local step, read from the cohort program's jaxpr
  (tracing only, nothing compiled): the floating-point operations in matrix products and in
  convolutions, the bytes the other operations write, and the number of operations (each costs a
  fixed launch time however small it is). A `while` loop's body (the local steps) counts once, so
  these are the figures of one step; a `scan` counts its length times.
* **The machine** (`MachineRates`, `measure_rates`): measured once per machine
  (`choice.machine()`: backend, device kind, CPU model and features, cores, jax and jaxlib) on
  small reference programs and cached next to the compilation cache: a jitted call's dispatch,
  an operation's launch time, the rates of one client's matrix products and convolutions and of
  the same vectorized over clients (`vmap` turns per-client convolutions into grouped ones,
  which XLA:CPU runs far slower), per kernel set, and how much a second host thread adds.

A round of the cohort then costs, with P participants (expected), mean and longest local steps
s̄ and ŝ, a bucket of B slots and T loop threads:

  loop  P (per-participant + s̄ step(1) / parallel(T))   jitted calls per participant, T at once
  scan  call + P s̄ step(1)                              one call, participants in turn
  vmap  call + ŝ step(B)                                one call, every slot to the longest end
  shard vmap over the devices' shares of the bucket

where step(n) = ops · launch + n (matmul flops / matmul rate + conv flops / conv rate + bytes /
bandwidth), the rates being the one-client ones for n = 1 and the vectorized ones otherwise.
`rank` returns the candidates' predicted round times; `contenders` the best and the best of
another strategy when it is within `MARGIN` and the difference is worth a compilation. The
model never changes numbers: every candidate computes the same ones up to float
reassociation.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.execution.kernels import kernel_options
from fedjax_pfedes.models.layers import conv

RATES_FILE = "machine_rates.json"
DEFAULT_KERNELS = "xla"  # XLA:CPU's own kernels
KERNEL_MARGIN = 1.1  # how much faster another kernel set must be predicted to be chosen
# How far the model is trusted: another strategy predicted within this factor of the best one
# is timed against it, when the best one compiles within `TIMING_COMPILE_BUDGET_S` (the model
# priced rounds at 0.4-2x their timed cost on the works of docs/performance.md).
MARGIN = 2.0
# A timing compiles a second candidate, at about the cost of the first: it is run only when the
# model's best compiled and ran its first call within this many seconds.
TIMING_COMPILE_BUDGET_S = 1.5
# Operations that only move or relabel data (no arithmetic worth a launch of its own after XLA's
# fusion), and the structural ones whose inner jaxprs are walked instead.
_FREE = frozenset({"pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                   "custom_vjp_call_jaxpr", "remat", "checkpoint", "while", "scan", "cond",
                   "reshape", "squeeze", "expand_dims", "broadcast_in_dim", "convert_element_type",
                   "stop_gradient", "copy", "copy_p", "random_wrap", "random_unwrap",
                   "random_bits", "random_seed", "random_fold_in", "random_split", "iota",
                   "transpose"})


@dataclasses.dataclass(frozen=True)
class StepWork:
    """What one client's local step computes (`work_of`).

    Attributes:
      dot_flops: floating-point operations in matrix products (`dot_general`).
      conv_flops: floating-point operations in convolutions.
      bytes: bytes written by the other arithmetic operations (element-wise, reductions).
      ops: operations with arithmetic (each a launch after fusion, roughly).
    """

    dot_flops: float
    conv_flops: float
    bytes: float
    ops: int


def _size(aval) -> int:
    return int(np.prod(aval.shape)) if hasattr(aval, "shape") else 1


def _itemsize(aval) -> int:
    try:
        return int(np.dtype(aval.dtype).itemsize)
    except TypeError:  # key types and the like
        return 4


def _inner_jaxprs(params: dict):
    for value in params.values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            inner = getattr(item, "jaxpr", item)
            if isinstance(inner, jax.extend.core.Jaxpr):
                yield inner


def _walk(jaxpr, totals: dict, times: float) -> None:
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        repeat = times * (eqn.params.get("length", 1) if name == "scan" else 1)
        if name == "cond":  # the dearest branch
            branches = []
            for branch in eqn.params["branches"]:
                sub = dict.fromkeys(totals, 0.0)
                _walk(branch.jaxpr, sub, 1.0)
                branches.append(sub)
            worst = max(branches, key=lambda s: s["dot_flops"] + s["conv_flops"] + s["bytes"])
            for k in totals:
                totals[k] += times * worst[k]
            continue
        for inner in _inner_jaxprs(eqn.params):
            _walk(inner, totals, repeat)
        if name in _FREE:
            continue
        out = eqn.outvars[0].aval if eqn.outvars else None
        if name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval
            contracted = math.prod(lhs.shape[d] for d in lhs_contract)
            totals["dot_flops"] += times * 2.0 * _size(out) * contracted
        elif name == "conv_general_dilated":
            rhs = eqn.invars[1].aval
            out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
            totals["conv_flops"] += times * 2.0 * _size(out) * _size(rhs) / out_features
        elif out is not None:
            totals["bytes"] += times * sum(_size(v.aval) * _itemsize(v.aval)
                                           for v in eqn.outvars)
        totals["ops"] += times


def work_of(fn: Callable, *args, with_shapes: bool = False):
    """One call's work of `fn(*args)` (one client's local update: one step, see the module
    docstring), read from its jaxpr; nothing is compiled.

    Args:
      fn: a function of JAX arrays (e.g. `CohortProgram.client_update`).
      *args: its arguments (arrays or `jax.ShapeDtypeStruct`s: only shapes are read).
      with_shapes: also return the shapes of what `fn` returns (from the same trace).

    Returns:
      The `StepWork` of one call; with `with_shapes`, (it, `fn`'s output as
      `jax.ShapeDtypeStruct`s).
    """
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    totals = {"dot_flops": 0.0, "conv_flops": 0.0, "bytes": 0.0, "ops": 0.0}
    _walk(closed.jaxpr, totals, 1.0)
    work = StepWork(totals["dot_flops"], totals["conv_flops"], totals["bytes"],
                    int(totals["ops"]))
    return (work, shapes) if with_shapes else work


@dataclasses.dataclass(frozen=True)
class KernelRates:
    """One kernel set's measured rates (`measure_rates`): seconds per operation launch, and
    flop/s or byte/s of one client (`*_one`) and of clients vectorized with `vmap` (`*_many`,
    per client)."""

    launch_s: float
    dot_one: float
    conv_one: float
    dot_many: float
    conv_many: float
    bytes_per_s: float


@dataclasses.dataclass(frozen=True)
class MachineRates:
    """A machine's constants (`measure_rates`).

    Attributes:
      call_s: one 'scan' update call of a program that computes nothing (what 'scan' and
        'vmap' pay once per round).
      loop_participant_s: what the 'loop' strategy adds per participant on such a program
        (its jitted calls, the threads' hand-over, the rows written back).
      thread_gain: how much of a second host thread's work adds when two threads run client
        programs at once (0: none, 1: twice the throughput): the 'loop' strategy's threads.
      finish_one: bytes/s of the upload's finishing (its norm and checks,
        `protocol.Finishing`) one client at a time ('loop', 'scan').
      finish_many: the same vectorized over the bucket ('vmap', 'shard').
      kernels: kernel set ('xla', 'eigen') -> its `KernelRates`.
    """

    call_s: float
    loop_participant_s: float
    thread_gain: float
    finish_one: float
    finish_many: float
    kernels: dict[str, KernelRates]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MachineRates:
        return cls(float(d["call_s"]), float(d["loop_participant_s"]),
                   float(d["thread_gain"]), float(d["finish_one"]), float(d["finish_many"]),
                   {k: KernelRates(**v) for k, v in d["kernels"].items()})


@dataclasses.dataclass(frozen=True)
class Cohort:
    """What a round of one cohort asks of a strategy (`predict`).

    Attributes:
      participants: expected participants per round (P).
      bucket: participant slots the round's program is compiled for (B).
      mean_steps: mean local steps of a participant (s̄).
      max_steps: the longest participant's local steps (ŝ).
      host_threads: host threads of 'loop' (T, `config.execution.loop_threads` resolved).
      mesh_size: devices of the 'shard' mesh.
      finish_bytes: bytes the finishing of one participant's upload writes (`work_of` of
        `protocol.Finishing.fn`; 0 without one).
    """

    participants: float
    bucket: int
    mean_steps: float
    max_steps: float
    host_threads: int = 1
    mesh_size: int = 1
    finish_bytes: float = 0.0


def step_seconds(work: StepWork, rates: KernelRates, clients: int) -> float:
    """Seconds of one local step of `clients` clients run together (1: alone; more: vmapped)."""
    dot, conv = ((rates.dot_one, rates.conv_one) if clients == 1
                 else (rates.dot_many, rates.conv_many))
    return work.ops * rates.launch_s + clients * (
        work.dot_flops / dot + work.conv_flops / conv + work.bytes / rates.bytes_per_s)


def predict(work: StepWork, cohort: Cohort, machine: MachineRates, strategy: str,
            kernels: str) -> float:
    """Predicted seconds of the cohort's local updates in one round under `strategy` with
    `kernels` (the module docstring's formulas).

    Args:
      work: one client's step (`work_of`).
      cohort: participants, bucket, steps, threads, devices.
      machine: the machine's rates (`measure_rates`).
      strategy: 'loop' | 'scan' | 'vmap' | 'shard' (another registered strategy: None).
      kernels: a kernel set `machine` has rates for.

    Returns:
      Seconds, or `math.inf` for a strategy the model cannot price.
    """
    rates = machine.kernels.get(kernels)
    if rates is None:
        return math.inf
    p, c = cohort.participants, machine.call_s
    finish_one = cohort.finish_bytes / machine.finish_one
    if strategy == "loop":
        threads = max(1, min(cohort.host_threads, math.ceil(p)))
        parallel = 1.0 + (threads - 1) * machine.thread_gain
        return p * (machine.loop_participant_s + finish_one +
                    cohort.mean_steps * step_seconds(work, rates, 1) / parallel)
    if strategy == "scan":
        return c + p * (finish_one + cohort.mean_steps * step_seconds(work, rates, 1))
    if strategy in ("vmap", "shard"):
        share = cohort.bucket if strategy == "vmap" else math.ceil(
            cohort.bucket / max(cohort.mesh_size, 1))
        return c + share * cohort.finish_bytes / machine.finish_many + (
            cohort.max_steps * step_seconds(work, rates, max(share, 2)))
    return math.inf


def rank(work: StepWork, cohort: Cohort, machine: MachineRates,
         candidates: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Predicted round seconds of each candidate, cheapest first.

    Args:
      work, cohort, machine: as `predict`.
      candidates: runner name -> (strategy, kernels).

    Returns:
      runner name -> predicted seconds, cheapest first, where a kernel set other than
      `DEFAULT_KERNELS` must be predicted `KERNEL_MARGIN` faster to rank first (the kernel
      rates come from small reference programs).
    """
    priced = {name: predict(work, cohort, machine, s, k) for name, (s, k) in candidates.items()}
    handicap = {name: 1.0 if k == DEFAULT_KERNELS else KERNEL_MARGIN
                for name, (_, k) in candidates.items()}
    return dict(sorted(priced.items(), key=lambda item: item[1] * handicap[item[0]]))


def contenders(predicted: dict[str, float], strategies: dict[str, str],
               margin: float = MARGIN, negligible_s: float = 0.0) -> list[str]:
    """The candidates worth timing: the model's best, and the best candidate of another
    strategy when it is predicted within `margin` of it and more than `negligible_s` slower
    (a difference below that is not worth a compilation). The kernel set of each strategy is
    the model's choice. A candidate the model cannot price is timed with the best.

    Args:
      predicted: runner name -> predicted round seconds, cheapest first (`rank`).
      strategies: runner name -> its strategy.
      margin: how far the model is trusted (a ratio of predicted times).
      negligible_s: seconds per round below which a difference is not timed.

    Returns:
      One or two runner names, the model's best first.
    """
    names = list(predicted)
    best = names[0]
    if not math.isfinite(predicted[best]):
        return names[:2]
    for name in names[1:]:
        if strategies[name] == strategies[best]:
            continue
        if not math.isfinite(predicted[name]):
            return [best, name]
        close = predicted[name] <= margin * predicted[best]
        worth = predicted[name] - predicted[best] > negligible_s
        return [best, name] if close and worth else [best]
    return [best]


# ---------------------------------------------------------------------------------------------
# Measuring a machine's rates.

def _best_time(fn: Callable, *args, repeats: int = 3) -> float:
    """Best of `repeats` timed calls of `fn(*args)`, after one that compiles."""
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


_STEPS = 4  # local steps of a reference update (a fori_loop, as a client's update is)


@functools.cache  # one function per loss: its compilations are shared by the measurements
def _sgd(loss: Callable) -> Callable:
    """A reference client update: `steps` (traced, as a client's are) SGD steps on `loss`."""
    def update(params, x, y, steps):
        def body(_, p):
            grads = jax.grad(loss)(p, x, y)
            return jax.tree.map(lambda a, g: a - 0.01 * g, p, grads)
        return jax.lax.fori_loop(0, steps, body, params)
    return update


def _dense_loss(p, x, y):
    h = jax.nn.relu(x @ p["w1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def _conv_loss(p, x, y):
    h = conv(x, p["k"], (1, 1), "SAME")  # the models' convolution (fast inside rolled loops)
    return jnp.mean((jnp.mean(jax.nn.relu(h), axis=(1, 2)) @ p["w"] - y) ** 2)


def _normal(shape: tuple[int, ...], scale: float, seed: int) -> np.ndarray:
    """Reference inputs drawn with NumPy (an eager JAX op would compile a program of its own)."""
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _dense_case(width: int, batch: int):
    params = {"w1": _normal((width, width), 0.05, 0), "w2": _normal((width, 10), 0.05, 1)}
    return _dense_loss, params, _normal((batch, width), 1.0, 2), np.zeros((batch, 10),
                                                                          np.float32)


def _conv_case(size: int, channels: int, batch: int):
    params = {"k": _normal((3, 3, channels, channels), 0.1, 3),
              "w": _normal((channels, 10), 0.1, 4)}
    x = _normal((batch, size, size, channels), 1.0, 5)
    return _conv_loss, params, x, np.zeros((batch, 10), np.float32)


def _elementwise_loss(p, x, y):
    del y
    return jnp.sum(jnp.tanh(x * p["a"] + p["b"]) ** 2)


def _elementwise_case(rows: int, width: int):
    params = {"a": np.ones((width,), np.float32), "b": np.zeros((width,), np.float32)}
    return (_elementwise_loss, params, np.full((rows, width), 0.1, np.float32),
            np.zeros((), np.float32))


_MANY = 2  # clients of the vectorized references


def _rates_of(kernels: str, shared: KernelRates | None = None) -> tuple[KernelRates, dict]:
    """One kernel set's rates from reference updates: a tiny dense one (an operation's launch)
    and an element-wise one (bytes/s), taken from `shared` when given (the kernel sets differ
    in matrix products and convolutions only); a dense and a convolutional one (arithmetic),
    each alone and vmapped over `_MANY` clients."""
    jit = functools.partial(jax.jit, compiler_options=kernel_options(kernels) or None)

    steps = np.int32(_STEPS)

    def timed(case, vectorized: bool = True):
        loss, params, x, y = case
        update = _sgd(loss)
        work = work_of(update, params, x, y, steps)  # one step: the loop's body
        one_s = _best_time(jit(update), params, x, y, steps) / _STEPS
        if not vectorized:
            return work, one_s, None
        many = jax.tree.map(lambda a: np.stack([a] * _MANY), (params, x, y))
        many_s = _best_time(jit(jax.vmap(update, in_axes=(0, 0, 0, None))), *many,
                            steps) / _STEPS
        return work, one_s, many_s

    timings = {}
    if shared is None:
        tiny, timings["tiny_step_s"], _ = timed(_dense_case(8, 2), vectorized=False)
        launch = timings["tiny_step_s"] / max(tiny.ops, 1)
        streamed, stream_one, _ = timed(_elementwise_case(64, 4096), vectorized=False)
        timings["elementwise_step_s"] = stream_one
        bytes_per_s = streamed.bytes / max(stream_one - streamed.ops * launch,
                                           0.05 * stream_one)
    else:
        launch, bytes_per_s = shared.launch_s, shared.bytes_per_s
    dense, dense_one, dense_many = timed(_dense_case(256, 64))
    conv, conv_one, conv_many = timed(_conv_case(16, 16, 32))
    floor = lambda w: w.ops * launch  # noqa: E731

    def rate(flops: float, seconds: float, work: StepWork, clients: int) -> float:
        rest = seconds - floor(work) - clients * work.bytes / bytes_per_s
        return clients * flops / max(rest, 0.05 * seconds)

    rates = KernelRates(
        launch_s=launch,
        dot_one=rate(dense.dot_flops, dense_one, dense, 1),
        conv_one=rate(conv.conv_flops, conv_one, conv, 1),
        dot_many=rate(dense.dot_flops, dense_many, dense, _MANY),
        conv_many=rate(conv.conv_flops, conv_many, conv, _MANY),
        bytes_per_s=bytes_per_s)
    timings.update(dense_step_s=[dense_one, dense_many], conv_step_s=[conv_one, conv_many])
    return rates, timings


def _finish_reference(upload, template):
    """A finishing like the upload plan's: the update's norm and a finite check."""
    delta = jax.tree.map(lambda u, t: u - t, upload, template)
    return {"norm": jnp.sqrt(sum(jnp.sum(d * d) for d in jax.tree.leaves(delta))),
            "finite": jnp.all(jnp.stack([jnp.all(jnp.isfinite(u))
                                         for u in jax.tree.leaves(upload)]))}


def _runner_overheads(threads: int) -> dict[str, float]:
    """The strategies' own costs on a program that computes nothing but hands back an upload
    of 64k floats: 'call_s' (one 'scan' update call), 'loop_participant_s' (what 'loop' takes
    per participant), 'finish_one' and 'finish_many' (bytes/s of a finishing like the upload
    plan's, `_finish_reference`, under 'scan' and under 'vmap')."""
    from fedjax_pfedes.algorithms.base import CohortProgram
    from fedjax_pfedes.data.federated import ClientArrays
    from fedjax_pfedes.execution import runners
    from fedjax_pfedes.execution.strategies.protocol import Finishing

    template = {f"w{i}": np.zeros((8192,), np.float32) for i in range(8)}

    def update(broadcast, state, train, rng):
        del rng
        moved = jnp.sum(train.x[0]) * 0.0 + 1.0
        return (jax.tree.map(lambda a: a + moved, broadcast), state + moved,
                {"loss": moved})

    program = CohortProgram(lambda rng: jnp.zeros(()), update,
                            lambda b, s, t: {"personalized_accuracy": jnp.float32(0.0)},
                            lambda b, s, x: x)
    p = 32
    states = np.zeros((p,), np.float32)
    train = ClientArrays(np.zeros((p, 2, 3), np.float32), np.zeros((p, 2), np.int32),
                         np.full((p,), 2, np.int32))
    slots = np.arange(p, dtype=np.int32)
    keys = jax.random.wrap_key_data(np.zeros((p, 2), np.uint32))
    finishing = Finishing(template, template, _finish_reference)
    finish_bytes = p * work_of(_finish_reference, template, template).bytes
    seconds = {}
    for name in ("scan", "vmap", "loop"):
        runner = runners.make_runner(program, name, loop_threads=threads)
        for sent in ((template, finishing) if name != "loop" else (template,)):
            call = lambda sent=sent, runner=runner: runner.update(  # noqa: E731
                sent, np.copy(states), train, slots, keys)
            seconds[name, sent is finishing] = _best_time(call)
    rate = lambda n: finish_bytes / max(seconds[n, True] - seconds[n, False],  # noqa: E731
                                        1e-3 * seconds[n, True])
    return {"call_s": seconds["scan", False], "loop_participant_s": seconds["loop", False] / p,
            "finish_one": rate("scan"), "finish_many": rate("vmap")}


def _thread_gain(kernels: str) -> float:
    """Share of a second thread's work that adds throughput: two threads each running the
    reference convolution update against one thread running both."""
    loss, params, x, y = _conv_case(16, 16, 32)
    fn = jax.jit(_sgd(loss), compiler_options=kernel_options(kernels) or None)
    steps = np.int32(_STEPS)
    jax.block_until_ready(fn(params, x, y, steps))
    calls = 3

    def run(n):
        for _ in range(n):
            jax.block_until_ready(fn(params, x, y, steps))

    t0 = time.perf_counter()
    run(2 * calls)
    serial = time.perf_counter() - t0
    threads = [threading.Thread(target=run, args=(calls,)) for _ in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    parallel = time.perf_counter() - t0
    return float(min(max(serial / parallel - 1.0, 0.0), 1.0))


def measure_rates(kernel_sets: tuple[str, ...]) -> tuple[MachineRates, dict]:
    """Measures this machine's `MachineRates` for `kernel_sets` on the default backend.

    Returns:
      (the rates, the raw timings behind them).
    """
    from fedjax_pfedes.execution.runners import default_loop_threads

    # First, as it also warms the CPU up (a first measurement runs slower) and compiles the
    # convolution reference the rates reuse.
    gain = _thread_gain(kernel_sets[0]) if default_loop_threads() > 1 else 0.0
    first = _rates_of(kernel_sets[0])
    measured = {kernel_sets[0]: first,
                **{k: _rates_of(k, first[0]) for k in kernel_sets[1:]}}
    overheads = _runner_overheads(default_loop_threads())
    rates = MachineRates(thread_gain=gain, kernels={k: r for k, (r, _) in measured.items()},
                         **overheads)
    return rates, {k: t for k, (_, t) in measured.items()}


def machine_rates(machine: dict, kernel_sets: tuple[str, ...], cache_dir: str | None
                  ) -> MachineRates:
    """This machine's rates: from `RATES_FILE` in `cache_dir` when measured before under the
    same `machine` (`choice.machine()`) and kernel sets, else measured now (and cached).

    Args:
      machine: `choice.machine()`.
      kernel_sets: the kernel sets to rate.
      cache_dir: the decision cache's folder (None: measure, keep nothing).

    Returns:
      The `MachineRates`.
    """
    key = hashlib.sha256(json.dumps([machine, sorted(kernel_sets)], sort_keys=True)
                         .encode()).hexdigest()[:24]
    path = os.path.join(cache_dir, RATES_FILE) if cache_dir else None
    cache = _read(path)
    if key in cache:
        try:
            return MachineRates.from_dict(cache[key]["rates"])
        except (KeyError, TypeError, ValueError):
            pass  # a damaged entry is measured anew
    rates, timings = measure_rates(tuple(kernel_sets))
    if path:
        cache = _read(path)
        cache[key] = {"machine": machine, "rates": rates.as_dict(), "timings": timings}
        _write(path, cache)
    return rates


def _read(path: str | None) -> dict:
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # an optimization: a read-only folder only costs a measurement next time
