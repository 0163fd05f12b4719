"""The host loop: the only place with Python loops over rounds.

It owns RNG splitting, client sampling, per-cohort execution, the server step, evaluation,
metrics and the progress bar. Everything it calls per round is jitted with fixed shapes, so
nothing compiles again after the first round.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from fedjax_pfedes.algorithms import registry as algorithm_registry
from fedjax_pfedes.engine import asynchronous, rounds, schema, sections
from fedjax_pfedes.engine.build import build_context, build_federated_data, write_data_profile
from fedjax_pfedes.engine.callbacks import (
    Callback,
    Checkpointing,
    DivergenceCheck,
    Evaluation,
    GlobalAtEnd,
    MetricsWriter,
    ProgressBar,
    RoundEnd,
    RunInfo,
    divergence_cause,
    some,
)
from fedjax_pfedes.engine.ctrl_c import CtrlC
from fedjax_pfedes.engine.evaluation import (
    dp_sgd_statement,
    evaluation_sample,
    global_test_set,
    majority_class_accuracy,
)
from fedjax_pfedes.engine.plateau import PlateauStop
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import (
    ConfigError,
    DivergedError,
    NothingTrainedError,
    RunInterrupted,
    StorageError,
)
from fedjax_pfedes.execution import choice, compilation, distributed, offload
from fedjax_pfedes.io import metrics, storage
from fedjax_pfedes.io.workdir import WorkdirLock, data_fingerprint
from fedjax_pfedes.tree_util import tree_size


def local_optimizer_note(config) -> dict:
    """The clients' local optimizer and what happens to its state between rounds."""
    opt = sections.local_optimizer(config)
    if not algorithm_registry.get(config.algorithm).private_optimizer:
        state = "fresh every round (the local model restarts from the broadcast)"
    elif opt["reset_local_optimizer"]:
        state = "reset every round"
    else:
        state = "kept across rounds"
    return {"lr_local": opt["lr_local"], "local_momentum": opt["local_momentum"],
            "batch_size": opt["batch_size"], "state": state}


def run_experiment(config: ml_collections.ConfigDict, workdir: str,
                   show_progress: bool = True, callbacks: Sequence[Callback] = ()
                   ) -> dict[str, Any]:
    """Runs (or resumes) a full experiment; see `_run`. Holds `<workdir>/.lock` meanwhile, so
    two runs never write the same workdir. `callbacks` run after the evaluation of every
    round (`engine.callbacks`; `sweep` routes the cohorts' updates through its batched program
    with one).

    Over several processes (`config.distributed`) every process calls this with the same config;
    process 0 writes `workdir`, the others a temporary folder removed at the end."""
    try:
        # before anything touches a JAX backend
        distributed.initialize(distributed.settings(config.get("distributed")))
    except RuntimeError as e:  # the coordinator did not answer, or a process is missing
        raise ConfigError(f"config.distributed: could not join the run's processes "
                          f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    validate_config(config)
    if not distributed.is_writer():
        scratch = tempfile.mkdtemp(prefix=f"fedjax_pfedes_process{jax.process_index()}_")
        try:
            return _run(config, workdir, False, callbacks, out_dir=scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir={workdir} is a file, not a directory")
    storage.check_path(workdir)
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--workdir={workdir} cannot be created ({e.strerror})") from None
    lock = WorkdirLock(workdir)
    lock.acquire()
    try:
        return _run(config, workdir, show_progress, callbacks)
    except KeyboardInterrupt:
        raise RunInterrupted(_where_to_resume(config, workdir)) from None
    except OSError as e:
        if not storage.is_storage_fault(e):
            raise
        kept = (f"; the checkpoints in {workdir}/checkpoints are kept: free space and run the "
                "same command to resume" if config.checkpoint.every > 0 else "")
        raise StorageError(f"writing {storage.file_of(e) or workdir} failed: "
                           f"{storage.cause(e)}{kept}") from None
    finally:
        lock.release()


def _where_to_resume(config: ml_collections.ConfigDict, workdir: str) -> str:
    """What an interrupted run left: its last checkpoint, which the same command resumes."""
    folder = os.path.join(workdir, "checkpoints")
    steps = sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(
        folder) else []
    if config.checkpoint.every > 0 and config.checkpoint.resume and steps:
        return (f"the run in {workdir} stopped; its last checkpoint is round {steps[-1]}: the "
                "same command resumes from it")
    return (f"the run in {workdir} stopped with no checkpoint to resume from "
            f"(config.checkpoint.every={config.checkpoint.every}, resume="
            f"{config.checkpoint.resume}): the same command starts it over")


def _run(config: ml_collections.ConfigDict, workdir: str, show_progress: bool,
         callbacks: Sequence[Callback] = (), out_dir: str | None = None) -> dict[str, Any]:
    """Runs (or resumes) a full experiment; writes metrics.jsonl / .csv, clients.jsonl,
    rejections.jsonl, TensorBoard events, checkpoints and summary.json into `workdir`.
    `out_dir`: where this process writes instead (the other processes of a multi-process run:
    they write nothing into `workdir` and only read process 0's checkpoints there).

    Returns:
      The summary dict (final evaluation, best personalized accuracy, timings, participation
      counts, config).

    Raises:
      DivergedError: a loss went non-finite and `config.train.allow_divergence` is False
        (training stops at that round; summary.json says `diverged: true`).
    """
    start = time.time()
    compilation.configure_cache(config.execution.compilation_cache_dir)
    writer = out_dir is None
    out_dir = workdir if out_dir is None else out_dir
    # the checkpoint to resume from, refused before any data is loaded if it cannot be
    saving = Checkpointing.open(config, workdir, writer, schema.default_values())
    data = build_federated_data(config)
    fingerprint = data_fingerprint(data)
    saving.check_data(fingerprint)
    write_data_profile(data, config.data.partition, out_dir)
    ctx, state = build_context(config, data, saving.strategies(), out_dir)
    if writer:
        storage.check_space(workdir, tree_size(state.to_checkpoint())[1],
                            config.checkpoint.every > 0)
    first_round, state = saving.restore(state, config.execution.client_states == "offload")
    writers = metrics.RunWriters(out_dir, first_round, config.monitor.tensorboard,
                                 config.monitor.client_report)
    resumed_s = sum(metrics.process_wall_times(metrics.read_jsonl(writers.metrics.path)))
    divergence = DivergenceCheck()
    evaluation = Evaluation(global_test_set(data, config.eval.global_test_samples, config.seed),
                            evaluation_sample(config.eval.clients, config.seed, ctx.num_clients),
                            _batch_rates(config, ctx))
    chain = [evaluation, divergence, *plateau_stop(config.train), *callbacks,
             GlobalAtEnd(evaluation), MetricsWriter(writers), ProgressBar(show_progress), saving]
    run = RunInfo(config, ctx, out_dir, first_round, config.train.rounds,
                  start - resumed_s, resumed_s)
    rejected_before = sum(1 for _ in metrics.read_jsonl(writers.rejections.path))
    try:
        for cb in chain:
            cb.on_run_start(run)
        with CtrlC() as ctrl_c:
            state, last, stopped = _train(run, state, chain, rejected_before, ctrl_c)
        summary = _summary(run, state, last, data, fingerprint, divergence.diverged,
                           stopped, workdir)
        for cb in chain:
            cb.on_run_end(run, summary)
    finally:
        for cb in chain:
            cb.close()
        offload.close_files(state.clients)
    metrics.write_json(f"{out_dir}/summary.json", summary)
    _refuse_unusable_end(config, ctx, state, divergence.diverged, workdir)
    return summary


def _batch_rates(config: ml_collections.ConfigDict, ctx) -> dict[int, float]:
    """Each client's batch sampling rate (its batch over its samples; DP-SGD's accountant)."""
    batch_size = sections.local_optimizer(config)["batch_size"]
    return {int(cid): min(1.0, min(batch_size, c.train.capacity) / max(n, 1))
            for c in ctx.cohorts
            for cid, n in zip(c.client_ids, np.asarray(c.train.sizes), strict=True)}


def _train(run: RunInfo, state, chain: Sequence[Callback], rejected_total: int,
           ctrl_c: CtrlC):
    """The rounds from `run.first_round`, each ended through the callbacks; after a round
    during which Ctrl-C was pressed (`ctrl_c.requested`), the callbacks save it as a
    checkpoint and `RunInterrupted` ends the run.

    Returns:
      (the last state, the last evaluated round's record, the `RoundEnd` that stopped the run
      early or None).
    """
    config, ctx = run.config, run.ctx
    round_fn = asynchronous.async_round if config.asynchronous.enabled else rounds.sync_round
    last = state.history[-1] if state.history else {}
    for r in range(run.first_round, run.rounds):
        t0 = time.time()
        state, record, rows, rejections = round_fn(ctx, state, r)
        jax.block_until_ready(state.server)
        rejected_total += record["uploads_rejected"]
        record = {"round": r + 1, **record, "uploads_rejected_total": rejected_total,
                  "simulated_clock_s": state.clock_s,
                  "participation_min": int(state.sampler.selected.min()),
                  "participation_max": int(state.sampler.selected.max()),
                  **ctx.upload.privacy_metrics(state.dp_noise_multipliers)}
        end = RoundEnd(r + 1, state, record, rows, rejections, t0,
                       interrupted=ctrl_c.requested and r + 1 < run.rounds)
        for cb in chain:
            cb.on_round_end(run, end)
        state = end.state
        if end.evaluated:
            last = end.record
        if end.stop:
            return state, last, end
        if end.interrupted:
            raise RunInterrupted()  # run_experiment names the checkpoint to resume from
    return state, last, None


def _refuse_unusable_end(config: ml_collections.ConfigDict, ctx, state, diverged,
                         workdir: str) -> None:
    """DivergedError / NothingTrainedError for a run whose figures cannot be used as they are
    (unless the config accepts it); its summary.json is written already."""
    if diverged is not None and not config.train.allow_divergence:
        cause = divergence_cause(config, ctx.upload)
        raise DivergedError(
            f"training diverged in round {diverged['round']} ({some(diverged['metrics'])} "
            f"non-finite); summary in {workdir}/summary.json. {cause}, "
            "or set --config.train.allow_divergence=True to accept it")
    if not int(state.sampler.completed.sum()) and not config.train.get("allow_untrained",
                                                                        False):
        raise NothingTrainedError(
            f"no participant's update reached the server in any of the {config.train.rounds} "
            "rounds (config.system availability, dropout or deadline_s leave no client able to "
            "train): "
            f"every figure in {workdir}/summary.json describes the initial models; set "
            "--config.train.allow_untrained=True to accept that")


def plateau_stop(train: ml_collections.ConfigDict) -> list[Callback]:
    """[PlateauStop] when `config.train.stop_at_plateau`, else []."""
    if not train.stop_at_plateau:
        return []
    return [PlateauStop(train.plateau_window, train.plateau_tolerance,
                        train.plateau_min_evaluations)]


def _summary(run: RunInfo, state, last: dict, data, fingerprint: str,
             diverged: dict | None, stopped: RoundEnd | None, workdir: str) -> dict[str, Any]:
    """summary.json: the final evaluation, the best round, privacy, participation, timings."""
    config, ctx = run.config, run.ctx
    history = state.history
    if not history:
        raise ConfigError(f"nothing to run: the checkpoint in {workdir} is at round "
                          f"{run.first_round} and config.train.rounds is {run.rounds}")
    finite = [h for h in history if not h.get("diverged")] or history
    best = max(finite, key=lambda h: h["personalized_accuracy_mean"])
    by_arch = {c.arch: c.runner.name for c in ctx.cohorts}
    chosen = sorted(set(by_arch.values()))
    early = stopped is not None and diverged is None
    return {
        "final": last,
        "diverged": diverged is not None,
        **({"diverged_at": diverged} if diverged is not None else {}),
        **({"stopped_early": {"round": stopped.round, "reason": stopped.stop_reason}}
           if early else {}),
        **({"stopped_at_plateau": early and bool(stopped.record.get("stopped_at_plateau")),
            "hit_max_rounds": not early and diverged is None}
           if config.train.stop_at_plateau else {}),
        "data_fingerprint": fingerprint,
        "majority_class_accuracy_mean": majority_class_accuracy(data),
        "best_personalized_accuracy": best["personalized_accuracy_mean"],
        "best_round": best["round"],
        **ctx.upload.statement,
        **dp_sgd_statement(bool(config.dp_sgd.enabled)),
        "norm_outlier_rejection": ctx.upload.outlier_note,
        "local_optimizer": local_optimizer_note(config),
        "execution_strategy": "+".join(chosen),
        "execution_strategy_by_arch": by_arch,
        **({"strategy_choice": ctx.strategy_choices} if ctx.strategy_choices else {}),
        "platform": jax.default_backend(),
        "machine": choice.machine(),
        "clients_per_arch": {c.arch: len(c.client_ids) for c in ctx.cohorts},
        "participation": {"selected": state.sampler.selected.tolist(),
                          "completed": state.sampler.completed.tolist()},
        "simulated_time_s": state.clock_s,
        "resumed_from_round": run.first_round,
        "clients_trained": int((state.sampler.completed > 0).sum()),
        "wall_time_s": time.time() - run.start_s,  # with a resumed run's earlier processes
        "resumed_wall_time_s": run.resumed_wall_s,
        "config": config.to_dict(),
    }
