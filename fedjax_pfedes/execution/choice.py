"""`config.execution.strategy='auto'` and `cpu_kernels='auto'` (the defaults): pick each cohort's
execution strategy and CPU kernels.

The candidates are the strategies 'loop', 'vmap' and 'scan' ('shard' with several devices), each
with the kernel choices `execution.kernels.kernel_candidates` gives. `execution.cost_model`
prices them first, without compiling any (`decide`). Its best is taken untimed unless the best
candidate of another strategy is predicted within `cost_model.MARGIN`, the difference is more
than `cost_model.NEGLIGIBLE_SHARE` of the round, and the best one's program compiles within
`cost_model.TIMING_COMPILE_BUDGET_S` (a timing compiles the other at about that cost). Then both
run the cohort's local update on a full bucket of participants with every client cut to one
batch of rows (one local step per epoch), on the backend the run uses. The compiled programs are
the run's own (sizes are data, not shapes), so the winner's compilation is reused by the rounds.
From the per-call times the expected cost of a real round follows from the clients' planned step
counts: the loop and the scan run each participant's own steps, vmap iterates over the whole
bucket until the longest schedule ends.
The cheaper one wins; the prediction, the timings, the choice and its reason go into
summary.json and the run's log.

Decisions are cached in `strategy_choices.json` next to the compilation cache (keyed by backend,
device kind and count, the CPU's model and instruction-set features and the cores this process
may use, the jax and jaxlib versions, algorithm, architecture, shapes and bucket, and what the
upload plan adds to each runner's program: `_what_is_sent`), so later runs
on the same machine decide without the model or a timing, and a cache copied to another CPU
decides anew; the key includes the candidates, so adding one decides anew. No platform rule is
built in: the model's constants are measured on the machine (`execution.machine_rates`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.algorithms.base import PyTree
from fedjax_pfedes.execution import cost_model, json_cache, machine_rates, slot_rows
from fedjax_pfedes.execution.strategies import protocol

CACHE_FILE = "strategy_choices.json"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The strategy picked for one cohort and the evidence.

    Attributes:
      strategy: the chosen runner's name (`CohortRunner.name`): 'loop', 'vmap' or 'shard',
        with '/eigen' when it uses the Eigen CPU kernels.
      seconds_per_call: measured seconds of one update call with one step per client per epoch.
      expected_round_s: those scaled to the cohort's planned steps per round, per runner name.
      predicted_round_s: the cost model's round seconds per runner name (empty without it).
      reason: why this one, in words.
      cached: True when read from the decision cache instead of decided now.
    """

    strategy: str
    seconds_per_call: dict[str, float]
    expected_round_s: dict[str, float]
    predicted_round_s: dict[str, float] = dataclasses.field(default_factory=dict)
    reason: str = ""
    cached: bool = False

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# The instruction-set features that change which kernels XLA:CPU emits (and so which strategy
# and kernel set wins): a decision made on an AVX-512 CPU is not reused on an AVX2-only one.
CPU_FEATURES = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "amx_tile", "asimd", "sve")


def machine() -> dict:
    """What a decision depends on beyond the program: the backend's device kind and count, the
    CPU's model, its instruction-set features among `CPU_FEATURES` and the cores this process
    may use, the jax and jaxlib versions.

    Returns:
      A JSON-able dict (part of the decision cache's key; summary.json states it).
    """
    import jaxlib

    device = jax.devices()[0]
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "CPU part") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:  # not Linux: the platform module's word for it
        import platform
        model = platform.processor()
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count())
    return {"platform": device.platform, "device_kind": device.device_kind,
            "devices": len(jax.devices()), "cpu": model,
            "cpu_features": [f for f in CPU_FEATURES if f in flags], "cores": cores,
            "jax": jax.__version__, "jaxlib": jaxlib.__version__}


def _signature(name: str, candidates: list[str], broadcast, states, train, bucket: int,
               epochs: int, sent: list | None = None) -> str:
    # (offloaded samples are one ragged host object: its type and padded capacity stand in)
    shapes = [(jax.tree_util.keystr(p), tuple(np.shape(x)),
               str(getattr(x, "dtype", type(x).__name__)), getattr(x, "capacity", None))
              for tree in (broadcast, states, train)
              for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
    # (the rates' and the model's versions: a decision made from rates measured, or by a
    # model pricing, the old way is made again)
    text = json.dumps([machine(), machine_rates.RATES_VERSION, cost_model.MODEL_VERSION, name,
                       candidates, bucket, epochs, shapes, sent or []], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclasses.dataclass(frozen=True)
class Trial:
    """One cohort's measurement inputs (see `choose`)."""

    name: str
    runners: dict[str, protocol.CohortRunner]
    broadcast: PyTree
    states: PyTree
    train: PyTree
    bucket: int
    expected_participants: float
    planned_steps: np.ndarray
    epochs: int
    batch_size: int
    # runner -> what a round passes its update as the broadcast (`finishing.sent_to_runner`: an
    # `execution.strategies.protocol.Finishing` that streams under 'scan'); None: `broadcast` itself
    sent: Callable[[protocol.CohortRunner], PyTree] | None = None
    # one client's local update (`CohortProgram.client_update`): what the cost model reads
    client_update: Callable | None = None
    host_threads: int = 1  # the 'loop' strategy's host threads (resolved)
    mesh_size: int = 1  # devices of the 'shard' mesh

    def work(self) -> tuple[cost_model.StepWork, float]:
        """(one client's local step, the bytes its upload's finishing writes), from the jaxprs
        of `client_update` and of what a round sends (`cost_model.work_of`).

        The update is traced with the arguments 'loop' (where it is a candidate) first calls
        it with: what a round sends it, one client's rows of the states and data
        (`slot_rows.row_shapes`), a key. That trace is then the runner's own, read from JAX's
        tracing cache instead of traced again; a finishing it runs is subtracted again."""
        whole = lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype)  # noqa: E731
        # offloaded samples are ragged on the host: one client's padded rows stand for all
        train = (self.train.padded(np.zeros(1, np.int64)) if hasattr(self.train, "padded")
                 else self.train)
        first = next((r for r in self.runners.values() if r.strategy == "loop"),
                     next(iter(self.runners.values())))
        sent = self.broadcast if self.sent is None else self.sent(first)
        step, (upload, _, _) = cost_model.work_of(
            self.client_update, sent, slot_rows.row_shapes(self.states),
            slot_rows.row_shapes(train), jax.random.key(0), with_shapes=True)
        if not isinstance(sent, protocol.Finishing):
            return step, 0.0
        finish = cost_model.work_of(sent.fn, upload, jax.tree.map(whole, sent.operand))
        return step - finish, finish.bytes

    def fixed_costs(self, rates: cost_model.MachineRates) -> dict[str, tuple[float, float]]:
        """runner -> (seconds of a measured call, seconds of a round) the machine's dispatch
        costs: 'loop' pays its per-participant cost for each of the call's `bucket` slots and
        each of a round's expected participants, the others one call."""
        fixed = {}
        for name, r in self.runners.items():
            if r.strategy == "loop":
                fixed[name] = (self.bucket * rates.loop_participant_s,
                               self.expected_participants * rates.loop_participant_s)
            else:
                fixed[name] = (rates.call_s, rates.call_s)
        return fixed

    def predicted(self, rates: cost_model.MachineRates) -> dict[str, float]:
        """The cost model's round seconds per runner, cheapest first (`cost_model.rank`)."""
        step, finish_bytes = self.work()
        cohort = cost_model.Cohort(
            participants=float(self.expected_participants), bucket=self.bucket,
            mean_steps=float(np.mean(self.planned_steps)),
            max_steps=float(np.max(self.planned_steps)), host_threads=self.host_threads,
            mesh_size=self.mesh_size, finish_bytes=finish_bytes,
            state_bytes=float(slot_rows.row_bytes(self.states)))
        candidates = {name: (r.strategy, r.kernels) for name, r in self.runners.items()}
        here = machine()
        return cost_model.rank(step, cohort, rates, candidates, cost_model.preferred_kernels(
            here["platform"], here["cpu_features"]))

    def inputs(self):
        """(one-step train arrays, slots, keys) of the measurement: every client keeps one full
        batch of its rows (a real step's work), so it runs one step per epoch."""
        members = self.train.sizes.shape[0]
        slots = np.arange(self.bucket, dtype=np.int32) % max(members, 1)
        keys = jax.random.split(jax.random.key(0), self.bucket)
        one_step = self.train.replace(sizes=jnp.minimum(self.train.sizes, self.batch_size))
        if getattr(one_step, "step_limit", None) is not None:
            one_step = one_step.replace(step_limit=jnp.full_like(one_step.step_limit,
                                                                 self.epochs))
        return one_step, slots, keys


@jax.jit
def _copy(tree: PyTree) -> PyTree:
    """A copy of `tree` in one compiled call (an update donates the states it is given; eager
    copies would compile one program per leaf shape)."""
    return jax.tree.map(jnp.copy, tree)


_SAVED_EVENT = "/jax/compilation_cache/compile_time_saved_sec"
_saved_compile_s = [0.0]  # the persistent cache's saved compilation seconds, this process


def _count_saved(event: str, duration: float, **_) -> None:
    if event == _SAVED_EVENT:
        _saved_compile_s[0] += duration


jax.monitoring.register_event_duration_secs_listener(_count_saved)


def _first_call(runner: protocol.CohortRunner, broadcast, states, train, slots, keys
                ) -> tuple[Any, float]:
    """(the states after a first update call, its cost: CPU seconds plus the compilation seconds
    JAX's persistent cache saved it). CPU time, not wall time: the work of a compilation, which
    other processes on a busy machine do not inflate, so that the decision (cached for later
    runs) does not depend on the load at the moment it was made; and the compilations the cache
    saved, because the other candidate's programs are not in it: a first call loaded from the
    cache is no sign of a cheap timing. The call trains one participant, the other slots
    padded: it compiles the programs a full bucket runs (sizes are data, not shapes) without a
    bucket's work, which a decision that stops there would add to the run."""
    members = train.sizes.shape[0]
    one = np.where(np.arange(len(slots)) == 0, slots, members).astype(np.asarray(slots).dtype)
    cpu0, saved0 = time.process_time(), _saved_compile_s[0]
    out = runner.update(broadcast, _copy(states), train, one, keys)
    jax.block_until_ready(out)
    return out[1], time.process_time() - cpu0 + _saved_compile_s[0] - saved0


def _call_seconds(runner: protocol.CohortRunner, broadcast, states, train, slots, keys
                  ) -> tuple[float, Any]:
    """(wall seconds of one update call of every slot, the states after it)."""
    t0 = time.perf_counter()
    out = runner.update(broadcast, states, train, slots, keys)
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out[1]


def cached_choice(trial: Trial, cache_dir: str | None) -> Choice | None:
    """The cached decision for `trial`, if there is one."""
    cache = json_cache.read(os.path.join(cache_dir, CACHE_FILE) if cache_dir else None)
    entry = cache.get(_key(trial))
    if entry and entry.get("strategy") in trial.runners:
        return Choice(**{**entry, "cached": True})
    return None


def _key(t: Trial) -> str:
    name = t.name if t.sent is None else f"{t.name}/as sent"
    return _signature(name, sorted(t.runners), t.broadcast, t.states, t.train, t.bucket,
                      t.epochs, _what_is_sent(t))


def _what_is_sent(t: Trial) -> list:
    """Per runner, what a round's upload plan adds to its program: the structure of the
    finishing's per-client facts and the streaming reducer (a plain, a private and a securely
    aggregated round of the same cohort compile different programs, so they decide apart)."""
    if t.sent is None:
        return []
    described = []
    for name in sorted(t.runners):
        sent = t.sent(t.runners[name])
        if not isinstance(sent, protocol.Finishing):
            described.append([name, None])
            continue
        facts = jax.eval_shape(sent.fn, sent.operand, sent.operand)
        described.append([name, str(jax.tree.structure(facts)), repr(sent.reducer)])
    return described


def choose(trial: Trial, cache_dir: str | None, repeats: int = 3,
           predicted: dict[str, float] | None = None, timing: bool = True,
           negligible_s: float = 0.0,
           fixed: dict[str, tuple[float, float]] | None = None) -> Choice:
    """The trial's runner (name -> runner) for one cohort: the cached decision, else the cost
    model's best when no other candidate is within `cost_model.MARGIN` of it, else the cheaper
    of the contenders as timed.

    `trial` fields: name (algorithm/architecture, part of the cache key); runners; broadcast
    (or `sent`: per runner, what a round really passes it, e.g. a streaming `Finishing`);
    states and train (the cohort's stacked private states and padded train arrays); bucket
    (participant slots per round); expected_participants (mean number of the cohort's members
    that train in a round); planned_steps ([members] local steps in a round); epochs (the static
    number of local epochs: each measured client runs one step per epoch); batch_size (the local
    batch size: each measured client keeps that many rows). `cache_dir`: where the
    decision cache lives (None: no cache). `predicted`: the cost model's round seconds per
    runner, cheapest first (`cost_model.rank`; None: time every runner). `timing`: False takes
    the model's best untimed (where a timing cannot run, e.g. offloaded states).
    `negligible_s`: a predicted difference per round not worth timing (`cost_model.contenders`).
    `fixed`: per runner, the dispatch seconds of a measured call and of a round, which a timing
    does not scale with the local steps (`Trial.fixed_costs`).
    """
    cached = cached_choice(trial, cache_dir)
    if cached is not None:
        return cached
    if predicted is None:
        timed, why = list(trial.runners), "timed every candidate"
    else:
        strategies = {name: r.strategy for name, r in trial.runners.items()}
        timed = (cost_model.contenders(predicted, strategies, negligible_s=negligible_s)
                 if timing else list(predicted)[:1])
        why = (f"timed the cost model's best two strategies (within {cost_model.MARGIN}x)"
               if len(timed) > 1 else _model_reason(predicted, strategies, timing))
    if len(timed) == 1:
        choice = Choice(timed[0], {}, {}, dict(predicted or {}), why)
    else:
        per_call, expected, first_s = _timed(trial, timed, repeats,
                                             budget_s=None if predicted is None else
                                             cost_model.TIMING_COMPILE_BUDGET_S, fixed=fixed)
        if len(per_call) < len(timed):
            why = (f"the cost model's best; {timed[0]}'s program took {first_s:.1f} s of CPU "
                   f"time to compile (or the cache saved that) and run once, above the "
                   f"{cost_model.TIMING_COMPILE_BUDGET_S} s a timing of {timed[1]} may cost")
        best = min(expected, key=expected.get) if expected else timed[0]
        choice = Choice(best, per_call, expected, dict(predicted or {}), why)
    if cache_dir:  # re-read: another run may have added its decisions meanwhile
        path = os.path.join(cache_dir, CACHE_FILE)
        cache = json_cache.read(path)
        cache[_key(trial)] = {k: v for k, v in choice.as_dict().items() if k != "cached"}
        json_cache.write(path, cache)
    return choice


def rated_kernels(runner_sets: Iterable[dict[str, Any]]) -> tuple[str, ...]:
    """The kernel sets whose machine rates a decision among `runner_sets` (each cohort's runner
    name -> runner) reads, in the order `machine_rates.cached` measures them."""
    return tuple(dict.fromkeys(r.kernels for runners in runner_sets for r in runners.values()))


def decide(trials: dict[str, Trial], cache_dir: str | None, timing: bool = True,
           rates_dir: str | None = None) -> dict[str, dict]:
    """Each cohort's runner (`choose`), the cost model's inputs made once for all of them: the
    machine's rates (`machine_rates.cached`, only when some cohort is not in the decision cache)
    and the difference not worth timing (`cost_model.NEGLIGIBLE_SHARE` of the whole predicted
    round).

    Args:
      trials: cohort name -> its `Trial`.
      cache_dir: the decision cache's folder (None: none).
      timing: False decides from the model alone (offloaded states).
      rates_dir: where the machine's rates are kept (None: `cache_dir`); the engine keeps them
        per user (`compilation.user_cache_dir`), whatever compilation cache a run uses.

    Returns:
      cohort name -> `Choice.as_dict()` with `decided_in_s`: the seconds its decision took
      (the rates and the jaxprs shared equally among the cohorts).
    """
    start = time.perf_counter()
    undecided = [a for a, t in trials.items() if cached_choice(t, cache_dir) is None]
    predicted, fixed = {}, {}
    if undecided:
        rates = machine_rates.cached(machine(), rated_kernels(t.runners for t in trials.values()),
                                     cache_dir if rates_dir is None else rates_dir)
        predicted = {a: trials[a].predicted(rates) for a in undecided}
        fixed = {a: trials[a].fixed_costs(rates) for a in undecided}
    negligible = cost_model.NEGLIGIBLE_SHARE * sum(min(p.values()) for p in predicted.values())
    shared_s = (time.perf_counter() - start) / max(len(trials), 1)
    out = {}
    for arch, trial in trials.items():
        start = time.perf_counter()
        picked = choose(trial, cache_dir, predicted=predicted.get(arch), timing=timing,
                        negligible_s=negligible, fixed=fixed.get(arch))
        out[arch] = {**picked.as_dict(), "decided_in_s": time.perf_counter() - start + shared_s}
    return out


def _model_reason(predicted: dict[str, float], strategies: dict[str, str],
                  timing: bool) -> str:
    """Why the model's best was taken untimed, in words."""
    names = list(predicted)
    others = [n for n in names if strategies[n] != strategies[names[0]]]
    if not others or not timing:
        return (f"cost model: {names[0]} {predicted[names[0]]:.3g} s/round "
                f"({'no timing with offloaded states' if not timing else 'one strategy'})")
    best, second = predicted[names[0]], predicted[others[0]]
    why = (f"beyond the {cost_model.MARGIN}x margin" if second > cost_model.MARGIN * best
           else "a difference not worth a compilation")
    return (f"cost model: {names[0]} {best:.3g} s/round, next strategy {others[0]} "
            f"{second:.3g} ({second / best:.2f}x, {why})")


def _timed(trial: Trial, names: list[str], repeats: int, budget_s: float | None = None,
           fixed: dict[str, tuple[float, float]] | None = None
           ) -> tuple[dict[str, float], dict[str, float], float]:
    """(seconds per measured call, expected round seconds, seconds of the first runner's
    first call) of the runners `names`, their calls alternating; with `budget_s`, the others
    only when that first call (its compilation) took at most that long. `fixed`: runner ->
    (seconds of a measured call, seconds of a round) that do not grow with the local steps
    (`Trial.fixed_costs`)."""
    epochs, bucket = trial.epochs, trial.bucket
    one_step, slots, keys = trial.inputs()
    sent = {s: trial.broadcast if trial.sent is None else trial.sent(trial.runners[s])
            for s in names}
    states, first_s = {}, 0.0
    for i, s in enumerate(names):
        states[s], first = _first_call(trial.runners[s], sent[s], trial.states, one_step,
                                       slots, keys)
        if i == 0:
            first_s = first
            if budget_s is not None and first > budget_s:
                states = {}
                break
    # The candidates' calls alternate, best of `repeats` each: a burst of load on the machine
    # slows the candidates alike instead of one of them.
    per_call = dict.fromkeys(states, float("inf"))
    for _ in range(repeats):
        for s in states:
            seconds, states[s] = _call_seconds(trial.runners[s], sent[s], states[s], one_step,
                                               slots, keys)
            per_call[s] = min(per_call[s], seconds)
    # A call ran `epochs` steps of every slot. The loop pays per participant and step; vmap
    # (and shard: vmap per device) pays per iteration of the whole bucket, until the longest
    # schedule ends.
    mean_steps, max_steps = float(np.mean(trial.planned_steps)), float(np.max(
        trial.planned_steps))
    # 'scan' pays per participant and step like the loop (padded slots take no step).
    per_participant = mean_steps * trial.expected_participants / (epochs * bucket)
    calls_per_round = {"per_participant": per_participant,
                       "longest_schedule": max_steps / epochs}
    # What a call pays once whatever the steps (the model's dispatch figures, `fixed`: per call,
    # per round) is not scaled with them: a participant's dispatch in 'loop' is paid once,
    # not once per step.
    fixed = fixed or {}
    expected = {}
    for name, seconds in per_call.items():
        call_fixed, round_fixed = fixed.get(name, (0.0, 0.0))
        scale = calls_per_round[protocol.strategy(trial.runners[name].strategy).cost]
        expected[name] = round_fixed + max(seconds - call_fixed, 0.0) * scale
    return per_call, expected, first_s

