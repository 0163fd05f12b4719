"""Callbacks: what the host loop does around a round, as objects in one ordered list.

After each round the host loop (`engine.loop`) hands a `RoundEnd` (the new state, the record
being built for metrics.jsonl, the clients' and rejections' rows) to every callback in turn;
each may add to the record, replace the state or ask the loop to stop. The loop's own work is
built the same way, in this order:

  Evaluation      decides whether the round is evaluated (every `eval.every` rounds, the last
                  round, a round whose losses went non-finite) and adds the evaluation (the
                  global test set's at every `eval.global_every`-th)
  DivergenceCheck marks a non-finite record `diverged` and stops the run
  PlateauStop     with `train.stop_at_plateau`: stops the run where its accuracy stopped moving
  <your callbacks, in the order given to `fedjax_pfedes.run(..., callbacks=[...])`>
  GlobalAtEnd     scores the global test set at the round that ends the run, where
                  `eval.global_every` skipped it
  MetricsWriter   times the round, writes metrics.jsonl / clients.jsonl / rejections.jsonl /
                  TensorBoard, keeps evaluated records in `SimState.history`
  ProgressBar     the tqdm bar with the latest accuracies
  Checkpointing   saves the state every `checkpoint.every` rounds and at the end

so a user callback sees the round's evaluation, and what it adds to `end.record` is written
with the round. The pattern follows pfl-research's training-process callbacks.

Example, early stopping on personalized accuracy:

  class StopAt(fedjax_pfedes.Callback):
      def on_round_end(self, run, end):
          if end.evaluated and end.record["personalized_accuracy_mean"] >= 0.9:
              end.stop, end.stop_reason = True, "reached 0.9"
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Any

import ml_collections
from absl import logging
from tqdm.auto import tqdm

from fedjax_pfedes.engine.context import RunContext
from fedjax_pfedes.engine.evaluation import dp_sgd_metrics, evaluate, non_finite_metrics
from fedjax_pfedes.engine.state import SimState
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.execution import distributed, offload
from fedjax_pfedes.io import checkpoints, metrics


@dataclasses.dataclass
class RunInfo:
    """The run the callbacks belong to.

    Attributes:
      config: the run's config (read it, do not change it).
      ctx: the run's context: cohorts with their runners, the algorithm, the upload pipeline.
        `on_run_start` may change it (e.g. route a cohort through another runner).
      out_dir: where this process writes its outputs (the workdir on process 0).
      first_round: rounds already done when this run started (> 0 after a resume).
      rounds: `config.train.rounds`.
      start_s: `time.time()` when the run started; a resumed run's is moved back by
        `resumed_wall_s`, so that its records' `elapsed_s` and its `wall_time_s` count the
        earlier processes too.
      resumed_wall_s: the wall time earlier processes spent on the rounds a resumed run keeps
        (`io.metrics.process_wall_times` of its metrics.jsonl); 0 for a fresh run.
    """

    config: ml_collections.ConfigDict
    ctx: RunContext
    out_dir: str
    first_round: int
    rounds: int
    start_s: float
    resumed_wall_s: float = 0.0


@dataclasses.dataclass
class RoundEnd:
    """One finished round, passed through the callbacks in order.

    Attributes:
      round: the round just run, counted from 1.
      state: the state after it; a callback may replace it (the next round starts from it).
      record: the round's metrics.jsonl record, written after the callbacks before
        `MetricsWriter` have added to it.
      client_rows: the participants' clients.jsonl rows.
      rejections: the rejected uploads' rejections.jsonl rows.
      started_s: `time.time()` when the round started.
      evaluated: whether the record holds an evaluation (set by `Evaluation`).
      stop: set True to end the run after this round (its record is still written; its state
        is saved only when a checkpoint is due anyway, so a diverged state is never saved
        unless it falls on the schedule).
      stop_reason: why, for summary.json (`stopped_early`).
      interrupted: the user pressed Ctrl-C during the round (`engine.ctrl_c`): the run stops
        after it, its state saved as a checkpoint, without a summary (it is not finished).
    """

    round: int
    state: SimState
    record: dict[str, Any]
    client_rows: list[dict[str, Any]]
    rejections: list[dict[str, Any]]
    started_s: float
    evaluated: bool = False
    stop: bool = False
    stop_reason: str = ""
    interrupted: bool = False


class Callback:
    """A hook into the host loop; override the methods you need (each does nothing here)."""

    def on_run_start(self, run: RunInfo) -> None:
        """Before the first round this process runs (after a checkpoint is restored)."""

    def on_round_end(self, run: RunInfo, end: RoundEnd) -> None:
        """After every round, in the order of the callback list."""

    def on_run_end(self, run: RunInfo, summary: dict[str, Any]) -> None:
        """After the last round, before summary.json is written; may add entries to
        `summary`. Not called when a round raised."""

    def close(self) -> None:
        """Releases what the callback holds (files, bars); called once at the end of the run,
        also when a round raised."""


class Evaluation(Callback):
    """Evaluates every `eval.every` rounds, at the last round and in a round that diverged
    (personalized accuracy, per-architecture means, the DP-SGD accountant), with the global
    test set at every `eval.global_every`-th of those rounds (each, by default);
    `GlobalAtEnd` scores it at the evaluation that ends the run."""

    def __init__(self, global_test, eval_sample, batch_rate: dict[int, float]):
        self.global_test, self.eval_sample, self.batch_rate = global_test, eval_sample, batch_rate
        self.seconds = 0.0  # spent evaluating in this process

    def on_round_end(self, run: RunInfo, end: RoundEnd) -> None:
        r = end.round
        end.evaluated = (r % run.config.eval.every == 0 or r == run.rounds
                         or bool(non_finite_metrics(end.record)))
        if end.evaluated:
            k = run.config.eval.global_every
            self.score(run, end, k == 1 or (k > 0 and r % (run.config.eval.every * k) == 0))

    def score(self, run: RunInfo, end: RoundEnd, with_global: bool) -> None:
        """Adds the round's evaluation to `end.record` (the global test set's scores when
        `with_global`)."""
        start = time.time()
        steps = {i: int(s) for i, s in enumerate(end.state.dp_sgd_steps) if s > 0}
        d = run.config.dp_sgd
        end.record.update(dp_sgd_metrics(d.noise_multiplier if d.enabled else None, d.delta,
                                         steps, self.batch_rate,
                                         run.ctx.algorithm.dp_sgd_releases_per_step))
        end.record.update(evaluate(run.ctx.algorithm, end.state.server, run.ctx.cohorts,
                                   end.state.clients,
                                   *(self.global_test if with_global else (None, None)),
                                   self.eval_sample))
        self.seconds += time.time() - start

    def on_run_end(self, run: RunInfo, summary: dict[str, Any]) -> None:
        summary["evaluation_time_s"] = self.seconds


class GlobalAtEnd(Callback):
    """With `eval.global_every` other than 1: the round that ends the run (the last, or one
    that a callback stopped) is evaluated with the global test set, evaluated at all if it was
    not, so summary.json's final record always holds it. Placed after the callbacks that may
    stop the run."""

    def __init__(self, evaluation: Evaluation):
        self.evaluation = evaluation

    def on_round_end(self, run: RunInfo, end: RoundEnd) -> None:
        ends = end.stop or end.round == run.rounds
        if (run.config.eval.global_every == 1 or not ends
                or "global_accuracy_mean" in end.record):
            return
        end.evaluated = True
        self.evaluation.score(run, end, with_global=True)


def some(names: list[str], shown: int = 3) -> str:
    """'a, b, c and 4 more'."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


class DivergenceCheck(Callback):
    """Stops the run in the round where a metric went non-finite; `diverged` then says where
    and which metrics."""

    def __init__(self):
        self.diverged: dict[str, Any] | None = None

    def on_round_end(self, run: RunInfo, end: RoundEnd) -> None:
        bad = non_finite_metrics(end.record)
        if not bad:
            return
        end.record["diverged"] = True
        self.diverged = {"round": end.round, "metrics": bad}
        end.stop = True
        logging.warning("round %d: training diverged (%s non-finite); stopping. %s; "
                        "config.train.allow_divergence=True keeps the exit status 0",
                        end.round, some(bad), divergence_cause(run.config, run.ctx.upload))


def divergence_cause(config: ml_collections.ConfigDict, upload) -> str:
    """What most likely made a run diverge, first: a simulated attack when one is configured,
    then client-level DP's noise (`upload`: the run's `UploadPlan`), else the learning rate."""
    cause = upload.noise_note or "Lower the learning rate or lambda"
    attack = config.attack
    if attack.kind != "none" and attack.clients.strip():
        cause = (f"The simulated attack is the likeliest cause: config.attack.kind="
                 f"'{attack.kind}' (value {attack.value:g}) from clients "
                 f"{attack.clients.strip()} reached the aggregate"
                 + (" (secure aggregation hides individual uploads from the norm rule)"
                    if upload.hides_uploads else "")
                 + f"; to run without it set --config.attack.kind=none. Otherwise: {cause}")
    return cause


class MetricsWriter(Callback):
    """Times the round, writes its rows (`io.metrics.RunWriters`) and keeps evaluated records
    in `SimState.history`."""

    def __init__(self, writers: metrics.RunWriters):
        self.writers = writers

    def on_round_end(self, run: RunInfo, end: RoundEnd) -> None:
        now = time.time()
        end.record.update(round_time_s=now - end.started_s, elapsed_s=now - run.start_s)
        self.writers.write_round(end.record, end.client_rows, end.rejections)
        if end.evaluated:
            end.state = end.state.replace(history=(*end.state.history, end.record))
            self.writers.flush()

    def close(self) -> None:
        self.writers.close()


class ProgressBar(Callback):
    """A tqdm bar over rounds showing the latest personalized and global accuracy."""

    def __init__(self, show: bool):
        self.show, self.bar = show, None

    def on_run_start(self, run: RunInfo) -> None:
        chosen = sorted({c.runner.name for c in run.ctx.cohorts})
        self.bar = tqdm(desc=f"{run.config.algorithm} [{'+'.join(chosen)}]",
                        disable=not self.show, unit="round", initial=run.first_round,
                        total=run.rounds)

    def on_round_end(self, run: RunInfo, end: RoundEnd) -> None:
        self.bar.update(1)
        if end.evaluated:
            shown = {"pacc": end.record["personalized_accuracy_mean"],
                     "gacc": end.record.get("global_accuracy_mean")}
            self.bar.set_postfix({k: f"{v:.3f}" for k, v in shown.items() if v is not None})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Checkpointing(Callback):
    """A run's checkpoints: the one it resumes from, and the ones it saves.

    `open` finds the checkpoint to resume from (and refuses one written under another config
    before any data is loaded), `check_data` refuses it when the data changed, `restore` puts
    its state into the freshly built one; then, as a callback, it saves the state every
    `checkpoint.every` rounds and at the last round: process 0 writes, every process takes the
    snapshot (gathering client states split over processes is a collective)."""

    def __init__(self, checkpointer: checkpoints.Checkpointer | None, writer: bool,
                 fingerprint: str = "", meta: dict | None = None):
        self.checkpointer, self.writer, self.fingerprint = checkpointer, writer, fingerprint
        self.meta = meta  # the checkpoint resumed from (None: a fresh start)

    @classmethod
    def open(cls, config: ml_collections.ConfigDict, workdir: str, writer: bool,
             defaults: dict) -> Checkpointing:
        """The run's checkpoints in `workdir`, with the one to resume from if there is one.

        Args:
          config: the run's config (`checkpoint.every`, `resume`, `max_to_keep`; the saved
            config must match it).
          workdir: the run's folder (checkpoints in `<workdir>/checkpoints`).
          writer: this process writes (process 0); the others read the step process 0 chose.
          defaults: the default config's values (fields added since a checkpoint was written
            take them).

        Returns:
          The callback; ConfigError naming the field when the checkpoint cannot be resumed.
        """
        ck = config.checkpoint
        if ck.every <= 0:
            if writer and ck.resume:
                checkpoints.check_finished_run(workdir, config.to_dict(), defaults)
            return cls(None, writer)
        checkpointer, meta = None, None
        if writer:
            ckpt_dir = os.path.join(workdir, "checkpoints")
            if not ck.resume and os.path.isdir(ckpt_dir):
                shutil.rmtree(ckpt_dir)  # start this workdir over
            checkpointer = checkpoints.Checkpointer(workdir, ck.max_to_keep)
            meta = checkpointer.check_config(config.to_dict(), defaults)
            if meta is None and ck.resume:
                checkpoints.check_finished_run(workdir, config.to_dict(), defaults)
        # Over several processes: process 0 chose the round; the others read that checkpoint.
        chosen = distributed.from_process_0(
            checkpointer.step if writer and meta is not None else -1)
        if not writer and chosen >= 0:
            checkpointer = checkpoints.Checkpointer(workdir, ck.max_to_keep, read_only=True)
            meta = checkpointer.use_step(chosen, config.to_dict(), defaults)
        if meta is not None and checkpointer.step > config.train.rounds:
            raise ConfigError(
                f"config.train.rounds={config.train.rounds} is below the round of the "
                f"checkpoint in {checkpointer.directory} ({checkpointer.step}); raise it, or "
                "start over with --config.checkpoint.resume=False")
        return cls(checkpointer, writer, meta=meta)

    def check_data(self, fingerprint: str) -> None:
        """Records the data's fingerprint; ConfigError when the checkpoint was written on other
        data under the same config."""
        self.fingerprint = fingerprint
        if self.meta is not None and self.meta.get("data_fingerprint", fingerprint) != fingerprint:
            raise ConfigError(
                f"cannot resume from {self.checkpointer.directory}/{self.checkpointer.step}: "
                "the data contents changed since it was written (fingerprint "
                f"{self.meta['data_fingerprint'][:12]} then, {fingerprint[:12]} now) although "
                "the config did not; use another --workdir, or --config.checkpoint.resume=False "
                "to start over")

    def strategies(self) -> dict | None:
        """The execution strategy of each cohort in the checkpoint (a resumed run keeps them)."""
        return None if self.meta is None else self.meta.get("execution_strategy_by_arch")

    def restore(self, state: SimState, offloaded: bool) -> tuple[int, SimState]:
        """The round to start from and the state to start with.

        Args:
          state: the freshly built state (its shapes receive the checkpoint's values).
          offloaded: the clients' states live in host memory or on disk
            (`config.execution.client_states='offload'`).

        Returns:
          (0, `state`) on a fresh start, else the checkpoint's round and its state.
        """
        if self.meta is None:
            return 0, state
        first_round, restored = self.checkpointer.restore(
            distributed.process_local(state.to_checkpoint()))
        if offloaded:  # back into the host / disk store
            restored["clients"] = {a: offload.refill(state.clients[a], r)
                                   for a, r in restored["clients"].items()}
        state = state.from_checkpoint(
            restored, self.meta["history"],
            list(self.meta.get("dp_round_noise_multipliers", []))[:first_round])
        logging.info("resumed from %s at round %d", self.checkpointer.directory, first_round)
        return first_round, state

    def on_round_end(self, run: RunInfo, end: RoundEnd) -> None:
        if not (checkpoints.due(run.config.checkpoint.every, end.round, run.rounds)
                or (end.interrupted and not end.stop and run.config.checkpoint.every > 0)):
            return
        snapshot = distributed.process_local(end.state.to_checkpoint())
        if self.writer:
            self.checkpointer.save(end.round, snapshot, {
                "history": list(end.state.history), "config": run.config.to_dict(),
                "dp_round_noise_multipliers": list(end.state.dp_noise_multipliers),
                "execution_strategy_by_arch": {c.arch: c.runner.name for c in run.ctx.cohorts},
                "data_fingerprint": self.fingerprint})

    def close(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()

