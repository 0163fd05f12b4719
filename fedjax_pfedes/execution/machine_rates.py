"""A machine's constants for the execution cost model (`cost_model.MachineRates`): measured once
per machine on small reference programs and cached in `RATES_FILE` (the engine keeps it in the
user's cache folder, `compilation.user_cache_dir()`, whatever compilation cache a run uses).

Each rate is what the cost model multiplies a counted quantity by: a jitted call and 'loop''s cost
per participant on a program that computes nothing, how much a second host thread adds, an
operation's launch time, bytes/s of element-wise work (in cache, and beyond the last-level cache
whose size the system reports) and of an upload's finishing (one client at a time and
vectorized), and per kernel set the FLOP/s of matrix products and convolutions, one
client alone and vmapped over clients. References draw their inputs with NumPy (an eager JAX op
compiles a program of its own) and use the models' own convolution (`models.layers.conv`: fast
inside rolled loops); the first measurement also warms the CPU up. A run compiles the
references in a background thread while it builds its cohorts (`prepare`), so that measuring
them is mostly timing; what it costs on a first run is in docs/performance.md ("Defaults that
decide").
"""

from __future__ import annotations

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

from fedjax_pfedes.execution import json_cache
from fedjax_pfedes.execution.cost_model import KernelRates, MachineRates, StepWork, work_of
from fedjax_pfedes.execution.kernels import kernel_options
from fedjax_pfedes.models.layers import conv

RATES_FILE = "machine_rates.json"
# Part of the cached rates' key: raised whenever what is measured or how changes, so that rates
# measured the old way are measured again.
RATES_VERSION = 4
# The last-level cache assumed where the system does not say (a CPU's `memory_rate` reference is
# sized from it).
_CACHE_FALLBACK_BYTES = 32 * 2**20


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


@functools.cache  # one compiled program per (loss, kernels, vectorized): `prepare` warms it up
def _jitted(loss: Callable, kernels: str, vectorized: bool) -> Callable:
    """The reference update on `loss` jitted with `kernels`' options, vmapped over clients
    (steps shared) when `vectorized`."""
    update = _sgd(loss)
    if vectorized:
        update = jax.vmap(update, in_axes=(0, 0, 0, None))
    return jax.jit(update, compiler_options=kernel_options(kernels) or None)


def _stacked(case):
    """`case` (loss, params, x, y) with params, x and y stacked for `_MANY` clients."""
    loss, *arrays = case
    return (loss, *jax.tree.map(lambda a: np.stack([a] * _MANY), arrays))


def _kernel_cases(first: bool) -> dict[str, tuple[tuple, bool]]:
    """The references `_rates_of` times, name -> (case, timed vmapped over clients too): a tiny
    dense one and an element-wise one (the `first` kernel set's only), a dense and a
    convolutional one."""
    shared = {"tiny": (_dense_case(8, 2), False),
              "elementwise": (_elementwise_case(64, 4096), False)} if first else {}
    return {**shared, "dense": (_dense_case(256, 64), True),
            "conv": (_conv_case(16, 16, 32), True)}


def _rates_of(kernels: str, shared: KernelRates | None = None) -> tuple[KernelRates, dict]:
    """One kernel set's rates from reference updates: a tiny dense one (an operation's launch)
    and an element-wise one (bytes/s), taken from `shared` when given (the kernel sets differ
    in matrix products and convolutions only); a dense and a convolutional one (arithmetic),
    each alone and vmapped over `_MANY` clients."""
    steps = np.int32(_STEPS)

    def timed(case, vectorized: bool):
        loss, params, x, y = case
        work = work_of(_sgd(loss), params, x, y, steps)  # one step: the loop's body
        # one client's steps take about a millisecond: many repeats cost little and steady
        # the minimum, which decides between the kernel sets
        one_s = _best_time(_jitted(loss, kernels, False), params, x, y, steps,
                           repeats=12) / _STEPS
        if not vectorized:
            return work, one_s, None
        _, *many = _stacked(case)
        many_s = _best_time(_jitted(loss, kernels, True), *many, steps) / _STEPS
        return work, one_s, many_s

    cases = _kernel_cases(first=shared is None)
    timings = {}
    if shared is None:
        tiny, timings["tiny_step_s"], _ = timed(*cases["tiny"])
        launch = timings["tiny_step_s"] / max(tiny.ops, 1)
        streamed, stream_one, _ = timed(*cases["elementwise"])
        timings["elementwise_step_s"] = stream_one
        bytes_per_s = _bytes_rate(streamed, stream_one, launch)
    else:
        launch, bytes_per_s = shared.launch_s, shared.bytes_per_s
    dense, dense_one, dense_many = timed(*cases["dense"])
    convolution, conv_one, conv_many = timed(*cases["conv"])
    floor = lambda w: w.ops * launch  # noqa: E731

    def rate(flops: float, seconds: float, work: StepWork, clients: int) -> float:
        rest = seconds - floor(work) - clients * work.bytes / bytes_per_s
        return clients * flops / max(rest, 0.05 * seconds)

    rates = KernelRates(
        launch_s=launch,
        dot_one=rate(dense.dot_flops, dense_one, dense, 1),
        conv_one=rate(convolution.conv_flops, conv_one, convolution, 1),
        dot_many=rate(dense.dot_flops, dense_many, dense, _MANY),
        conv_many=rate(convolution.conv_flops, conv_many, convolution, _MANY),
        bytes_per_s=bytes_per_s)
    timings.update(dense_step_s=[dense_one, dense_many], conv_step_s=[conv_one, conv_many])
    return rates, timings


def last_level_cache_bytes() -> float:
    """The default backend's last-level cache in bytes: a CPU's largest cache (Linux's sysfs,
    else `_CACHE_FALLBACK_BYTES`); infinite on an accelerator, whose element-wise rate is
    measured in its own memory (`cost_model.memory_slowdown` is 1 there)."""
    if jax.default_backend() != "cpu":
        return math.inf
    root, units = "/sys/devices/system/cpu/cpu0/cache", {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        sizes = []
        for index in os.listdir(root):
            with open(os.path.join(root, index, "size")) as f:
                text = f.read().strip()
            sizes.append(int(text.rstrip("KMG")) * units.get(text[-1:], 1))
        return float(max(sizes))
    except (OSError, ValueError):  # not Linux, or no cache described
        return float(_CACHE_FALLBACK_BYTES)


def _memory_case(cache_bytes: float):
    """The element-wise reference over rows twice `cache_bytes` (at most 256 MiB; one step)."""
    rows = int(min(2 * cache_bytes, 2**28)) // (4096 * 4)
    return _elementwise_case(max(rows, 64), 4096)


def _memory_rate(cache_bytes: float, launch_s: float) -> float:
    """Bytes/s (counted as `work_of` counts them) of the element-wise reference beyond the
    last-level cache; 0 on an accelerator (no such cache)."""
    if not math.isfinite(cache_bytes):
        return 0.0
    loss, *arrays = _memory_case(cache_bytes)
    arrays = jax.device_put(arrays)  # on the device once: the timing is of the program
    one = np.int32(1)
    work = work_of(_sgd(loss), *arrays, one)
    seconds = _best_time(_jitted(loss, "xla", False), *arrays, one, repeats=2)
    return _bytes_rate(work, seconds, launch_s)


def _bytes_rate(work: StepWork, seconds: float, launch_s: float) -> float:
    """Bytes/s of an element-wise reference step: its counted bytes over its seconds less its
    operations' launches (at least 5 % of them)."""
    return work.bytes / max(seconds - work.ops * launch_s, 0.05 * seconds)


def _finish_reference(upload, template):
    """A finishing like the upload plan's: the update's norm and a finite check."""
    delta = jax.tree.map(lambda u, t: u - t, upload, template)
    return {"norm": jnp.sqrt(sum(jnp.sum(d * d) for d in jax.tree.leaves(delta))),
            "finite": jnp.all(jnp.stack([jnp.all(jnp.isfinite(u))
                                         for u in jax.tree.leaves(upload)]))}


_OVERHEAD_PARTICIPANTS = 32


def _overhead_template() -> dict[str, np.ndarray]:
    """The upload the overhead references hand back: 64k floats in 8 leaves."""
    return {f"w{i}": np.zeros((8192,), np.float32) for i in range(8)}


@functools.cache  # the runners `prepare` warms up are the ones `_runner_overheads` times
def _overhead_calls(threads: int) -> dict[tuple[str, bool], Callable[[], object]]:
    """(strategy, with a finishing) -> a call of that runner's update for
    `_OVERHEAD_PARTICIPANTS` participants on a program that computes nothing but hands back an
    upload of `_overhead_template()` ('loop': without a finishing only)."""
    from fedjax_pfedes.algorithms.base import CohortProgram
    from fedjax_pfedes.data.federated import ClientArrays
    from fedjax_pfedes.execution import runners
    from fedjax_pfedes.execution.strategies.protocol import Finishing

    template = _overhead_template()

    def update(broadcast, state, train, rng):
        del rng
        moved = jnp.sum(train.x[0]) * 0.0 + 1.0
        return (jax.tree.map(lambda a: a + moved, broadcast), state + moved,
                {"loss": moved})

    program = CohortProgram(lambda rng: jnp.zeros(()), update,
                            lambda b, s, t: {"personalized_accuracy": jnp.float32(0.0)},
                            lambda b, s, x: x)
    p = _OVERHEAD_PARTICIPANTS
    states = np.zeros((p,), np.float32)
    train = ClientArrays(np.zeros((p, 2, 3), np.float32), np.zeros((p, 2), np.int32),
                         np.full((p,), 2, np.int32))
    slots = np.arange(p, dtype=np.int32)
    keys = jax.random.wrap_key_data(np.zeros((p, 2), np.uint32))
    finishing = Finishing(template, template, _finish_reference)
    calls = {}
    for name in ("scan", "vmap", "loop"):
        # 'scan' on one lane: the cost model prices one scan (`cost_model.predict`).
        runner = runners.make_runner(program, name, loop_threads=threads if name == "loop" else 1)
        for sent in ((template, finishing) if name != "loop" else (template,)):
            calls[name, sent is finishing] = functools.partial(
                lambda sent, runner: runner.update(sent, np.copy(states), train, slots, keys),
                sent, runner)
    return calls


def _runner_overheads(threads: int) -> dict[str, float]:
    """The strategies' own costs on a program that computes nothing but hands back an upload
    of 64k floats (`_overhead_calls`): 'call_s' (one 'scan' update call),
    'loop_participant_s' (what 'loop' takes per participant), 'finish_one' and 'finish_many'
    (bytes/s of a finishing like the upload plan's, `_finish_reference`, under 'scan' and
    under 'vmap')."""
    template = _overhead_template()
    finish_bytes = _OVERHEAD_PARTICIPANTS * work_of(_finish_reference, template, template).bytes
    seconds = {key: _best_time(call) for key, call in _overhead_calls(threads).items()}
    rate = lambda n: finish_bytes / max(seconds[n, True] - seconds[n, False],  # noqa: E731
                                        1e-3 * seconds[n, True])
    return {"call_s": seconds["scan", False],
            "loop_participant_s": seconds["loop", False] / _OVERHEAD_PARTICIPANTS,
            "finish_one": rate("scan"), "finish_many": rate("vmap")}


_GAIN_TRIALS = 3  # the thread gain's trials: the fastest serial and parallel passes are kept


def _thread_gain(kernels: str) -> float:
    """Share of a second thread's work that adds throughput: two threads each running the
    reference convolution update against one thread running both, the fastest of
    `_GAIN_TRIALS` passes of each: a single pass's ratio is noisy (docs/performance.md,
    "Defaults that decide"), and it decides between 'loop' and 'scan' on convolutional
    cohorts."""
    loss, params, x, y = _conv_case(16, 16, 32)
    fn = _jitted(loss, kernels, False)
    steps = np.int32(_STEPS)
    jax.block_until_ready(fn(params, x, y, steps))
    calls = 3

    def run(n):
        for _ in range(n):
            jax.block_until_ready(fn(params, x, y, steps))

    serial = parallel = math.inf
    for _ in range(_GAIN_TRIALS):
        t0 = time.perf_counter()
        run(2 * calls)
        serial = min(serial, time.perf_counter() - t0)
        threads = [threading.Thread(target=run, args=(calls,)) for _ in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        parallel = min(parallel, time.perf_counter() - t0)
    return float(min(max(serial / parallel - 1.0, 0.0), 1.0))


def measure(kernel_sets: tuple[str, ...]) -> tuple[MachineRates, dict]:
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
    cache_bytes = last_level_cache_bytes()
    rates = MachineRates(thread_gain=gain, kernels={k: r for k, (r, _) in measured.items()},
                         cache_bytes=cache_bytes,
                         memory_bytes_per_s=_memory_rate(cache_bytes, first[0].launch_s),
                         **overheads)
    return rates, {k: t for k, (_, t) in measured.items()}


def _warm_up(kernel_sets: tuple[str, ...]) -> None:
    """Compiles every reference program `measure` times for `kernel_sets` (one call of each)."""
    from fedjax_pfedes.execution.runners import default_loop_threads

    steps = np.int32(_STEPS)
    for i, kernels in enumerate(kernel_sets):
        for case, vectorized in _kernel_cases(first=i == 0).values():
            loss, *arrays = case
            jax.block_until_ready(_jitted(loss, kernels, False)(*arrays, steps))
            if vectorized:
                jax.block_until_ready(_jitted(loss, kernels, True)(*_stacked(case)[1:], steps))
    for call in _overhead_calls(default_loop_threads()).values():
        jax.block_until_ready(call())
    cache_bytes = last_level_cache_bytes()
    if math.isfinite(cache_bytes):
        loss, *arrays = _memory_case(cache_bytes)
        jax.block_until_ready(_jitted(loss, "xla", False)(*arrays, np.int32(1)))


_WARMING: dict[str, threading.Thread] = {}  # rates key -> the thread compiling its references


def _rates_key(machine: dict, kernel_sets: tuple[str, ...]) -> str:
    return hashlib.sha256(json.dumps([RATES_VERSION, machine, sorted(kernel_sets)],
                                     sort_keys=True).encode()).hexdigest()[:24]


def prepare(machine: dict, kernel_sets: tuple[str, ...], cache_dir: str | None
            ) -> threading.Thread | None:
    """Starts compiling the reference programs in a background thread when `cached` will
    measure (no rates in `cache_dir` for `machine` and `kernel_sets`), so that their
    compilations overlap a run's set-up, which leaves a core idle much of the time; `cached`
    waits for the thread and then only times. A warm-up that fails is left to `cached`, which
    meets the same error where it reports it.

    Args:
      machine: `choice.machine()`.
      kernel_sets: the kernel sets to rate, in `cached`'s order.
      cache_dir: the folder `RATES_FILE` is kept in (None: nothing is kept; rates measured).

    Returns:
      The warm-up's thread; None where the rates are cached or a warm-up already runs.
    """
    key = _rates_key(machine, kernel_sets)
    path = os.path.join(cache_dir, RATES_FILE) if cache_dir else None
    if key in _WARMING or key in json_cache.read(path):
        return None

    def warm_up():
        try:
            _warm_up(tuple(kernel_sets))
        except Exception:  # noqa: BLE001 - `cached` measures again and reports it
            pass

    # not a daemon: a process that ends meanwhile (a config error: exit 2) waits for it, as a
    # daemon thread inside a compilation aborts the interpreter's shutdown
    _WARMING[key] = threading.Thread(target=warm_up, name="machine-rates-warm-up")
    _WARMING[key].start()
    return _WARMING[key]


def cached(machine: dict, kernel_sets: tuple[str, ...], cache_dir: str | None) -> MachineRates:
    """This machine's rates: from `RATES_FILE` in `cache_dir` when measured before under the
    same `machine` (`choice.machine()`) and kernel sets, else measured now (and cached).

    Args:
      machine: `choice.machine()`.
      kernel_sets: the kernel sets to rate.
      cache_dir: the folder `RATES_FILE` is kept in (None: measure, keep nothing).

    Returns:
      The `MachineRates`.
    """
    key = _rates_key(machine, kernel_sets)
    warming = _WARMING.pop(key, None)
    if warming is not None:  # `prepare` is compiling the references: timings wait for it
        warming.join()
    path = os.path.join(cache_dir, RATES_FILE) if cache_dir else None
    cache = json_cache.read(path)
    if key in cache:
        try:
            return MachineRates.from_dict(cache[key]["rates"])
        except (KeyError, TypeError, ValueError):
            pass  # a damaged entry is measured anew
    rates, timings = measure(tuple(kernel_sets))
    if path:
        cache = json_cache.read(path)
        cache[key] = {"machine": machine, "rates": rates.as_dict(), "timings": timings}
        json_cache.write(path, cache)
    return rates

