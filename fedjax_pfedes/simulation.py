"""The host loop: the only place with Python loops over rounds.

It owns RNG splitting, client sampling, per-cohort execution, the server step, evaluation,
metrics and the progress bar. Everything it calls per round is jitted with fixed shapes, so
nothing compiles again after the first round.
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import shutil
import socket
import time
from typing import Any

import dp_accounting
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from tqdm.auto import tqdm

from fedjax_pfedes import (
    asynchronous,
    attacks,
    checkpointing,
    compilation,
    execution,
    metrics_io,
    plotting,
    rounds,
    sampling,
    strategy_choice,
    system,
)
from fedjax_pfedes.algorithms import registry as algorithm_registry
from fedjax_pfedes.cohorts import Cohort, assign_architectures, build_cohorts
from fedjax_pfedes.config_validation import ConfigError, check_against_data, validate_config
from fedjax_pfedes.data.catalog import load_dataset
from fedjax_pfedes.data.federated import FederatedData, partition_dataset
from fedjax_pfedes.data.profile import DataProfile, profile_partition
from fedjax_pfedes.data.sources import LoadOptions
from fedjax_pfedes.metrics_io import write_json
from fedjax_pfedes.rounds import tree_size
from fedjax_pfedes.sim_state import SimState
from fedjax_pfedes.upload import compression, privacy
from fedjax_pfedes.upload.pipeline import UploadPipeline, pipeline_config


def load_options(config: ml_collections.ConfigDict) -> LoadOptions:
    """The `config.data` fields that loaders read."""
    d = config.data
    return LoadOptions(seed=config.seed, global_test_fraction=d.global_test_fraction,
                       data_dir=d.data_dir, path=d.path, max_train_samples=d.max_train_samples,
                       text_max_length=d.text_max_length, text_vocab_size=d.text_vocab_size)


def build_federated_data(config: ml_collections.ConfigDict) -> FederatedData:
    """Loads the configured dataset and partitions it over clients."""
    d = config.data
    central = load_dataset(d.name, load_options(config))
    check_against_data(config, central)
    try:
        return partition_dataset(
            central, d.num_clients, d.partition, config.seed,
            local_test_fraction=d.local_test_fraction, dirichlet_alpha=d.dirichlet_alpha,
            min_samples_per_client=d.min_samples_per_client,
            classes_per_client=d.classes_per_client, class_share_low=d.class_share_low,
            class_share_high=d.class_share_high, quantity_sigma=d.quantity_sigma)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def write_data_profile(data: FederatedData, partition: str, workdir: str) -> DataProfile:
    """Writes data_profile.json, label_heatmap.png and client_sizes.png into `workdir`."""
    profile = profile_partition(data, partition)
    write_json(os.path.join(workdir, "data_profile.json"), profile.summary())
    plotting.label_heatmap(profile, os.path.join(workdir, "label_heatmap.png"))
    plotting.size_histogram(profile, os.path.join(workdir, "client_sizes.png"))
    return profile


def build_algorithm(config: ml_collections.ConfigDict, data: FederatedData):
    """The configured algorithm (`config.algorithm`, from the algorithm registry) for the
    dataset's shapes and statistics."""
    c = data.central
    # Static local epochs: the most any client runs (fewer are masked by ClientArrays.step_limit).
    epochs = int(client_epochs(config, np.array([len(i) for i in data.train_indices])).max())
    archs = assign_architectures(config.clients.architectures, data.num_clients)
    return algorithm_registry.build(config, c.num_classes, c.input_spec, epochs,
                                    collections.Counter(archs))


def _global_test(data: FederatedData, config: ml_collections.ConfigDict):
    c = data.central
    n = config.eval.global_test_samples or len(c.y_test)
    idx = np.random.default_rng(config.seed).permutation(len(c.y_test))[:n]
    return jnp.asarray(c.x_test[np.sort(idx)]), jnp.asarray(c.y_test[np.sort(idx)])


def majority_class_accuracy(data: FederatedData) -> float:
    """Mean over clients of predicting each client's most frequent local-train label on its local
    test split: the label-only reference a personalized model has to beat."""
    y = data.central.y_train
    scores = [np.mean(y[te] == np.bincount(y[tr]).argmax()) if len(te) else 0.0
              for tr, te in zip(data.train_indices, data.test_indices, strict=True)]
    return float(np.mean(scores))


def evaluate(algorithm, server_state, cohorts: list[Cohort], clients: dict[str, Any], global_x,
             global_y) -> dict[str, Any]:
    """Every client's model (private states `clients`) on its own local test split and on the
    global test set."""
    per_client: dict[str, list[np.ndarray]] = {}
    per_cohort = {}
    for cohort in cohorts:
        broadcast = algorithm.broadcast(server_state, cohort.arch)
        m = jax.device_get(cohort.runner.evaluate(broadcast, clients[cohort.arch], cohort.test,
                                                  global_x, global_y))
        for k, v in m.items():
            per_client.setdefault(k, []).append(np.asarray(v))
        per_cohort[cohort.arch] = float(np.mean(m["personalized_accuracy"]))
    acc = np.concatenate(per_client["personalized_accuracy"])
    means = {f"{k}_mean": float(np.concatenate(v).mean()) for k, v in per_client.items()}
    return {
        **means,
        "personalized_accuracy_std": float(acc.std()),
        "personalized_accuracy_min": float(acc.min()),
        "personalized_accuracy_max": float(acc.max()),
        "personalized_accuracy_by_arch": per_cohort,
    }


def build_pipeline(config: ml_collections.ConfigDict, algorithm, num_clients: int
                   ) -> UploadPipeline:
    """The upload pipeline from `config.upload`, `config.dp` and `config.secagg`."""
    t = config.train
    m = sampling.participants_per_round(num_clients, t.client_fraction)
    expected = t.client_fraction * num_clients if t.sampling == "poisson" else m
    try:
        return UploadPipeline(pipeline_config(config), algorithm.aggregation, algorithm.name,
                              num_clients, expected, m, t.rounds)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def privacy_metrics(pipeline: UploadPipeline, rounds_done: int) -> dict[str, float]:
    """dp_epsilon (at dp_delta) spent after `rounds_done` rounds, from dp_accounting composed
    over the noise each round really released."""
    dp = pipeline.cfg.dp
    if dp is None:
        return {}
    realized = pipeline.round_noise_multipliers[:rounds_done]
    eps = privacy.epsilon_of_rounds(dp, realized, pipeline.num_clients,
                                    pipeline.clients_per_round)
    return {"dp_epsilon": eps, "dp_delta": dp.delta,
            "dp_noise_multiplier": pipeline.noise_multiplier, "dp_clip_norm": dp.clip_norm}


def dp_sgd_metrics(config: ml_collections.ConfigDict, steps_taken: dict[int, int],
                   batch_rate: dict[int, float], releases_per_step: int = 1
                   ) -> dict[str, float]:
    """Per-client epsilon of sample-level DP-SGD so far (max and mean over clients that have
    trained), RDP accounting. Each local step is accounted as a Poisson-sampled batch with
    q = B / n_k (the usual approximation for shuffled batches, as in Opacus / TF Privacy) on which
    `releases_per_step` Gaussian mechanisms act (pFedES releases the private model's and
    E_proxy's noisy gradients of the same batch: composed inside the sampled event, which equals
    one Gaussian of noise multiplier sigma / sqrt(2) and is larger than composing two
    independently sampled steps)."""
    if not config.dp_sgd.enabled or not steps_taken:
        return {}
    d = config.dp_sgd
    eps = []
    for cid, steps in steps_taken.items():
        if d.noise_multiplier == 0:
            eps.append(float("inf"))
            continue
        accountant = privacy.make_accountant("rdp", "poisson")
        release = dp_accounting.ComposedDpEvent(
            [dp_accounting.GaussianDpEvent(d.noise_multiplier)] * releases_per_step)
        accountant.compose(dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(batch_rate[cid], release), steps))
        eps.append(float(accountant.get_epsilon(d.delta)))
    return {"dp_sgd_epsilon_max": max(eps), "dp_sgd_epsilon_mean": float(np.mean(eps)),
            "dp_sgd_delta": d.delta, "dp_sgd_noise_multiplier": d.noise_multiplier,
            "dp_sgd_releases_per_step": releases_per_step}



def client_epochs(config: ml_collections.ConfigDict, sizes: np.ndarray) -> np.ndarray:
    """[N] local epochs of every client (`config.train` adaptive epochs, minimum-samples rule)."""
    t = config.train
    return sampling.local_epochs_per_client(sizes, t.local_epochs, t.adaptive_epochs,
                                            t.min_epochs, t.max_epochs, t.min_samples,
                                            t.below_min)


def uses_step_limits(config: ml_collections.ConfigDict) -> bool:
    """Whether clients run different step counts than `train.local_epochs` passes."""
    t, s = config.train, config.system
    return bool(t.adaptive_epochs or (t.min_samples > 0 and t.below_min == "one_epoch")
                or (s.deadline_s > 0 and s.deadline_policy == "partial"))


def upload_bytes_per_arch(pipeline: UploadPipeline, algorithm, server_state, arch: str
                          ) -> float:
    """Bytes one client of `arch` sends per round as the simulated network sees it."""
    template = algorithm.upload_template(server_state, arch)
    if not jax.tree.leaves(template):
        return 0.0
    cfg = pipeline.cfg
    if cfg.secagg:  # dense masked ring elements
        return tree_size(template)[0] * cfg.encoding.ring_bits / 8
    return compression.encoded_bytes(template, cfg.compression) + (4 if cfg.dp else 0)


def build_context(config: ml_collections.ConfigDict, data: FederatedData,
                  strategies: dict[str, str] | None = None
                  ) -> tuple[rounds.RunContext, SimState]:
    """Everything static of a run, and the run's state at round 0.

    `strategies` (arch -> 'loop' | 'vmap') fixes the cohorts' execution strategies under
    `config.execution.strategy='auto'` (a resumed run keeps its original choice, so its numbers
    continue bit for bit); otherwise 'auto' measures them (`strategy_choice`)."""
    algorithm = build_algorithm(config, data)
    archs = assign_architectures(config.clients.architectures, data.num_clients)
    requested = execution.resolve_strategy(config.execution.strategy)
    candidates = execution.STRATEGIES if requested == "auto" else (requested,)
    programs = {a: algorithm.cohort_program(a) for a in dict.fromkeys(archs)}
    runners = {a: {s: execution.make_runner(p, s) for s in candidates}
               for a, p in programs.items()}
    t = config.train
    n = data.num_clients
    if config.asynchronous.enabled:
        slots_per_round = config.asynchronous.concurrency
    elif t.sampling == "poisson":  # no fixed round size: every member gets a slot
        slots_per_round = n
    else:
        slots_per_round = sampling.participants_per_round(n, t.client_fraction)
    root = jax.random.key(config.seed)
    server_key, client_key, train_key = jax.random.split(root, 3)
    upload_key = jax.random.fold_in(root, 7)  # compression / DP noise / secure-agg stream
    cohorts, client_states = build_cohorts(data, archs, programs,
                            {a: r[candidates[0]] for a, r in runners.items()}, slots_per_round,
                            client_key)
    server_state = jax.jit(algorithm.init_server, static_argnums=1, compiler_options={
        "xla_backend_optimization_level": 1})(server_key, tuple(c.arch for c in cohorts))
    pipeline = build_pipeline(config, algorithm, n)
    try:
        sys_cfg = system.system_config(config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    profiles = system.client_profiles(sys_cfg, n, config.seed)
    sizes = np.array([len(i) for i in data.train_indices], np.int64)
    epochs = client_epochs(config, sizes)
    capacity = np.zeros(n, np.int64)
    for c in cohorts:
        capacity[c.client_ids] = c.train.y.shape[1]
    planned = sampling.planned_steps(sizes, capacity, t.batch_size, epochs)
    choices = {}
    # Clients that train per round, on average (FedBuff: the buffer's worth of arrivals).
    launches_per_round = (config.asynchronous.buffer_size if config.asynchronous.enabled
                          else t.client_fraction * n)
    if requested == "auto" and strategies and all(c.arch in strategies for c in cohorts):
        for c in cohorts:
            c.runner = runners[c.arch][strategies[c.arch]]
            choices[c.arch] = {"strategy": strategies[c.arch], "from_checkpoint": True}
    elif requested == "auto":
        cache_dir = compilation.configure_cache(config.execution.compilation_cache_dir)
        for c in cohorts:
            choice = strategy_choice.choose(strategy_choice.Trial(
                f"{algorithm.name}/{c.arch}", runners[c.arch],
                algorithm.broadcast(server_state, c.arch), client_states[c.arch], c.train,
                c.bucket,
                launches_per_round * len(c.client_ids) / n, planned[c.client_ids],
                int(epochs.max()), t.batch_size), cache_dir)
            c.runner = runners[c.arch][choice.strategy]
            choices[c.arch] = choice.as_dict()
    eligible = (sizes >= t.min_samples) if t.below_min == "skip" else np.ones(n, bool)
    if not eligible.any():
        raise ConfigError(f"config.train.min_samples={t.min_samples}: no client has that many "
                          f"local samples (largest: {sizes.max()})")
    try:
        attack = attacks.attack_config(config, n)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ctx = rounds.RunContext(
        config=config, algorithm=algorithm, cohorts=cohorts,
        server_step=jax.jit(algorithm.server_update), pipeline=pipeline, system=sys_cfg,
        profiles=profiles, client_arch=archs, sizes=sizes, epochs=epochs,
        planned_steps=planned, strategy_choices=choices,
        statically_eligible=eligible,
        strata=sampling.size_strata(sizes, t.strata, profiles.availability_class),
        upload_bytes={c.arch: upload_bytes_per_arch(pipeline, algorithm, server_state, c.arch)
                      for c in cohorts},
        download_bytes={c.arch: float(tree_size(algorithm.broadcast(server_state, c.arch))[1])
                        for c in cohorts},
        step_limits=uses_step_limits(config), train_key=train_key, upload_key=upload_key,
        monitor_x=jnp.asarray(data.central.x_test[:1]),
        monitor_y=jnp.asarray(data.central.y_test[:1]), attack=attack)
    return ctx, initial_state(ctx, server_state, client_states)


def initial_state(ctx: rounds.RunContext, server_state, clients: dict[str, Any]) -> SimState:
    """The run's state at round 0 (what a checkpoint holds, see `checkpointing`)."""
    pipeline, algorithm = ctx.pipeline, ctx.algorithm
    memories = {c.arch: (pipeline.init_memory(algorithm.upload_template(server_state, c.arch),
                                              len(c.client_ids))
                         if pipeline.cfg.compression.topk_fraction < 1
                         else jnp.zeros((len(c.client_ids),), jnp.float32))
                for c in ctx.cohorts}
    in_flight = None
    if ctx.config.asynchronous.enabled:
        in_flight = asynchronous.InFlight.create(
            ctx.config.asynchronous.concurrency,
            {c.arch: algorithm.upload_template(server_state, c.arch) for c in ctx.cohorts})
    return SimState(server=server_state, clients=clients, memories=memories,
                    sampler=sampling.SamplerState.create(ctx.num_clients,
                                                         int(ctx.strata.max()) + 1),
                    dp_sgd_steps=np.zeros(ctx.num_clients, np.int64), clock_s=0.0,
                    in_flight=in_flight)


class DivergedError(RuntimeError):
    """Training went non-finite (and `config.train.allow_divergence` is False); the summary with
    `diverged: true` has been written."""


class RunLockedError(RuntimeError):
    """Another live process is writing the same workdir."""


class WorkdirLock:
    """`<workdir>/.lock` holding the writer's host and pid, created atomically. A lock left by a
    process that no longer runs on this host is taken over with a warning."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, ".lock")
        self.held = False

    def acquire(self) -> None:
        me = f"{socket.gethostname()} {os.getpid()}"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and self._alive(*holder):
                    raise RunLockedError(
                        f"workdir {os.path.dirname(self.path)} is in use by pid {holder[1]} on "
                        f"{holder[0]} ({self.path}); wait for it, or use another --workdir"
                        ) from None
                logging.warning("taking over the stale lock %s (%s)", self.path,
                                f"pid {holder[1]} on {holder[0]} has ended" if holder
                                else "unreadable")
                os.remove(self.path)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self.held = True
            return
        raise RunLockedError(f"cannot take the lock {self.path}")

    def _holder(self) -> tuple[str, int] | None:
        try:
            host, pid = open(self.path).read().split()
            return host, int(pid)
        except (OSError, ValueError):
            return None

    @staticmethod
    def _alive(host: str, pid: int) -> bool:
        if host != socket.gethostname():
            return True  # cannot tell: assume another machine's run is alive
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def release(self) -> None:
        if self.held and os.path.exists(self.path):
            os.remove(self.path)
        self.held = False


def data_fingerprint(data: FederatedData) -> str:
    """SHA-256 over the dataset's arrays and every client's train/test indices: resuming with
    other data contents (a regenerated .npz, another download) is refused even when the config
    is unchanged."""
    h = hashlib.sha256()
    c = data.central
    for a in (c.x_train, c.y_train, c.x_test, c.y_test, *data.train_indices,
              *data.test_indices):
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def non_finite_metrics(record: dict[str, Any]) -> list[str]:
    """Names of the round's loss metrics that are NaN or infinite (training diverged)."""
    return sorted(k for k, v in record.items()
                  if "loss" in k and isinstance(v, float) and not math.isfinite(v))


def _some(names: list[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def run_experiment(config: ml_collections.ConfigDict, workdir: str,
                   show_progress: bool = True) -> dict[str, Any]:
    """Runs (or resumes) a full experiment; see `_run`. Holds `<workdir>/.lock` meanwhile, so
    two runs never write the same workdir."""
    validate_config(config)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ConfigError(f"--workdir={workdir} is a file, not a directory")
    try:
        os.makedirs(workdir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--workdir={workdir} cannot be created ({e.strerror})") from None
    lock = WorkdirLock(workdir)
    lock.acquire()
    try:
        return _run(config, workdir, show_progress)
    finally:
        lock.release()


def _run(config: ml_collections.ConfigDict, workdir: str, show_progress: bool
         ) -> dict[str, Any]:
    """Runs (or resumes) a full experiment; writes metrics.jsonl / .csv, clients.jsonl,
    rejections.jsonl, TensorBoard events, checkpoints and summary.json into `workdir`.

    Returns:
      The summary dict (final evaluation, best personalized accuracy, timings, participation
      counts, config).

    Raises:
      DivergedError: a loss went non-finite and `config.train.allow_divergence` is False
        (training stops at that round; summary.json says `diverged: true`).
    """
    start = time.time()
    try:
        compilation.configure_cache(config.execution.compilation_cache_dir)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ck = config.checkpoint
    checkpointer, first_round, history, meta = None, 0, [], None
    if ck.every > 0:
        ckpt_dir = os.path.join(workdir, "checkpoints")
        if not ck.resume and os.path.isdir(ckpt_dir):
            shutil.rmtree(ckpt_dir)  # start this workdir over
        checkpointer = checkpointing.Checkpointer(workdir, ck.every, ck.max_to_keep)
        meta = checkpointer.check_config(config)  # before any data is loaded
        if meta is not None and checkpointer.step > config.train.rounds:
            raise ConfigError(
                f"config.train.rounds={config.train.rounds} is below the round of the "
                f"checkpoint in {checkpointer.directory} ({checkpointer.step}); raise it, or "
                "start over with --config.checkpoint.resume=False")
    data = build_federated_data(config)
    fingerprint = data_fingerprint(data)
    if meta is not None and meta.get("data_fingerprint", fingerprint) != fingerprint:
        raise ConfigError(
            f"cannot resume from {checkpointer.directory}/{checkpointer.step}: the data "
            f"contents changed since it was written (fingerprint {meta['data_fingerprint'][:12]}"
            f" then, {fingerprint[:12]} now) although the config did not; use another "
            "--workdir, or --config.checkpoint.resume=False to start over")
    write_data_profile(data, config.data.partition, workdir)
    ctx, state = build_context(config, data, (meta or {}).get("execution_strategy_by_arch"))
    if meta is not None:
        first_round, restored = checkpointer.restore(state.to_checkpoint())
        state = state.from_checkpoint(restored)
        history = meta["history"]
        ctx.pipeline.round_noise_multipliers = list(meta.get("dp_round_noise_multipliers",
                                                             []))[:first_round]
        logging.info("resumed from %s at round %d", checkpointer.directory, first_round)
    writers = metrics_io.RunWriters(workdir, first_round, config.monitor.tensorboard,
                                    config.monitor.client_report)
    rejected_total = sum(1 for _ in metrics_io.read_jsonl(writers.rejections.path))
    batch_rate = {int(cid): min(1.0, min(config.train.batch_size, c.train.y.shape[1]) / max(n, 1))
                  for c in ctx.cohorts
                  for cid, n in zip(c.client_ids, np.asarray(c.train.sizes), strict=True)}
    chosen = sorted({c.runner.strategy for c in ctx.cohorts})
    strategy = chosen[0] if len(chosen) == 1 else "+".join(chosen)
    last = history[-1] if history else {}
    rounds_total = config.train.rounds
    diverged = None
    bar = tqdm(range(first_round, rounds_total), desc=f"{config.algorithm} [{strategy}]",
               disable=not show_progress, unit="round", initial=first_round, total=rounds_total)
    for r in bar:
        t0 = time.time()
        round_fn = asynchronous.async_round if config.asynchronous.enabled else rounds.sync_round
        state, record, rows, rejections = round_fn(ctx, state, r)
        jax.block_until_ready(state.server)
        rejected_total += record["uploads_rejected"]
        record = {"round": r + 1, **record, "uploads_rejected_total": rejected_total,
                  "simulated_clock_s": state.clock_s,
                  "participation_min": int(state.sampler.selected.min()),
                  "participation_max": int(state.sampler.selected.max()),
                  **privacy_metrics(ctx.pipeline, r + 1)}
        evaluated = (r + 1) % config.eval.every == 0 or r + 1 == rounds_total
        if evaluated:
            steps = {i: int(s) for i, s in enumerate(state.dp_sgd_steps) if s > 0}
            record.update(dp_sgd_metrics(config, steps, batch_rate,
                                         ctx.algorithm.dp_sgd_releases_per_step))
            record.update(evaluate(ctx.algorithm, state.server, ctx.cohorts, state.clients,
                                   *_global_test(data, config)))
        bad = non_finite_metrics(record)
        if bad and not evaluated:  # the round that diverged is always evaluated
            evaluated = True
            steps = {i: int(s) for i, s in enumerate(state.dp_sgd_steps) if s > 0}
            record.update(dp_sgd_metrics(config, steps, batch_rate,
                                         ctx.algorithm.dp_sgd_releases_per_step))
            record.update(evaluate(ctx.algorithm, state.server, ctx.cohorts, state.clients,
                                   *_global_test(data, config)))
            bad = non_finite_metrics(record)
        if bad:
            record["diverged"] = True
            diverged = {"round": r + 1, "metrics": bad}
            logging.warning("round %d: training diverged (%s non-finite); stopping. Lower the "
                            "learning rate or lambda; config.train.allow_divergence=True "
                            "keeps the exit status 0", r + 1, _some(bad))
        record.update(round_time_s=time.time() - t0, elapsed_s=time.time() - start)
        writers.write_round(record, rows, rejections)
        if evaluated:
            history.append(record)
            last = record
            writers.flush()
            bar.set_postfix(pacc=f"{last['personalized_accuracy_mean']:.3f}",
                            gacc=f"{last['global_accuracy_mean']:.3f}")
        if checkpointer is not None and checkpointer.due(r + 1, rounds_total):
            checkpointer.save(r + 1, state.to_checkpoint(), {
                "history": history, "config": config.to_dict(),
                "dp_round_noise_multipliers": ctx.pipeline.round_noise_multipliers[:r + 1],
                "execution_strategy_by_arch": {c.arch: c.runner.strategy for c in ctx.cohorts},
                "data_fingerprint": fingerprint})
        if diverged is not None:
            break
    bar.close()
    writers.close()
    if checkpointer is not None:
        checkpointer.close()
    if not history:
        raise ConfigError(f"nothing to run: the checkpoint in {workdir} is at round "
                          f"{first_round} and config.train.rounds is {rounds_total}")
    finite = [h for h in history if not h.get("diverged")] or history
    best = max(finite, key=lambda h: h["personalized_accuracy_mean"])
    summary = {
        "final": last,
        "diverged": diverged is not None,
        **({"diverged_at": diverged} if diverged is not None else {}),
        "data_fingerprint": fingerprint,
        "majority_class_accuracy_mean": majority_class_accuracy(data),
        "best_personalized_accuracy": best["personalized_accuracy_mean"],
        "best_round": best["round"],
        **({"dp_accounting_sampling": ctx.pipeline.cfg.dp.sampling}
           if ctx.pipeline.cfg.dp is not None else {}),
        "norm_outlier_rejection": ctx.pipeline.outlier_note,
        "execution_strategy": strategy,
        "execution_strategy_by_arch": {c.arch: c.runner.strategy for c in ctx.cohorts},
        **({"strategy_choice": ctx.strategy_choices} if ctx.strategy_choices else {}),
        "platform": jax.default_backend(),
        "clients_per_arch": {c.arch: len(c.client_ids) for c in ctx.cohorts},
        "participation": {"selected": state.sampler.selected.tolist(),
                          "completed": state.sampler.completed.tolist()},
        "simulated_time_s": state.clock_s,
        "resumed_from_round": first_round,
        "wall_time_s": time.time() - start,
        "config": config.to_dict(),
    }
    metrics_io.write_json(f"{workdir}/summary.json", summary)
    if diverged is not None and not config.train.allow_divergence:
        raise DivergedError(
            f"training diverged in round {diverged['round']} ({_some(diverged['metrics'])} "
            f"non-finite); summary in {workdir}/summary.json. Lower the learning rate or lambda, "
            "or set --config.train.allow_divergence=True to accept it")
    return summary
