"""Where a study's runs execute: in this process one after another (`jobs=1`), or in `jobs`
worker processes at once.

`experiments.run_grid` hands every run it needs to `RunPool.submit` and reads the outcomes in
its own order, so the tables, the tuning's choices and what is written are the same whichever
pool ran them. A run is `engine.loop.run_experiment` in a fresh, spawned process (not forked:
a JAX backend does not survive a fork) that sees the same CPU cores as this one: XLA sizes its
thread pools by the cores a process may use, and a run's numbers depend on them, so a worker
pinned to fewer cores would write other low bits; unpinned, a run's numbers are those of the
same run in this process, bit for bit (tests/studies/test_run_pool.py).

Stopping: the workers ignore SIGINT. When the study stops (Ctrl-C in this process, or an
error), the runs not started are cancelled and each running one is asked to stop after the
round in progress with a checkpoint of it (`StopRequested`), so the same command resumes
every run where it stopped; a worker whose parent was killed stops its run the same way.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import ml_collections

from fedjax_pfedes.engine.callbacks import Callback, RoundEnd, RunInfo
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.errors import ConfigError, RunInterrupted
from fedjax_pfedes.io.checkpoints import ConfigChangedError

# A worker's stop request (set by the parent); a module global in each worker process.
_STOP: Any = None
PARENT_CHECK_S = 1.0  # how often a worker looks whether its parent still runs
_RUNNING = threading.Lock()  # held by a worker while it makes a run


class StopRequested(Callback):
    """Ends a worker's run after the round in progress, checkpointed (`RoundEnd.interrupted`),
    once the parent set the stop event."""

    def __init__(self, stop):
        self.stop = stop

    def on_round_end(self, run: RunInfo, end: RoundEnd) -> None:
        if self.stop.is_set() and end.round < run.rounds:
            end.interrupted = True


def _worker_start(stop) -> None:
    """A worker process's first act: SIGINT is the parent's to handle; the stop event is kept,
    and set by the worker itself if its parent dies (killed: no one would read its results),
    so that its run stops after the round in progress with a checkpoint and the worker ends."""
    global _STOP
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _STOP = stop
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        stop.set()
        while _RUNNING.locked():  # the run stops after its round, checkpointed
            time.sleep(PARENT_CHECK_S)
        os._exit(0)  # nothing else ends a worker whose parent is gone: it waits for work

    threading.Thread(target=watch_parent, daemon=True, name="watch_parent").start()
    from absl import flags  # the run's absl logging, without its "before flag parsing" note
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _work(config: ml_collections.ConfigDict, run_dir: str) -> dict | None:
    """One run in a worker: its summary, or None when the study stopped before it started."""
    with _RUNNING:
        if _STOP.is_set():
            return None
        return run_in(config, run_dir, show_progress=False,
                      callbacks=[StopRequested(_STOP)])


def run_in(config: ml_collections.ConfigDict, run_dir: str, show_progress: bool,
           callbacks: Sequence[Callback] = ()) -> dict:
    """Runs `config` in `run_dir`, resuming its checkpoint; a folder whose checkpoint, or with
    none its summary.json, holds a run of another config (a tuned rate that moved when its
    grid was extended) is moved aside to `<run_dir>.replaced<k>` with a warning and the run
    starts anew.

    Args:
      config: the run's config.
      run_dir: its folder.
      show_progress: its progress bar.
      callbacks: `engine.callbacks` hooks (a worker's stop request, `run_pool`).

    Returns:
      The run's summary (summary.json's content).
    """
    os.makedirs(run_dir, exist_ok=True)
    try:
        return run_experiment(config, run_dir, show_progress=show_progress, callbacks=callbacks)
    except ConfigChangedError as e:
        k = 1
        while os.path.exists(f"{run_dir}.replaced{k}"):
            k += 1
        os.rename(run_dir, f"{run_dir}.replaced{k}")
        lines = str(e).splitlines()
        change = lines[1].strip() if len(lines) > 2 else lines[0]
        warnings.warn(f"{run_dir} held a run of another config ({change}); moved to "
                      f"{run_dir}.replaced{k}, running this config anew", stacklevel=2)
        os.makedirs(run_dir)
        return run_experiment(config, run_dir, show_progress=show_progress, callbacks=callbacks)


class Later:
    """An outcome computed when first read: a run of the in-process pool (a grid read in
    order runs in that order, and a table written after each seed sees each seed), or a
    finished run's summary read back."""

    def __init__(self, fn: Callable[[], dict]):
        self._fn, self._done, self._value = fn, False, None

    def result(self) -> dict:
        if not self._done:
            self._value, self._done = self._fn(), True
        return self._value


class RunPool:
    """Executes runs: `jobs=1` in this process when their outcome is read; more in as many
    spawned worker processes, in the order submitted. Use as a context manager; leaving it
    on an exception (Ctrl-C included) stops the workers' runs with a checkpoint each.

    Args:
      jobs: runs at a time (>= 1).
      show_progress: progress bars of in-process runs; with workers, one line per finished
        run instead.
    """

    def __init__(self, jobs: int = 1, show_progress: bool = True):
        if not isinstance(jobs, int) or jobs < 1:
            raise ConfigError(f"--jobs must be a whole number >= 1, got {jobs!r}")
        self.jobs, self.show_progress = jobs, show_progress
        self._futures: dict[tuple[str, str], Any] = {}
        self._executor = None
        self._stop = None
        # re-entrant: a future already done calls `_finished` from `submit` itself
        self._lock = threading.RLock()

    def __enter__(self) -> RunPool:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(stopping=exc_type is not None)
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt) \
                and self._executor is not None and not isinstance(exc, RunInterrupted):
            raise RunInterrupted(
                "the runs in progress stopped after their round in progress, each with a "
                "checkpoint of it: the same command resumes them") from None

    def submit(self, config: ml_collections.ConfigDict, run_dir: str):
        """Schedules `config` in `run_dir` (a run already submitted with the same config and
        folder is not scheduled twice). Returns a handle whose `result()` is the run's
        summary (it raises what the run raised)."""
        if self.jobs == 1:
            return Later(lambda: run_in(config, run_dir, self.show_progress))
        key = (run_dir, config.to_json(sort_keys=True))
        with self._lock:
            if key not in self._futures:
                future = self._workers().submit(_work, config, run_dir)
                future.add_done_callback(lambda f, d=run_dir: self._finished(f, d))
                self._futures[key] = future
            return _Outcome(self._futures[key], run_dir)

    def _workers(self):
        if self._executor is None:
            context = multiprocessing.get_context("spawn")
            self._stop = context.Event()
            self._executor = concurrent.futures.ProcessPoolExecutor(
                self.jobs, mp_context=context, initializer=_worker_start,
                initargs=(self._stop,))
        return self._executor

    def _finished(self, future, run_dir: str) -> None:
        if future.cancelled() or future.exception() is not None or future.result() is None:
            return
        with self._lock:  # (called from the pool's own thread while `submit` may add)
            waiting = sum(1 for f in self._futures.values() if not f.done())
        seconds = future.result().get("wall_time_s", float("nan"))
        print(f"finished {run_dir} ({seconds:.0f} s; {waiting} run(s) running or waiting)",
              file=sys.stderr, flush=True)

    def close(self, stopping: bool = False) -> None:
        """Waits for the workers (after asking their runs to stop when `stopping`: the runs
        not started are cancelled, the running ones stop after their round with a
        checkpoint) and ends them."""
        if self._executor is None:
            return
        if stopping:
            self._stop.set()
        try:
            self._executor.shutdown(wait=True, cancel_futures=stopping)
        except KeyboardInterrupt:  # a second Ctrl-C while the runs checkpoint: leave now
            pass


class _Outcome:
    """A worker's run as `run_grid` reads it."""

    def __init__(self, future, run_dir: str):
        self.future, self.run_dir = future, run_dir

    def result(self) -> dict:
        try:
            summary = self.future.result()
        except BrokenProcessPool:
            raise ConfigError(f"the worker process running {self.run_dir} ended abruptly (out "
                              "of memory? fewer --jobs use less); the same command resumes "
                              "from the runs' checkpoints") from None
        if summary is None:
            raise RunInterrupted(f"the study stopped before {self.run_dir} started")
        return summary
