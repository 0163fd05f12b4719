"""The config read into the typed settings the lower layers take.

A method (`algorithms/`) gets `method_settings`: the fields it owns and the fields it declared
it reads, nothing else. The upload pipeline (`upload/`), the client system
(`engine.client_system`), the attacks, the multi-process settings and the rounds
(`RoundSettings`) each receive their own dataclass, built here or by the section's own
`*_config(section)` function, never the ConfigDict. What needs several sections at once
(client-level DP's sampling assumption reads `train` and `system`) is decided here.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping

import ml_collections

from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms import registry as algorithm_registry
from fedjax_pfedes.config import fields
from fedjax_pfedes.config.defaults import (
    AsynchronousSection,
    EvalSection,
    ExecutionSection,
    MonitorSection,
    TrainSection,
    read_section,
)
from fedjax_pfedes.config.fields import Section
from fedjax_pfedes.config.runtime_sections import float_list
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.upload import privacy, stages
from fedjax_pfedes.upload.settings import PipelineConfig


def uniformly_random_selection(config: ml_collections.ConfigDict) -> bool:
    """Whether every round's participants are a uniformly random draw from all clients (what
    privacy amplification by subsampling assumes): 'uniform' / 'poisson' sampling, every client
    always online, no drop-outs or deadlines (which decay failing clients' sampling weights), and
    nobody skipped below a minimum size."""
    t, s = config.train, config.system
    availability = float_list(s.availability, "config.system.availability")
    reliable = (min(availability) >= 1.0 and s.availability_period == 0
                and s.dropout == 0 and s.deadline_s == 0)
    skips = t.min_samples > 0 and t.below_min == "skip"
    return t.sampling in ("uniform", "poisson") and reliable and not skips


def check_selection_is_data_independent(config: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the field when client-level DP meets a selection rule that
    reads the clients' private data: then one client's data changes who ELSE takes part, and no
    per-client sensitivity bound (amplified or not) holds. Strata from sample counts, skipping
    clients below a minimum size, and deadlines whose misses (set by a client's local steps,
    i.e. its sample count) decay its sampling weight are such rules; coverage sampling is
    refused by the config checks for the same reason."""
    t, s = config.train, config.system
    if t.sampling == "stratified" and t.strata > 1:
        raise ConfigError(
            f"config.train.strata={t.strata} buckets clients by sample count, which client-level "
            "DP treats as private (one client's size would change who else is selected); with "
            "config.dp.enabled set config.train.strata=1 (strata from the public availability "
            "classes only) or use config.train.sampling='uniform' / 'poisson'")
    if t.min_samples > 0 and t.below_min == "skip":
        raise ConfigError(
            f"config.train.min_samples={t.min_samples} with below_min='skip' selects clients by "
            "their private sample count; with config.dp.enabled set config.train.min_samples=0 "
            "or config.train.below_min='one_epoch'")
    if float(s.deadline_s) > 0 and float(s.failure_decay) < 1:
        raise ConfigError(
            f"config.system.deadline_s={s.deadline_s} with failure_decay={s.failure_decay}: a "
            "client misses the deadline by its local steps (its private sample count), and the "
            "decayed weight then changes who else is selected; with config.dp.enabled set "
            "config.system.failure_decay=1.0 or config.system.deadline_s=0")


def pipeline_config(config: ml_collections.ConfigDict,
                    built: Mapping[str, Section] | None = None) -> PipelineConfig:
    """`PipelineConfig` from an experiment config's `upload`, `dp` and `secagg` sections and
    the registered upload stages' own, with the DP accountant's sampling assumption read from
    `train` and `system`.

    Args:
      config: the experiment config.
      built: its core sections as validation built them (`ValidConfig.sections`); None builds
        them here.

    Returns:
      The pipeline's settings. ValueError naming the field for a value out of range or a
      selection rule client-level DP cannot account for.
    """
    def section(name: str) -> Section:
        return built[name] if built is not None else read_section(config, name)
    upload, dp_section, secagg = section("upload"), section("dp"), section("secagg")
    dp = None
    if dp_section.enabled:
        check_selection_is_data_independent(config)
        sampling = "poisson" if config.train.sampling == "poisson" else "fixed"
        if not uniformly_random_selection(config):
            sampling = "none"  # no amplification by subsampling is claimed
        dp = privacy.ClientDPConfig(
            **dataclasses.asdict(dp_section), sampling=sampling,
            sampling_rate=float(config.train.client_fraction) if sampling == "poisson" else 0.0)
    ratio = upload.norm_outlier_model_ratio
    return PipelineConfig(
        upload=upload, dp=dp, secagg=secagg if secagg.enabled else None,
        norm_model_ratio=(algorithm_registry.get(config.algorithm).norm_model_ratio
                          if ratio == -1 else ratio),
        stage_sections=tuple(_stage_section(config, cls) for cls in stages.own_sections()))


def _stage_section(config: ml_collections.ConfigDict, cls: type[Section]) -> Section:
    """A registered stage's own section, built from the config (ranges checked)."""
    if cls.SECTION not in config:
        raise ConfigError(f"config.{cls.SECTION}: a registered upload stage declares it, the "
                         "config has no such section (build the config with "
                         "fedjax_pfedes.default_config() after registering)")
    return fields.build(cls, config[cls.SECTION].to_dict())


@dataclasses.dataclass(frozen=True)
class RoundSettings:
    """What a run's rounds read of the config (`engine.rounds`, `engine.asynchronous`): the
    built sections themselves.

    Attributes:
      seed: `config.seed`.
      train: `config.train` (rounds, sampling, client fraction).
      monitor: `config.monitor` (the participants' losses before / after the server step).
      eval: `config.eval` (each participant right after training).
      execution: `config.execution` (the uploads a streamed 'scan' round holds for the norm
        rule).
      asynchronous: `config.asynchronous` when enabled, else None (synchronous rounds).
    """

    seed: int
    train: TrainSection
    monitor: MonitorSection
    eval: EvalSection
    execution: ExecutionSection
    asynchronous: AsynchronousSection | None = None


def round_settings(config: ml_collections.ConfigDict,
                   built: Mapping[str, Section] | None = None) -> RoundSettings:
    """`RoundSettings` from an experiment config's `seed`, `train`, `monitor`, `eval`,
    `execution` and `asynchronous` sections.

    Args:
      config: the experiment config.
      built: its sections as validation built them (`ValidConfig.sections`); None builds them
        here with `**` (`read_section`).

    Returns:
      The rounds' settings.
    """
    def section(name: str) -> Section:
        return built[name] if built is not None else read_section(config, name)
    asynchronous = section("asynchronous")
    return RoundSettings(
        seed=int(config.seed), train=section("train"), monitor=section("monitor"),
        eval=section("eval"), execution=section("execution"),
        asynchronous=asynchronous if asynchronous.enabled else None)


def method_settings(config: ml_collections.ConfigDict, name: str | None = None
                    ) -> ml_collections.FrozenConfigDict:
    """A method's view of the config: its own fields and those it declared it reads.

    Args:
      config: the experiment config.
      name: the method (None: `config.algorithm`).

    Returns:
      A read-only ConfigDict holding `algorithm`, the paths of the entry's `fields` and `reads`
      (a path naming a section brings the whole section), at their values in `config`.
      ValueError naming the field when a declared path is not in the config.
    """
    entry = algorithm_registry.get(name or config.algorithm)
    view: dict = {}
    for path in ("algorithm", *entry.fields, *entry.reads):
        node, target = config, view
        *parents, leaf = path.split(".")
        for part in parents:
            if part not in node:
                raise ConfigError(f"config.{path}: '{entry.name}' reads it, the config has no "
                                 f"section '{part}'")
            node, target = node[part], target.setdefault(part, {})
        if leaf not in node:
            raise ConfigError(f"config.{path}: '{entry.name}' reads it, the config has no such "
                             "field")
        value = node[leaf]
        target[leaf] = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
    return ml_collections.FrozenConfigDict(view)


def local_optimizer(config: ml_collections.ConfigDict) -> dict:
    """The local optimizer `config.algorithm` trains with.

    Args:
      config: the experiment config.

    Returns:
      {lr_local, local_momentum, reset_local_optimizer, batch_size}: `config.train`'s, each
      overridden by the method's own section where that section sets it (numbers: -1 =
      inherit). `reset_local_optimizer` is False for methods without a private optimizer state
      (they start every round fresh anyway).
    """
    section = config.get(config.algorithm) or {}
    out = {}
    for field in algorithm_registry.OPTIMIZER_OVERRIDES:
        value = section.get(field, -1)
        out[field] = config.train[field] if value is None or value == -1 else value
    out["reset_local_optimizer"] = bool(
        out["reset_local_optimizer"]
        and algorithm_registry.get(config.algorithm).private_optimizer)
    return out


def build_inputs(config: ml_collections.ConfigDict, num_classes: int, input_spec: InputSpec,
                 local_epochs: int, clients_per_arch: collections.Counter,
                 section: Section | None | type(...) = ...
                 ) -> algorithm_registry.BuildInputs:
    """What the configured method's `build` gets (`algorithms.registry.BuildInputs`).

    Args:
      config: the experiment config.
      num_classes: labels of the dataset.
      input_spec: modality, shape and normalization statistics of the inputs.
      local_epochs: the most local epochs any client runs.
      clients_per_arch: how many clients use each architecture.
      section: the method's section as validation built it (`ValidConfig.method`); left out,
        it is built here from `config`.

    Returns:
      The method's settings view, its local-training settings and DP-SGD's, with the facts.
    """
    opt = local_optimizer(config)
    local = dict(num_classes=num_classes, input_spec=input_spec, lr_local=opt["lr_local"],
                 local_momentum=opt["local_momentum"], local_epochs=local_epochs,
                 batch_size=opt["batch_size"],
                 unroll_local_steps=config.execution.unroll_local_steps,
                 drop_partial_batch=config.train.drop_partial_batch,
                 augment=config.train.augment)
    d = config.dp_sgd
    dp_sgd = local_training.DPSGDConfig(d.clip_norm, d.noise_multiplier) if d.enabled else None
    if section is ...:
        section = algorithm_registry.get(config.algorithm).read_section(config)
    return algorithm_registry.BuildInputs(method_settings(config), local, dp_sgd, num_classes,
                                          input_spec, local_epochs, clients_per_arch,
                                          section=section)


def build_algorithm(config: ml_collections.ConfigDict, num_classes: int,
                    input_spec: InputSpec, local_epochs: int,
                    clients_per_arch: collections.Counter,
                    section: Section | None | type(...) = ...):
    """The configured method, built from the registry (`algorithms.registry.build`).

    Args:
      config: the experiment config.
      num_classes: as `build_inputs`.
      input_spec: as `build_inputs`.
      local_epochs: as `build_inputs`.
      clients_per_arch: as `build_inputs`.
      section: as `build_inputs`.

    Returns:
      The `Algorithm`.
    """
    inputs = build_inputs(config, num_classes, input_spec, local_epochs, clients_per_arch,
                          section)
    return algorithm_registry.build(config.algorithm, inputs,
                                    local_optimizer(config)["reset_local_optimizer"])
