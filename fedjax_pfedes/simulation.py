"""The host loop: the only place with Python loops over rounds.

It owns RNG splitting, client sampling, per-cohort execution, the server step, evaluation,
metrics and the progress bar. Everything it calls per round is jitted with fixed shapes, so
nothing compiles again after the first round.
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any

import dp_accounting
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from tqdm.auto import tqdm

from fedjax_pfedes import execution, local_training, plotting, sampling
from fedjax_pfedes.algorithms.fedavg import FedAvgConfig, fedavg
from fedjax_pfedes.algorithms.fedbn import fedbn
from fedjax_pfedes.algorithms.fedgh import fedgh
from fedjax_pfedes.algorithms.fedkd import fedkd
from fedjax_pfedes.algorithms.fedmrl import fedmrl
from fedjax_pfedes.algorithms.fednova import fednova
from fedjax_pfedes.algorithms.fedproto import fedproto
from fedjax_pfedes.algorithms.fml import fml
from fedjax_pfedes.algorithms.lg_fedavg import HeteroConfig, lg_fedavg
from fedjax_pfedes.algorithms.pfedes import PFedESConfig, pfedes
from fedjax_pfedes.algorithms.pfedes_paper import PFedESPaperConfig, pfedes_paper
from fedjax_pfedes.algorithms.scaffold import scaffold
from fedjax_pfedes.algorithms.standalone import standalone
from fedjax_pfedes.cohorts import Cohort, assign_architectures, build_cohorts
from fedjax_pfedes.config_validation import (
    FEDAVG_FAMILY,
    PER_COHORT,
    ConfigError,
    check_against_data,
    validate_config,
)
from fedjax_pfedes.data.catalog import load_dataset
from fedjax_pfedes.data.federated import FederatedData, partition_dataset
from fedjax_pfedes.data.profile import DataProfile, profile_partition
from fedjax_pfedes.data.sources import LoadOptions
from fedjax_pfedes.metrics_io import MetricsWriter, write_json
from fedjax_pfedes.upload import privacy
from fedjax_pfedes.upload.pipeline import CohortUploads, UploadPipeline, pipeline_config

# Model-heterogeneous baselines built from HeteroConfig.
HETEROGENEOUS = {"lg_fedavg": lg_fedavg, "fedproto": fedproto, "fml": fml, "fedkd": fedkd,
                 "fedgh": fedgh, "fedmrl": fedmrl}


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
    """The configured algorithm (`config.algorithm`) for the dataset's shapes and statistics."""
    c, t, b = data.central, config.train, config.baseline
    name = config.algorithm
    local = dict(num_classes=c.num_classes, input_spec=c.input_spec, lr_local=t.lr_local,
                 local_momentum=t.local_momentum, local_epochs=t.local_epochs,
                 batch_size=t.batch_size, unroll_local_steps=config.execution.unroll_local_steps)
    dp_sgd = (local_training.DPSGDConfig(config.dp_sgd.clip_norm,
                                         config.dp_sgd.noise_multiplier)
              if config.dp_sgd.enabled else None)
    if name in PER_COHORT or name == "standalone":
        fedavg_config = FedAvgConfig(
            **local, prox_mu=b.prox_mu if name == "fedprox" else 0.0,
            server_optimizer=FEDAVG_FAMILY.get(name, "none"),
            server_lr={"fedavgm": b.fedavgm_lr, "fedadam": b.fedadam_lr}.get(name, b.server_lr),
            server_momentum=b.server_momentum, adam_b1=b.adam_b1, adam_b2=b.adam_b2,
            adam_eps=b.adam_eps, name=name, dp_sgd=dp_sgd)
        if name == "scaffold":
            archs = assign_architectures(config.clients.architectures, data.num_clients)
            return scaffold(fedavg_config, collections.Counter(archs))
        per_cohort = {"standalone": standalone, "fednova": fednova, "fedbn": fedbn}
        return per_cohort.get(name, fedavg)(fedavg_config)
    if name in HETEROGENEOUS:
        hetero_config = HeteroConfig(
            **local, dim=config.proxy_dim, proto_lambda=b.proto_lambda,
            shared_arch=b.shared_arch, fml_alpha=b.fml_alpha, fml_beta=b.fml_beta,
            kd_energy_start=b.kd_energy_start, kd_energy_end=b.kd_energy_end, rounds=t.rounds,
            gh_server_lr=b.gh_server_lr, gh_server_epochs=b.gh_server_epochs,
            mrl_sub_dim=b.mrl_sub_dim)
        return HETEROGENEOUS[name](hetero_config)
    if name == "pfedes_paper":
        return pfedes_paper(PFedESPaperConfig(**local, mu=b.paper_mu,
                                              g_lr_ratio=b.paper_g_lr_ratio))
    return pfedes(PFedESConfig(
        **local, lam=config.lam, align=config.align,
        contrastive_temperature=config.contrastive_temperature, proxy_dim=config.proxy_dim,
        proxy_arch=config.proxy_arch, proxy_lr_ratio=config.proxy_lr_ratio,
        projection_layernorm=config.projection_layernorm, warmup_steps=config.warmup_steps,
        server_momentum=config.server_momentum, dp_sgd=dp_sgd))


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


def evaluate(algorithm, server_state, cohorts: list[Cohort], global_x, global_y
             ) -> dict[str, Any]:
    """Every client's model on its own local test split and on the global test set."""
    per_client: dict[str, list[np.ndarray]] = {}
    per_cohort = {}
    for cohort in cohorts:
        broadcast = algorithm.broadcast(server_state, cohort.arch)
        m = jax.device_get(cohort.runner.evaluate(broadcast, cohort.states, cohort.test,
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


def tree_size(tree) -> tuple[int, int]:
    """(number of parameters, bytes) of a pytree of arrays, dense."""
    leaves = jax.tree.leaves(tree)
    return (sum(int(np.prod(np.shape(x))) for x in leaves),
            sum(int(np.prod(np.shape(x))) * jnp.dtype(x.dtype).itemsize for x in leaves))


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


def run_round(algorithm, server_state, cohorts: list[Cohort], participants: np.ndarray,
              round_key: jax.Array, server_step, pipeline: UploadPipeline, memories: dict,
              round_index: int, upload_key: jax.Array) -> tuple[Any, dict[str, Any], dict]:
    """One round: broadcast, local updates of every cohort's participants, the upload pipeline
    (checks, compression, DP, secure aggregation, robust aggregation), the server step.

    Returns (server state, round summary, error-feedback memories)."""
    uploads, train_metrics, traffic, client_steps = {}, [], [], {}
    for cohort in cohorts:
        broadcast = algorithm.broadcast(server_state, cohort.arch)
        template = algorithm.upload_template(server_state, cohort.arch)
        slots = cohort.slots(participants)
        valid = slots < len(cohort.client_ids)
        ids = np.where(valid, cohort.client_ids[np.minimum(slots, len(cohort.client_ids) - 1)],
                       -1)
        keys = jax.vmap(lambda i: jax.random.fold_in(round_key, i))(jnp.asarray(ids))
        stacked, cohort.states, metrics = cohort.runner.update(
            broadcast, cohort.states, cohort.train, slots, keys)
        sizes = jnp.take(cohort.train.sizes, jnp.asarray(slots), mode="clip")
        uploads[cohort.arch] = CohortUploads(stacked, template, sizes, valid, ids, slots)
        if valid.any():
            client_metrics = {k: np.asarray(v)[valid] for k, v in metrics.items()}
            train_metrics.append(client_metrics)
            if "local_steps" in client_metrics:
                client_steps.update(zip(ids[valid].tolist(),
                                        client_metrics["local_steps"].tolist(), strict=True))
            upload = tree_size(template)
            if "upload_encoded_params" in client_metrics:  # compressed uploads (FedKD's SVD)
                encoded = float(client_metrics["upload_encoded_params"].mean())
                upload = (encoded, encoded * upload[1] / max(upload[0], 1))
            traffic.append((int(valid.sum()), *upload, *tree_size(broadcast)))
    members = {c.arch: len(c.client_ids) for c in cohorts}
    groups, memories, report = pipeline.process(round_index, uploads, memories, members,
                                                upload_key)
    for r in report["rejections"]:
        logging.warning("round %d: upload of client %d rejected: %s", round_index + 1,
                        r["client"], r["reason"])
    server_state = server_step(server_state, groups)
    summary: dict[str, Any] = {}
    if train_metrics:
        summary = {f"{k}_mean": float(np.concatenate([m[k] for m in train_metrics]).mean())
                   for k in train_metrics[0]}
        counts = np.array(traffic, np.float64)
        per_client = counts[:, 1:].T @ counts[:, 0] / counts[:, 0].sum()
        summary.update(zip(("upload_params_per_client", "upload_bytes_per_client",
                            "download_params_per_client", "download_bytes_per_client"),
                           per_client.tolist(), strict=True))
    if "upload_bytes_per_client" in report:  # counted from the encoded form
        summary["upload_bytes_per_client"] = report["upload_bytes_per_client"]
    summary["client_steps"] = client_steps
    summary["uploads_rejected"] = report["rejected"]
    summary["rejections"] = report["rejections"]
    for k in ("secagg_senders", "secagg_dropped_after_upload", "secagg_failures"):
        if k in report:
            summary[k] = report[k]
    return server_state, summary, memories


def privacy_metrics(pipeline: UploadPipeline, rounds_done: int) -> dict[str, float]:
    """dp_epsilon (at dp_delta) spent after `rounds_done` rounds, from dp_accounting."""
    dp = pipeline.cfg.dp
    if dp is None:
        return {}
    eps = privacy.epsilon(dp, pipeline.noise_multiplier, pipeline.num_clients,
                          pipeline.clients_per_round, rounds_done)
    return {"dp_epsilon": eps, "dp_delta": dp.delta,
            "dp_noise_multiplier": pipeline.noise_multiplier, "dp_clip_norm": dp.clip_norm}


def dp_sgd_metrics(config: ml_collections.ConfigDict, steps_taken: dict[int, int],
                   batch_rate: dict[int, float]) -> dict[str, float]:
    """Per-client epsilon of sample-level DP-SGD so far (max and mean over clients that have
    trained), RDP accounting. Each local step is accounted as a Poisson-sampled Gaussian with
    q = B / n_k (the usual approximation for shuffled batches, as in Opacus / TF Privacy)."""
    if not config.dp_sgd.enabled or not steps_taken:
        return {}
    d = config.dp_sgd
    eps = []
    for cid, steps in steps_taken.items():
        if d.noise_multiplier == 0:
            eps.append(float("inf"))
            continue
        accountant = privacy.make_accountant("rdp", "poisson")
        accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            batch_rate[cid], dp_accounting.GaussianDpEvent(d.noise_multiplier)), steps))
        eps.append(float(accountant.get_epsilon(d.delta)))
    return {"dp_sgd_epsilon_max": max(eps), "dp_sgd_epsilon_mean": float(np.mean(eps)),
            "dp_sgd_delta": d.delta, "dp_sgd_noise_multiplier": d.noise_multiplier}


def run_experiment(config: ml_collections.ConfigDict, workdir: str,
                   show_progress: bool = True) -> dict[str, Any]:
    """Runs a full experiment and writes metrics.jsonl and summary.json into `workdir`.

    Returns:
      The summary dict (final evaluation, best personalized accuracy, timings, config).
    """
    validate_config(config)
    start = time.time()
    data = build_federated_data(config)
    write_data_profile(data, config.data.partition, workdir)
    algorithm = build_algorithm(config, data)
    archs = assign_architectures(config.clients.architectures, data.num_clients)
    strategy = execution.resolve_strategy(config.execution.strategy)
    programs = {a: algorithm.cohort_program(a) for a in dict.fromkeys(archs)}
    runners = {a: execution.make_runner(p, strategy) for a, p in programs.items()}
    m = sampling.participants_per_round(data.num_clients, config.train.client_fraction)
    sample = sampling.SAMPLERS[config.train.sampling]
    # Poisson sampling has no fixed round size: every member gets a slot.
    slots_per_round = data.num_clients if config.train.sampling == "poisson" else m
    root = jax.random.key(config.seed)
    server_key, client_key, train_key = jax.random.split(root, 3)
    upload_key = jax.random.fold_in(root, 7)  # compression / DP noise / secure-agg stream
    cohorts = build_cohorts(data, archs, programs, runners, slots_per_round, client_key)
    server_state = algorithm.init_server(server_key, tuple(c.arch for c in cohorts))
    server_step = jax.jit(algorithm.server_update)
    pipeline = build_pipeline(config, algorithm, data.num_clients)
    memories = {c.arch: (pipeline.init_memory(algorithm.upload_template(server_state, c.arch),
                                              len(c.client_ids))
                         if pipeline.cfg.compression.topk_fraction < 1
                         else jnp.zeros((len(c.client_ids),), jnp.float32))
                for c in cohorts}
    global_x, global_y = _global_test(data, config)
    writer = MetricsWriter(workdir)
    rejections_log = open(os.path.join(workdir, "rejections.jsonl"), "w")
    rejected_total = 0
    steps_taken: dict[int, int] = {}  # local steps per client so far (DP-SGD accounting)
    batch_rate = {int(cid): min(1.0, min(config.train.batch_size, c.train.y.shape[1]) / max(n, 1))
                  for c in cohorts
                  for cid, n in zip(c.client_ids, np.asarray(c.train.sizes), strict=True)}

    history, last = [], {}
    bar = tqdm(range(config.train.rounds), desc=f"{config.algorithm} [{strategy}]",
               disable=not show_progress, unit="round")
    for r in bar:
        t0 = time.time()
        participants = sample(config.seed, r, data.num_clients, config.train.client_fraction)
        server_state, train_summary, memories = run_round(
            algorithm, server_state, cohorts, participants,
            jax.random.fold_in(train_key, r), server_step, pipeline, memories, r,
            jax.random.fold_in(upload_key, r))
        jax.block_until_ready(server_state)
        for cid, steps in train_summary.pop("client_steps").items():
            steps_taken[cid] = steps_taken.get(cid, 0) + int(steps)
        for rejection in train_summary.pop("rejections"):
            rejections_log.write(json.dumps({"round": r + 1, **rejection}) + "\n")
        rejections_log.flush()
        rejected_total += train_summary["uploads_rejected"]
        if (r + 1) % config.eval.every == 0 or r + 1 == config.train.rounds:
            last = {"round": r + 1, "participants": len(participants),
                    **train_summary, "uploads_rejected_total": rejected_total,
                    **privacy_metrics(pipeline, r + 1),
                    **dp_sgd_metrics(config, steps_taken, batch_rate),
                    **evaluate(algorithm, server_state, cohorts, global_x, global_y),
                    "round_time_s": time.time() - t0, "elapsed_s": time.time() - start}
            writer.write(last)
            history.append(last)
            bar.set_postfix(pacc=f"{last['personalized_accuracy_mean']:.3f}",
                            gacc=f"{last['global_accuracy_mean']:.3f}")
    rejections_log.close()
    best = max(history, key=lambda h: h["personalized_accuracy_mean"])
    summary = {
        "final": last,
        "majority_class_accuracy_mean": majority_class_accuracy(data),
        "best_personalized_accuracy": best["personalized_accuracy_mean"],
        "best_round": best["round"],
        "execution_strategy": strategy,
        "platform": jax.default_backend(),
        "clients_per_arch": {c.arch: len(c.client_ids) for c in cohorts},
        "wall_time_s": time.time() - start,
        "config": config.to_dict(),
    }
    write_json(f"{workdir}/summary.json", summary)
    return summary
