"""`config.execution.strategy='auto'` (and `cpu_kernels='auto'`): pick each cohort's execution
strategy and CPU kernels by timing them.

For every cohort, every candidate runner (the strategies 'loop', 'vmap' and 'scan', each with the
kernel choices `execution.kernels.kernel_candidates` gives) runs the cohort's local update on a full
bucket of participants with every client cut to one batch of rows (one local step per epoch), on the
backend the run uses. The compiled programs are the run's own (sizes are data, not shapes), so the
winner's compilation is reused by the rounds. From the per-call times the expected cost of a real
round follows from the clients' planned step counts: the loop and the scan run each
participant's own steps, vmap iterates over the whole bucket until the longest schedule ends. The
cheaper one wins; the timings and the choice go into summary.json.

Decisions are cached in `strategy_choices.json` next to the compilation cache (keyed by backend,
device kind and count, the CPU's model and instruction-set features and the cores this process
may use, the jax and jaxlib versions, algorithm, architecture, shapes and bucket), so later runs
on the same machine skip the measurement and a cache copied to another CPU measures anew; the
key includes the candidates, so adding one measures anew. No platform rule is built in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfedes.algorithms.base import PyTree
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
      cached: True when read from the decision cache instead of measured.
    """

    strategy: str
    seconds_per_call: dict[str, float]
    expected_round_s: dict[str, float]
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
               epochs: int) -> str:
    shapes = [(jax.tree_util.keystr(p), tuple(np.shape(x)), str(jnp.result_type(x)))
              for tree in (broadcast, states, train)
              for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
    text = json.dumps([machine(), name, candidates, bucket, epochs, shapes], sort_keys=True)
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


def _run_once(runner: protocol.CohortRunner, broadcast, states, train, slots, keys):
    copy = jax.tree.map(jnp.copy, states)  # update donates the states it is given
    out = runner.update(broadcast, copy, train, slots, keys)
    jax.block_until_ready(out)
    return out


def _time_update(runner: protocol.CohortRunner, broadcast, states, train, slots, keys,
                 repeats: int) -> float:
    out = _run_once(runner, broadcast, states, train, slots, keys)  # compiled (or cached)
    best = float("inf")
    for _ in range(repeats):
        copy = out[1]
        t0 = time.perf_counter()
        out = runner.update(broadcast, copy, train, slots, keys)
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - t0)
    return best


def cached_choice(trial: Trial, cache_dir: str | None) -> Choice | None:
    """The cached decision for `trial`, if there is one."""
    cache = _read(os.path.join(cache_dir, CACHE_FILE) if cache_dir else None)
    entry = cache.get(_key(trial))
    if entry and entry.get("strategy") in trial.runners:
        return Choice(**{**entry, "cached": True})
    return None


def _key(t: Trial) -> str:
    name = t.name if t.sent is None else f"{t.name}/as sent"
    return _signature(name, sorted(t.runners), t.broadcast, t.states, t.train, t.bucket,
                      t.epochs)


def choose(trial: Trial, cache_dir: str | None, repeats: int = 2) -> Choice:
    """Times the trial's runners (name -> runner) on one cohort; returns the cheapest.

    `trial` fields: name (algorithm/architecture, part of the cache key); runners; broadcast
    (or `sent`: per runner, what a round really passes it, e.g. a streaming `Finishing`);
    states and train (the cohort's stacked private states and padded train arrays); bucket
    (participant slots per round); expected_participants (mean number of the cohort's members
    that train in a round); planned_steps ([members] local steps in a round); epochs (the static
    number of local epochs: each measured client runs one step per epoch); batch_size (the local
    batch size: each measured client keeps that many rows). `cache_dir`: where the
    decision cache lives (None: no cache).
    """
    cached = cached_choice(trial, cache_dir)
    if cached is not None:
        return cached
    trial_runners, bucket, epochs = trial.runners, trial.bucket, trial.epochs
    planned_steps, expected_participants = trial.planned_steps, trial.expected_participants
    one_step, slots, keys = trial.inputs()
    per_call = {s: _time_update(r, trial.broadcast if trial.sent is None else trial.sent(r),
                                trial.states, one_step, slots, keys, repeats)
                for s, r in trial_runners.items()}
    # A call ran `epochs` steps of every slot. The loop pays per participant and step; vmap
    # (and shard: vmap per device) pays per iteration of the whole bucket, until the longest
    # schedule ends.
    mean_steps, max_steps = float(np.mean(planned_steps)), float(np.max(planned_steps))
    # 'scan' pays per participant and step like the loop (padded slots take no step).
    per_participant = mean_steps * expected_participants / (epochs * bucket)
    calls_per_round = {"per_participant": per_participant,
                       "longest_schedule": max_steps / epochs}
    expected = {name: seconds * calls_per_round[
        protocol.strategy(trial_runners[name].strategy).cost]
        for name, seconds in per_call.items()}
    choice = Choice(min(expected, key=expected.get), per_call, expected)
    if cache_dir:  # re-read: another run may have added its decisions meanwhile
        path = os.path.join(cache_dir, CACHE_FILE)
        cache = _read(path)
        cache[_key(trial)] = {k: v for k, v in choice.as_dict().items() if k != "cached"}
        _write(path, cache)
    return choice


def _read(path: str | None) -> dict:
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # a damaged cache is measured anew


def _write(path: str, cache: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(cache, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # the cache is an optimization; a read-only folder only costs a measurement
