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
  The bytes the finishing of one participant's upload writes (its norm and checks,
  `protocol.Finishing`) are read from that function's jaxpr the same way.
* **The machine** (`MachineRates`, `execution.machine_rates`): measured once per machine
  (`choice.machine()`: backend, device kind, CPU model and features, cores, jax and jaxlib) on
  small reference programs and cached next to the compilation cache: a 'scan' call and 'loop''s
  cost per participant on a program that computes nothing, how much a second host thread adds,
  an operation's launch time, bytes/s of element-wise work and of the upload finishing (one
  client at a time and vectorized), and per kernel set the rates of one client's matrix products
  and convolutions and of the same vectorized over clients (`vmap` turns per-client
  convolutions into grouped ones, which XLA:CPU runs far slower).

A round of the cohort then costs, with P participants (expected), mean and longest local steps
s̄ and ŝ, a bucket of B slots, T loop threads and f, F the finishing's seconds per client one at
a time and vectorized:

  loop  P (per-participant + f + s̄ step(1) / parallel(T))   T participants at once
  scan  call + L/parallel(L) (⌈P/L⌉ (f + s̄ step(1)) + (1 - 1/L)(ŝ - s̄) step(1))
                                                           L = min(T, B) lanes, one call each
  vmap  call + B F + ŝ step(B)                              one call, every slot to the end
  shard vmap over the devices' shares of the bucket

where step(n) = ops · launch + n (matmul flops / matmul rate + conv flops / conv rate + bytes /
bandwidth), the rates being the one-client ones for n = 1 and the vectorized ones otherwise,
and parallel(n) = 1 + (n - 1) · thread gain: n host threads run n participants (or lanes) in the
time one runs parallel(n) of them.
'vmap' (and 'shard') keep every slot's arrays live at once: where the bucket's bytes of a step
(n x bytes) or of its finishing (B x finishing bytes) exceed the last-level cache, the share
beyond it moves at the machine's memory bandwidth instead of the cache's (`memory_slowdown`;
the reference rates are measured in cache). One client's step streams through its own
activations, which the references' rates already include.
'scan' on T > 1 host threads splits the participants into lanes of equal counts, dealt by their
samples (`strategies.scanned`): the longest lane runs ⌈P/L⌉ participants, and unequal clients
leave it up to (1 - 1/L) of the longest one's steps above the mean (a bound for a greedy deal).
Its participants' new state rows also move `LANE_ROW_PASSES` more times than under 'loop',
which updates them in place: P x that x a state row's bytes at the memory's rate are added.
A cohort whose states would take more than the evaluation budget per lane runs one lane; the
model does not see that budget and prices lanes (an optimistic price, for 10,000s of clients).
`rank` returns the candidates' predicted round times; `contenders` the best and the best of
another strategy when it is within `MARGIN` and the difference is worth a compilation. The
model never changes numbers: every candidate computes the same ones up to float
reassociation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import numpy as np

from fedjax_pfedes.execution.kernels import CPU_KERNELS

DEFAULT_KERNELS = CPU_KERNELS[0]  # 'xla': XLA:CPU's own kernels
# The kernel set preferred on an x86 CPU without AVX-512: on the AVX2-only CPUs measured, XLA's
# Eigen convolutions ran every convolutional client program faster than YNNPACK's, on the
# AVX-512 one as fast or slower (docs/performance.md, "CPU kernels and strategies").
AVX2_KERNELS = CPU_KERNELS[1]  # 'eigen'
# How much faster another kernel set than the preferred one must be predicted to be chosen:
# the kernel rates come from small reference programs, noisy on a small machine
# (docs/performance.md, "Defaults that decide").
KERNEL_MARGIN = 1.25
# How far the model is trusted: another strategy predicted within this factor of the best one
# is timed against it, when the best one compiles within `TIMING_COMPILE_BUDGET_S`.
MARGIN = 2.0
# A timing compiles a second candidate, at about the cost of the first: it is run only when the
# model's best compiled and ran its first call within this many seconds of CPU time (not wall
# time, which a busy machine inflates: a decision is cached for later runs). It lies between
# work B's programs, which the model cannot rank and a timing must, and the quick start's
# convolutional cohorts, which the model ranks (docs/performance.md, "Defaults that decide").
TIMING_COMPILE_BUDGET_S = 3.2
# A predicted difference below this share of the whole round (all cohorts) is not worth the
# compilation a timing costs.
NEGLIGIBLE_SHARE = 0.05
# Part of a cached decision's key (`choice`): raised whenever the prices change, so that a
# decision the former model made is made again.
MODEL_VERSION = 2
# Passes over a participant's state row that 'scan''s lanes make beyond 'loop''s in-place
# update: a lane writes its new rows stacked, the round concatenates them (a read and a write)
# and scatters them back (a read).
LANE_ROW_PASSES = 4
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

    def __sub__(self, other: StepWork) -> StepWork:
        """The work of a program less that of a part of it (e.g. a step without its finishing)."""
        return StepWork(self.dot_flops - other.dot_flops, self.conv_flops - other.conv_flops,
                        self.bytes - other.bytes, self.ops - other.ops)


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
    """One kernel set's measured rates (`execution.machine_rates`): seconds per operation
    launch, and flop/s or byte/s of one client (`*_one`) and of clients vectorized with `vmap`
    (`*_many`, per client)."""

    launch_s: float
    dot_one: float
    conv_one: float
    dot_many: float
    conv_many: float
    bytes_per_s: float


@dataclasses.dataclass(frozen=True)
class MachineRates:
    """A machine's constants (`execution.machine_rates.measure`).

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
      cache_bytes: the last-level cache (a CPU's; infinite on an accelerator, whose measured
        rates are its memory's).
      memory_bytes_per_s: bytes/s of the element-wise reference whose working set is beyond
        `cache_bytes` (0: not measured, bytes move at the in-cache rate).
    """

    call_s: float
    loop_participant_s: float
    thread_gain: float
    finish_one: float
    finish_many: float
    kernels: dict[str, KernelRates]
    cache_bytes: float = math.inf
    memory_bytes_per_s: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MachineRates:
        return cls(float(d["call_s"]), float(d["loop_participant_s"]),
                   float(d["thread_gain"]), float(d["finish_one"]), float(d["finish_many"]),
                   {k: KernelRates(**v) for k, v in d["kernels"].items()},
                   float(d["cache_bytes"]), float(d["memory_bytes_per_s"]))


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
      state_bytes: bytes of one client's private state row.
    """

    participants: float
    bucket: int
    mean_steps: float
    max_steps: float
    host_threads: int = 1
    mesh_size: int = 1
    finish_bytes: float = 0.0
    state_bytes: float = 0.0


def memory_slowdown(working_set: float, machine: MachineRates) -> float:
    """How many times longer bytes take to move when a program keeps `working_set` bytes live
    at once: 1 within the last-level cache; beyond it, the share of the bytes beyond the cache
    moves at the memory's rate instead of the cache's (the ratio of the machine's element-wise
    rates in cache and beyond it)."""
    if working_set <= machine.cache_bytes:
        return 1.0
    beyond = 1.0 - machine.cache_bytes / working_set
    return 1.0 + beyond * max(_in_cache_rate(machine) / _memory_rate(machine) - 1.0, 0.0)


def step_seconds(work: StepWork, rates: KernelRates, clients: int,
                 slowdown: float = 1.0) -> float:
    """Seconds of one local step of `clients` clients run together (1: alone; more: vmapped),
    its bytes moving `slowdown` times slower than in cache (`memory_slowdown`)."""
    dot, conv = ((rates.dot_one, rates.conv_one) if clients == 1
                 else (rates.dot_many, rates.conv_many))
    return work.ops * rates.launch_s + clients * (
        work.dot_flops / dot + work.conv_flops / conv + slowdown * work.bytes / rates.bytes_per_s)


def _in_cache_rate(machine: MachineRates) -> float:
    """Bytes/s of element-wise traffic within the cache (shared by the kernel sets)."""
    return next(iter(machine.kernels.values())).bytes_per_s


def _memory_rate(machine: MachineRates) -> float:
    """Bytes/s of traffic beyond the cache: the measured memory rate, else the in-cache one
    (no slowdown beyond the cache where none was measured)."""
    if math.isfinite(machine.memory_bytes_per_s) and machine.memory_bytes_per_s > 0:
        return machine.memory_bytes_per_s
    return _in_cache_rate(machine)


def predict(work: StepWork, cohort: Cohort, machine: MachineRates, strategy: str,
            kernels: str) -> float:
    """Predicted seconds of the cohort's local updates in one round under `strategy` with
    `kernels` (the module docstring's formulas).

    Args:
      work: one client's step (`work_of`).
      cohort: participants, bucket, steps, threads, devices.
      machine: the machine's rates (`execution.machine_rates.measure`).
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
        one = step_seconds(work, rates, 1)
        lanes = max(1, min(cohort.host_threads, cohort.bucket))
        if lanes == 1:
            return c + p * (finish_one + cohort.mean_steps * one)
        longest = (math.ceil(p / lanes) * (finish_one + cohort.mean_steps * one) +
                   (1 - 1 / lanes) * max(cohort.max_steps - cohort.mean_steps, 0.0) * one)
        # the lanes' new state rows: stacked, concatenated, scattered back (`LANE_ROW_PASSES`)
        rows = LANE_ROW_PASSES * p * cohort.state_bytes / _memory_rate(machine)
        return c + longest * lanes / (1.0 + (lanes - 1) * machine.thread_gain) + rows
    if strategy in ("vmap", "shard"):
        share = cohort.bucket if strategy == "vmap" else math.ceil(
            cohort.bucket / max(cohort.mesh_size, 1))
        many = max(share, 2)
        finishing = share * cohort.finish_bytes
        return c + memory_slowdown(finishing, machine) * finishing / machine.finish_many + (
            cohort.max_steps * step_seconds(work, rates, many,
                                            memory_slowdown(many * work.bytes, machine)))
    return math.inf


def preferred_kernels(platform: str, cpu_features: list[str] | tuple[str, ...]) -> str:
    """The kernel set another must be predicted `KERNEL_MARGIN` faster than to be chosen:
    `AVX2_KERNELS` on a CPU with AVX2 and without AVX-512, else `DEFAULT_KERNELS`.

    Args:
      platform: the backend's platform ('cpu', 'gpu', 'tpu').
      cpu_features: the CPU's instruction-set features (`choice.machine()`'s).

    Returns:
      A name of `CPU_KERNELS`.
    """
    features = set(cpu_features)
    if platform == "cpu" and "avx2" in features and "avx512f" not in features:
        return AVX2_KERNELS
    return DEFAULT_KERNELS


def rank(work: StepWork, cohort: Cohort, machine: MachineRates,
         candidates: dict[str, tuple[str, str]], preferred: str = DEFAULT_KERNELS
         ) -> dict[str, float]:
    """Predicted round seconds of each candidate, cheapest first.

    Args:
      work: one client's step (`work_of`).
      cohort: participants, bucket, steps, threads, devices (`Cohort`).
      machine: the machine's rates.
      candidates: runner name -> (strategy, kernels).
      preferred: the kernel set a candidate of another must be predicted `KERNEL_MARGIN`
        faster than to rank first (`preferred_kernels`).

    Returns:
      runner name -> predicted seconds, cheapest first, where a kernel set other than
      `preferred` must be predicted `KERNEL_MARGIN` faster to rank first (the kernel rates
      come from small reference programs).
    """
    priced = {name: predict(work, cohort, machine, s, k) for name, (s, k) in candidates.items()}
    handicap = {name: 1.0 if k == preferred else KERNEL_MARGIN
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
