"""Builders: everything static of a run, made once from the config before round 1.

The dataset and its partition, the algorithm (from the registry), the cohorts and their
execution strategies, the upload pipeline, the system profiles, and the run's `SimState` at
round 0 (`build_context`).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import os
import shutil
import tempfile
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

from fedjax_pfedes.data.catalog import load_dataset
from fedjax_pfedes.data.federated import FederatedData, partition_dataset
from fedjax_pfedes.data.profile import DataProfile, profile_partition
from fedjax_pfedes.data.public import split_public
from fedjax_pfedes.data.sources import CentralDataset, LoadOptions
from fedjax_pfedes.engine import (
    asynchronous,
    attacks,
    client_system,
    context,
    finishing,
    sampling,
    sections,
)
from fedjax_pfedes.engine.cohorts import Offload, assign_architectures, build_cohorts
from fedjax_pfedes.engine.sections import round_settings
from fedjax_pfedes.engine.state import SimState
from fedjax_pfedes.engine.validate import check_against_data, validate_config
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.execution import (
    choice,
    compilation,
    kernels,
    machine_rates,
    placement,
    runners,
)
from fedjax_pfedes.execution.strategies import protocol
from fedjax_pfedes.io import plotting
from fedjax_pfedes.io.metrics import write_json
from fedjax_pfedes.tree_util import tree_size
from fedjax_pfedes.upload.plan import UploadPlan, make_plan
from fedjax_pfedes.upload.settings import PipelineConfig


def load_options(config: ml_collections.ConfigDict) -> LoadOptions:
    """The `config.data` fields that loaders read."""
    own = {f.name for f in dataclasses.fields(LoadOptions)} - {"seed"}  # all `config.data`'s
    return LoadOptions(seed=config.seed, **{k: v for k, v in config.data.items() if k in own})


def load_validated_pool(config: ml_collections.ConfigDict
                        ) -> tuple[CentralDataset, tuple[np.ndarray, np.ndarray]]:
    """Validates `config`, loads its dataset and checks the config against the data.

    Args:
      config: an experiment config.

    Returns:
      (the dataset without the public share, the public share (x, y)), as `load_pool`.
    """
    validate_config(config)
    central, pool = load_pool(config)
    check_against_data(config, central)
    return central, pool


def load_pool(config: ml_collections.ConfigDict
              ) -> tuple[CentralDataset, tuple[np.ndarray, np.ndarray]]:
    """The configured dataset with its public share (`config.data.public_fraction`, for
    `launch.pretrain_proxy`) held out of the pool: (dataset, (public x, public y))."""
    central = load_dataset(config.data.name, load_options(config))
    return split_public(central, config.data.public_fraction, config.seed)


def build_federated_data(config: ml_collections.ConfigDict) -> FederatedData:
    """Loads the configured dataset and partitions it over clients (the public share, if any,
    excluded)."""
    d = config.data
    central, _ = load_pool(config)
    check_against_data(config, central)
    return partition_dataset(
        central, d.num_clients, d.partition, config.seed,
        local_test_fraction=d.local_test_fraction, dirichlet_alpha=d.dirichlet_alpha,
        min_samples_per_client=d.min_samples_per_client,
        classes_per_client=d.classes_per_client, class_share_low=d.class_share_low,
        class_share_high=d.class_share_high, quantity_sigma=d.quantity_sigma,
        validation=d.validation_split)


def write_data_profile(data: FederatedData, partition: str, workdir: str) -> DataProfile:
    """Writes data_profile.json, label_heatmap.png and client_sizes.png into `workdir`."""
    profile = profile_partition(data, partition)
    write_json(os.path.join(workdir, "data_profile.json"), profile.summary())
    plotting.label_heatmap(profile, os.path.join(workdir, "label_heatmap.png"))
    plotting.size_histogram(profile, os.path.join(workdir, "client_sizes.png"))
    return profile


def build_algorithm(config: ml_collections.ConfigDict, data: FederatedData,
                    section=...):
    """The configured algorithm (`config.algorithm`, from the algorithm registry) for the
    dataset's shapes and statistics; `section`: the method's section as validation built it
    (left out: built from `config`)."""
    c = data.central
    # Static local epochs: the most any client runs (fewer are masked by ClientArrays.step_limit).
    epochs = int(client_epochs(config, np.array([len(i) for i in data.train_indices])).max())
    archs = assign_architectures(config.clients.architectures, data.num_clients)
    try:
        return sections.build_algorithm(config, c.num_classes, c.input_spec, epochs,
                                        collections.Counter(archs), section)
    except ValueError as e:  # a setting that does not fit the dataset, naming the field
        raise ConfigError(f"{e} (config.data.name='{config.data.name}')") from None


def build_upload_plan(config: ml_collections.ConfigDict, pipeline_cfg: PipelineConfig,
                      algorithm, num_clients: int) -> UploadPlan:
    """The run's upload plan (`upload.plan`) from its validated upload settings.

    Args:
      config: the experiment config (`train`'s round size and rounds, `asynchronous`).
      pipeline_cfg: `ValidConfig.upload`, the sections as validation built them.
      algorithm: the built method (its `norm_keys` complete the settings).
      num_clients: clients in the population.

    Returns:
      The `UploadPlan`; ConfigError naming the field for settings that cannot be honest.
    """
    t = config.train
    m = sampling.participants_per_round(num_clients, t.client_fraction)
    expected = t.client_fraction * num_clients if t.sampling == "poisson" else m
    return make_plan(dataclasses.replace(pipeline_cfg, norm_keys=algorithm.norm_keys),
                     algorithm, num_clients=num_clients, expected_participants=expected,
                     clients_per_round=m, rounds=t.rounds,
                     synchronous=not config.asynchronous.enabled)


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


def offload_spec(config: ml_collections.ConfigDict, workdir: str | None) -> Offload | None:
    """Where `config.execution.client_states='offload'` keeps client states (None: 'device').
    Their files go to `config.execution.client_state_dir`, '' = `<workdir>/client_states`
    (without a workdir: a fresh temporary folder, removed when the process exits)."""
    ex = config.execution
    if ex.client_states == "device":
        return None
    directory = ex.client_state_dir or (os.path.join(workdir, "client_states") if workdir
                                        else _scratch_folder("fedjax_pfedes_states_"))
    return Offload(budget_gb=ex.client_state_budget_gb, directory=directory)


def _scratch_folder(prefix: str) -> str:
    """A fresh temporary folder that is removed when the process exits (a context built
    without a workdir, e.g. from a notebook, would otherwise leave every client's states
    behind)."""
    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def build_context(config: ml_collections.ConfigDict, data: FederatedData,
                  strategies: dict[str, str] | None = None, workdir: str | None = None
                  ) -> tuple[context.RunContext, SimState]:
    """Everything static of a run, and the run's state at round 0.

    `strategies` (arch -> runner name, e.g. 'loop' | 'vmap' | 'loop/eigen') fixes the cohorts'
    runners where `config.execution.strategy` or `config.execution.cpu_kernels` is 'auto' (a
    resumed run keeps its original choice, so its numbers continue bit for bit); otherwise
    'auto' measures them (`execution.choice`). `workdir`: the run's folder (offloaded client
    states that exceed their memory budget go under it)."""
    valid = validate_config(config)  # the run's validation, its sections built once
    algorithm = build_algorithm(config, data, valid.method)
    archs = assign_architectures(config.clients.architectures, data.num_clients)
    # one finishing program per cohort, shared by its candidate runners and the cost model
    programs = {a: protocol.finishing_program(algorithm.cohort_program(a))
                for a in dict.fromkeys(archs)}
    arch_runners, mesh, mesh_size = _candidate_runners(config.execution, programs)
    if not strategies and any(len(r) > 1 for r in arch_runners.values()):
        # a decision ahead (`_choose_runners`): its machine rates' references compile meanwhile
        machine_rates.prepare(choice.machine(), choice.rated_kernels(arch_runners.values()),
                              compilation.user_cache_dir())
    t, n = config.train, data.num_clients
    server_key, client_key, train_key, upload_key = _run_keys(config.seed)
    cohorts, client_states = build_cohorts(  # offload.BudgetError is a ConfigError
        data, archs, programs, {a: next(iter(r.values())) for a, r in arch_runners.items()},
        _slots_per_round(config, n), client_key, mesh_size, offload_spec(config, workdir),
        same_init=config.clients.same_init)
    server_state = jax.jit(algorithm.init_server, static_argnums=1, compiler_options={
        "xla_backend_optimization_level": 1})(server_key, tuple(c.arch for c in cohorts))
    upload = build_upload_plan(config, valid.upload, algorithm, n)
    sys_cfg = client_system.system_config(valid.sections["system"])
    attack = attacks.attack_config(config.attack, n)
    profiles = client_system.client_profiles(sys_cfg, n, config.seed)
    sizes, epochs, batch_size, planned = _local_work(config, data, cohorts)
    trial = functools.partial(
        _runner_trial, algorithm=algorithm, server_state=server_state, upload=upload,
        attack=attack, arch_runners=arch_runners, client_states=client_states,
        launches=(_launches_per_round(config, n), n), planned=planned,
        epochs=int(epochs.max()), batch_size=batch_size, programs=programs,
        host_threads=config.execution.loop_threads or runners.default_loop_threads(),
        mesh_size=mesh_size)
    choices = _choose_runners(config.execution, cohorts, arch_runners, strategies, trial)
    _place_on_mesh(config.execution, cohorts, client_states, mesh)
    eligible = _statically_eligible(t, sizes)
    ctx = context.RunContext(
        settings=round_settings(config, valid.sections), algorithm=algorithm, cohorts=cohorts,
        server_step=jax.jit(algorithm.server_update),
        server_metrics=(jax.jit(algorithm.server_metrics) if algorithm.server_metrics else None),
        upload=upload, system=sys_cfg, profiles=profiles, client_arch=archs, sizes=sizes,
        epochs=epochs, planned_steps=planned, strategy_choices=choices,
        statically_eligible=eligible,
        strata=sampling.size_strata(sizes, t.strata, profiles.availability_class),
        label_counts=data.train_label_counts(),
        **_bytes_per_client(algorithm, upload, server_state, cohorts),
        step_limits=uses_step_limits(config), train_key=train_key, upload_key=upload_key,
        attack=attack)
    return ctx, initial_state(ctx, server_state, client_states)


def _bytes_per_client(algorithm, upload, server_state, cohorts) -> dict[str, dict[str, float]]:
    """`RunContext.upload_bytes` and `download_bytes`: per cohort, what one participant sends
    (as the upload plan encodes it) and receives."""
    return {
        "upload_bytes": {c.arch: upload.bytes_per_client(
            algorithm.upload_template(server_state, c.arch)) for c in cohorts},
        "download_bytes": {c.arch: float(tree_size(algorithm.broadcast(server_state, c.arch))[1])
                           for c in cohorts}}


def _local_work(config: ml_collections.ConfigDict, data: FederatedData, cohorts
                ) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
    """([N] local training samples, [N] local epochs, the local batch size, [N] local steps
    without a deadline) of every client."""
    sizes = np.array([len(i) for i in data.train_indices], np.int64)
    epochs = client_epochs(config, sizes)
    capacity = np.zeros(len(sizes), np.int64)
    for c in cohorts:
        capacity[c.client_ids] = c.train.capacity
    batch_size = sections.local_optimizer(config)["batch_size"]
    planned = sampling.planned_steps(sizes, capacity, batch_size, epochs,
                                     config.train.drop_partial_batch)
    return sizes, epochs, batch_size, planned


def _run_keys(seed: int) -> tuple[jax.Array, ...]:
    """The run's RNG streams: server init, client init, training, and the upload stream
    (compression, DP noise, secure aggregation)."""
    root = jax.random.key(seed)
    return (*jax.random.split(root, 3), jax.random.fold_in(root, 7))


def _launches_per_round(config: ml_collections.ConfigDict, num_clients: int) -> float:
    """Clients that train per round, on average (FedBuff: the buffer's worth of arrivals)."""
    if config.asynchronous.enabled:
        return config.asynchronous.buffer_size
    return config.train.client_fraction * num_clients


def _runner_trial(c, *, algorithm, server_state, upload, attack, arch_runners, client_states,
                  launches: tuple[float, int], planned: np.ndarray, epochs: int,
                  batch_size: int, programs: dict, host_threads: int, mesh_size: int
                  ) -> choice.Trial:
    """What `execution.choice` times cohort `c`'s candidate runners on: its broadcast, states
    and data, the clients it launches per round, their local steps, what a round passes
    the runner (`finishing.sent_to_runner`), and what the cost model reads (the program's
    one-client update, the loop's threads, the mesh's devices). `launches`: (clients launched
    per round, N)."""
    broadcast = algorithm.broadcast(server_state, c.arch)
    sent = functools.partial(finishing.sent_to_runner, upload, attack.active, bucket=c.bucket,
                             broadcast=broadcast,
                             template=algorithm.upload_template(server_state, c.arch))
    return choice.Trial(
        f"{algorithm.name}/{c.arch}", arch_runners[c.arch], broadcast, client_states[c.arch],
        c.train, c.bucket, launches[0] * len(c.client_ids) / launches[1], planned[c.client_ids],
        epochs, batch_size, sent=lambda r: sent(runner=r),
        client_update=programs[c.arch].client_update, host_threads=host_threads,
        mesh_size=mesh_size)


def _candidate_runners(ex: ml_collections.ConfigDict, programs: dict
                       ) -> tuple[dict[str, dict[str, Any]], Any, int]:
    """arch -> runner name -> runner, for every (strategy, kernels) pair `config.execution`
    lets the run use ('auto' may pick any of them; across processes 'auto' is 'shard' with
    'xla' kernels, which every process runs alike); the device mesh of a mesh strategy (or
    None) and the mesh size the cohorts' slots are padded to."""
    requested = protocol.resolve_strategy(ex.strategy)
    across_processes = jax.process_count() > 1  # every process must run the same programs
    if across_processes and requested == "auto":
        requested = "shard"
    mesh = placement.client_mesh(ex.devices) if protocol.needs_mesh(requested) else None
    candidates = protocol.auto_candidates(mesh) if requested == "auto" else (requested,)
    kernel_set = kernels.kernel_candidates(
        "xla" if across_processes and ex.cpu_kernels == "auto" else ex.cpu_kernels)
    arch_runners = {a: {r.name: r for r in (runners.make_runner(p, s, mesh, ex.loop_threads, k,
                                                                ex.scan_chunk,
                                                                ex.eval_memory_budget_gb)
                                            for s in candidates for k in kernel_set)}
                    for a, p in programs.items()}
    mesh_size = mesh.size if any(protocol.strategy(s).needs_mesh for s in candidates) else 1
    return arch_runners, mesh, mesh_size


def _slots_per_round(config: ml_collections.ConfigDict, num_clients: int) -> int:
    """The slots a cohort's round program is compiled for: the asynchronous concurrency, every
    client under Poisson sampling (no fixed round size), else the participants per round."""
    t = config.train
    if config.asynchronous.enabled:
        return config.asynchronous.concurrency
    if t.sampling == "poisson":
        return num_clients
    return sampling.participants_per_round(num_clients, t.client_fraction)


def _choose_runners(ex: ml_collections.ConfigDict, cohorts, arch_runners: dict,
                    strategies: dict[str, str] | None, trial) -> dict:
    """Sets each cohort's runner: the only candidate (left as `build_cohorts` set it); the
    checkpoint's (`strategies`) when a resumed run has it among the candidates; else the one
    `execution.choice.decide` picks on `trial(cohort)`: the decision cache's, the cost model's
    best, or the faster of the model's two best strategies as timed (offloaded states never
    are).

    Returns:
      arch -> the choice as summary.json states it, with the seconds deciding took ({} with a
      single candidate).
    """
    if all(len(r) == 1 for r in arch_runners.values()):
        return {}  # the one candidate, as `build_cohorts` set it up
    if strategies and all(strategies.get(c.arch) in arch_runners[c.arch] for c in cohorts):
        for c in cohorts:
            c.use(arch_runners[c.arch][strategies[c.arch]])
        return {c.arch: {"strategy": strategies[c.arch], "from_checkpoint": True}
                for c in cohorts}
    if strategies:
        logging.warning(
            "the checkpoint's execution runners %s are not among this run's candidates %s "
            "(another backend or config.execution settings?): measuring anew, so the "
            "resumed rounds may differ from the original run's in the last float bits",
            strategies, sorted(next(iter(arch_runners.values()))))
    cache_dir = compilation.configure_cache(ex.compilation_cache_dir)
    # the machine's rates are the machine's: one file per user, whatever the compilation cache
    choices = choice.decide({c.arch: trial(c) for c in cohorts}, cache_dir,
                            timing=ex.client_states == "device",
                            rates_dir=compilation.user_cache_dir())
    for c in cohorts:
        picked = choices[c.arch]
        c.use(arch_runners[c.arch][picked["strategy"]])
        logging.info("execution of the %s cohort: %s (%s)", c.arch, picked["strategy"],
                     "decided before, cached" if picked["cached"] else picked["reason"])
    return choices


def _place_on_mesh(ex: ml_collections.ConfigDict, cohorts, client_states: dict, mesh) -> None:
    """A mesh strategy reads data and states on its mesh: puts them there once (samples only:
    the sizes stay on the default device, where rounds read them)."""
    for c in cohorts:
        if protocol.strategy(c.runner.strategy).needs_mesh and ex.client_states == "device":
            c.train, c.test = (a.replace(x=placement.client_rows(a.x, mesh),
                                         y=placement.client_rows(a.y, mesh))
                               for a in (c.train, c.test))
            client_states[c.arch] = placement.client_rows(client_states[c.arch], mesh)


def _statically_eligible(t: ml_collections.ConfigDict, sizes: np.ndarray) -> np.ndarray:
    """[N] whether a client may ever be selected (the minimum-samples rule's 'skip'), with a
    warning where coverage sampling's candidate pool is the whole population; ConfigError when
    nobody is eligible."""
    n = len(sizes)
    m = sampling.participants_per_round(n, t.client_fraction)
    if t.sampling == "coverage" and sampling.coverage_pool_size(m, t.coverage_candidates) >= n:
        logging.warning(
            "config.train.sampling='coverage' draws its candidates from all %d clients (%d per "
            "round): the greedy pass then picks the same clients again and again and starves "
            "others (docs/design.md measures it); set config.train.coverage_candidates between "
            "%d and %d", n, m, m, n - 1)
    eligible = (sizes >= t.min_samples) if t.below_min == "skip" else np.ones(n, bool)
    if not eligible.any():
        raise ConfigError(f"config.train.min_samples={t.min_samples}: no client has that many "
                          f"local samples (largest: {sizes.max()})")
    return eligible


def initial_state(ctx: context.RunContext, server_state, clients: dict[str, Any]) -> SimState:
    """The run's state at round 0 (what a checkpoint holds, see `io.checkpoints`)."""
    algorithm = ctx.algorithm
    memories = {c.arch: ctx.upload.init_memory(algorithm.upload_template(server_state, c.arch),
                                             len(c.client_ids))
                for c in ctx.cohorts}
    in_flight = None
    if ctx.settings.asynchronous is not None:
        in_flight = asynchronous.InFlight.create(
            ctx.settings.asynchronous.concurrency,
            {c.arch: algorithm.upload_template(server_state, c.arch) for c in ctx.cohorts})
    return SimState(server=server_state, clients=clients, memories=memories,
                    sampler=sampling.SamplerState.create(ctx.num_clients,
                                                         int(ctx.strata.max()) + 1),
                    dp_sgd_steps=np.zeros(ctx.num_clients, np.int64), clock_s=0.0,
                    in_flight=in_flight)
