"""Checks an experiment config before any data is loaded or compiled.

Each section checks its own ranges (`config/*_sections.py`, built here with `read_section`), each
method its own fields (`AlgorithmEntry.check`), each upload stage its own; what is left here are
the rules that read several sections or another layer's names (a dataset, a partition, a
sampling rule, an execution strategy). Every error names the offending field, e.g.
`config.lam must be >= 0, got -1.0`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping

import ml_collections

from fedjax_pfedes.algorithms import registry as algorithm_registry
from fedjax_pfedes.config.defaults import SECTIONS, TopLevel, read_section, read_top_level
from fedjax_pfedes.config.fields import Section
from fedjax_pfedes.data import augmentation
from fedjax_pfedes.data.catalog import LOADERS
from fedjax_pfedes.data.federated import PARTITIONS
from fedjax_pfedes.data.sources import CentralDataset
from fedjax_pfedes.engine import attacks, schema, sections
from fedjax_pfedes.engine.client_system import system_config
from fedjax_pfedes.engine.cohorts import assign_architectures
from fedjax_pfedes.engine.sampling import BELOW_MIN
from fedjax_pfedes.engine.sampling import METHODS as SAMPLING_METHODS
from fedjax_pfedes.engine.sections import pipeline_config
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.execution import distributed, kernels, offload, placement
from fedjax_pfedes.execution.strategies import protocol
from fedjax_pfedes.models.architectures import (
    check_architecture,
    shared_arch,
    uses_batch_norm,
)
from fedjax_pfedes.models.backbones import BACKBONES
from fedjax_pfedes.models.probe import check_backbone
from fedjax_pfedes.upload import stages
from fedjax_pfedes.upload.settings import PipelineConfig, check_compatible


def aggregation_kind(algorithm: str) -> str:
    """`Algorithm.aggregation` of a method, known before it is built (for config checks)."""
    return algorithm_registry.get(algorithm).aggregation


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _non_finite_fields(config: ml_collections.ConfigDict, prefix: str = "config") -> list[str]:
    out = []
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            out += _non_finite_fields(value, f"{prefix}.{key}")
        elif isinstance(value, float) and not math.isfinite(value):
            out.append(f"{prefix}.{key} must be finite, got {value}")
    return out


def _check_multi_process(s: distributed.Settings, config: ml_collections.ConfigDict
                         ) -> None:
    """The features that do not run across processes yet: ValueError naming the field."""
    if not s.multi_process:
        return
    refusals = [
        (config.execution.strategy not in ("shard", "auto"), "config.execution.strategy must "
         "be 'shard' (or 'auto', which means 'shard' there) across processes (the mesh spans "
         f"all processes' devices), got '{config.execution.strategy}'"),
        (config.execution.devices != 0, "config.execution.devices must be 0 (all devices of "
         f"all processes) across processes, got {config.execution.devices}"),
        (config.execution.client_states != "device", "config.execution.client_states="
         f"'{config.execution.client_states}' is not supported across processes yet; use "
         "'device'"),
        (config.asynchronous.enabled, "config.asynchronous.enabled: asynchronous rounds are not "
         "supported across processes yet"),
    ]
    for refused, message in refusals:
        if refused:
            raise ConfigError(message)


def _paths(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out |= _paths(value, f"{path}.") if isinstance(value, dict) else {path}
    return out


@dataclasses.dataclass(frozen=True)
class ValidConfig:
    """A validated config's sections, each built once (`validate_config`'s result).

    Attributes:
      top: the top-level fields (`config.seed`, `algorithm`, `proxy_dim`).
      sections: `config.<name>` -> its built section, for every core section.
      method: the configured method's own section, or None.
      upload: the upload pipeline's settings (`config.upload`, `dp`, `secagg` and the
        registered stages' sections) before the method's `norm_keys` are known.
    """

    top: TopLevel
    sections: Mapping[str, Section]
    method: Section | None
    upload: PipelineConfig


# The last config validated: a run validates its config where it starts and again where its
# data is built (`build.build_federated_data`, also an entry point of its own); the second time
# the same config object with the same contents and the same registered parts is not checked
# and built again.
_LAST: tuple[tuple, ValidConfig] | None = None


def _identity(config: ml_collections.ConfigDict) -> tuple:
    registered = tuple((n, id(e)) for n, e in algorithm_registry.entries().items())
    return (id(config), json.dumps(config.to_dict(), sort_keys=True, default=repr), registered,
            tuple(id(s) for s in stages.STAGES), tuple(LOADERS), tuple(BACKBONES))


def validate_config(config: ml_collections.ConfigDict) -> ValidConfig:
    """Checks `config` before any data is loaded or compiled.

    Args:
      config: an experiment config.

    Returns:
      Its sections, each built once; ConfigError naming the first invalid field.
    """
    global _LAST
    identity = _identity(config)
    if _LAST is not None and _LAST[0] == identity:
        return _LAST[1]
    valid = _validate(config)
    _LAST = (identity, valid)
    return valid


def _check_every_field_is_known_and_finite(config: ml_collections.ConfigDict) -> None:
    # Any method's section may also override the local optimizer (`OPTIMIZER_OVERRIDES`).
    overrides = {f"{name}.{field}" for name in algorithm_registry.names()
                 for field in algorithm_registry.OPTIMIZER_OVERRIDES}
    unknown = sorted(_paths(config.to_dict()) - _paths(schema.default_values()) - overrides)
    _require(not unknown, f"config.{unknown[0]}: not a field of the config (a typo, or a field "
             "that moved? `python -m launch.methods --fields` lists the methods' fields)"
             if unknown else "")
    bad = _non_finite_fields(config)
    _require(not bad, bad[0] if bad else "")


def _validate(config: ml_collections.ConfigDict) -> ValidConfig:
    _check_every_field_is_known_and_finite(config)
    top = read_top_level(config)  # each section checks its own ranges (ConfigError naming it)
    built = {name: read_section(config, name) for name in SECTIONS}
    entry = algorithm_registry.get(config.algorithm)
    protocol.resolve_strategy(config.execution.strategy)
    if protocol.needs_mesh(config.execution.strategy):
        placement.client_mesh(config.execution.devices)
    _check_execution_names(config.execution)
    _check_multi_process(distributed.settings(built["distributed"]), config)
    archs = assign_architectures(config.clients.architectures, config.data.num_clients)
    attacks.attack_config(config.attack, config.data.num_clients)
    algorithm_registry.check_optimizer_overrides(entry.name, config.get(entry.name) or {})
    method = entry.read_section(config)  # the method's own ranges
    if entry.check is not None:
        try:  # a method's hook, maybe a user's: its ValueError names the field
            entry.check(sections.method_settings(config))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _require(not (config.secagg.enabled and config.secagg.simulation == "aggregate"
                  and config.attack.kind != "none"),
             "config.secagg.simulation='aggregate' draws the honest senders' noise as one sum "
             "and cannot simulate clients that skip their client code (config.attack): use "
             "'sum'")
    if config.dp_sgd.enabled:
        with_dp_sgd = [n for n, e in algorithm_registry.entries().items() if e.dp_sgd]
        _require(entry.dp_sgd, "config.dp_sgd.enabled: DP-SGD is built into "
                 f"{with_dp_sgd}, not '{config.algorithm}'")
    upload = pipeline_config(config, built)
    check_compatible(upload, aggregation_kind(config.algorithm), config.algorithm)
    with_bn = sorted({a for a in archs if uses_batch_norm(a)})
    with_bn_support = [n for n, e in algorithm_registry.entries().items() if e.batch_norm]
    _require(not with_bn or entry.batch_norm,
             f"config.clients.architectures: {with_bn} have BatchNorm layers, which only "
             f"{with_bn_support} handle (running statistics); got '{config.algorithm}'")
    _check_names(config, entry)
    _validate_runtime(config, built["system"])
    return ValidConfig(top, built, method, upload)


def _check_names(config: ml_collections.ConfigDict, entry) -> None:
    """The dataset, partition, augmentation, sampling rule and proxy start a config names."""
    data = config.data
    _require(data.name in LOADERS,
             f"config.data.name: unknown dataset '{data.name}'; known: {sorted(LOADERS)}")
    _require(data.partition in PARTITIONS, f"config.data.partition: unknown partition "
             f"'{data.partition}'; known: {list(PARTITIONS)}")
    with_proxy = [n for n, e in algorithm_registry.entries().items() if e.proxy_init]
    _require(not config.proxy_init or entry.proxy_init, f"config.proxy_init: only {with_proxy} "
             f"start from a saved E_proxy, not '{config.algorithm}'; set it to ''")

    train = config.train
    _require(train.augment in augmentation.KINDS, f"config.train.augment must be one of "
             f"{list(augmentation.KINDS)}, got '{train.augment}'")
    _require(train.sampling in SAMPLING_METHODS, f"config.train.sampling: unknown "
             f"'{train.sampling}'; known: {list(SAMPLING_METHODS)}")
    _require(train.sampling != "coverage" or not (config.dp.enabled or config.dp_sgd.enabled),
             "config.train.sampling='coverage' picks clients by their label histograms, so one "
             "client's data changes who else takes part and DP's per-client sensitivity bound "
             "fails; with config.dp / config.dp_sgd use 'uniform' or 'poisson'")
    _require(train.below_min in BELOW_MIN, f"config.train.below_min: unknown "
             f"'{train.below_min}'; known: {list(BELOW_MIN)}")


def _check_execution_names(ex: ml_collections.ConfigDict) -> None:
    """The execution layer's names (its ranges are `ExecutionSection`'s)."""
    _require(ex.cpu_kernels in kernels.KERNEL_SETTINGS, "config.execution.cpu_kernels: "
             f"unknown '{ex.cpu_kernels}'; known: {list(kernels.KERNEL_SETTINGS)}")
    _require(ex.client_states in offload.PLACEMENTS, f"config.execution.client_states: "
             f"unknown '{ex.client_states}'; known: {list(offload.PLACEMENTS)}")


def _validate_runtime(config: ml_collections.ConfigDict, system: Section) -> None:
    """config.system (`system`: its built section), config.asynchronous, config.checkpoint."""
    sys_cfg = system_config(system)
    a = config.asynchronous
    if not a.enabled:
        return
    asynchronous = [n for n, e in algorithm_registry.entries().items() if e.asynchronous]
    _require(config.algorithm in asynchronous, "config.asynchronous.enabled: buffered "
             f"asynchronous aggregation rebases model updates onto a newer server model, which "
             f"{asynchronous} upload; not '{config.algorithm}'")
    _require(a.buffer_size <= a.concurrency <= config.data.num_clients,
             "config.asynchronous.concurrency must be in [buffer_size, data.num_clients] = "
             f"[{a.buffer_size}, {config.data.num_clients}], got {a.concurrency}")
    _require(not config.dp.enabled and not config.secagg.enabled,
             "config.asynchronous.enabled: client-level DP and secure aggregation need "
             "synchronous rounds (config.dp.enabled / config.secagg.enabled must be False)")
    _require(sys_cfg.deadline_s == 0, "config.system.deadline_s: asynchronous rounds have no "
             "deadline (updates arrive when they arrive); set it to 0")
    _require(not config.eval.after_training, "config.eval.after_training: asynchronous "
             "rounds have no moment when a round's participants have all just trained; set it "
             "to False")
    _require(config.train.sampling == "uniform", "config.train.sampling: asynchronous rounds "
             f"start clients as slots free up (uniform); got '{config.train.sampling}'")


def check_against_data(config: ml_collections.ConfigDict, central: CentralDataset) -> None:
    """Checks the fields that depend on the loaded dataset: sizes and the input modality."""
    num_train_samples = len(central.y_train)
    n = config.data.num_clients
    _require(n <= num_train_samples, f"config.data.num_clients={n} exceeds the "
             f"{num_train_samples} training samples of '{config.data.name}'")
    if config.data.partition in ("dirichlet", "quantity_skew"):
        need = n * config.data.min_samples_per_client
        _require(need <= num_train_samples,
                 f"config.data.min_samples_per_client={config.data.min_samples_per_client} x "
                 f"config.data.num_clients={n} = {need} exceeds the {num_train_samples} "
                 "training samples")
    if config.data.partition == "pathological":
        _require(config.data.classes_per_client <= central.num_classes,
                 f"config.data.classes_per_client={config.data.classes_per_client} exceeds the "
                 f"{central.num_classes} classes of '{config.data.name}'")
    augmentation.check(config.train.augment, central.modality)
    entry = algorithm_registry.get(config.algorithm)
    modalities = entry.modalities
    _require(central.modality in modalities,
             f"config.algorithm='{config.algorithm}' runs on {list(modalities)} data; "
             f"config.data.name='{config.data.name}' is {central.modality}")
    try:
        for arch in dict.fromkeys(assign_architectures(config.clients.architectures, n)):
            check_architecture(arch, modality=central.modality)
            check_backbone(arch, central.input_spec)
        if entry.check_data is not None:
            entry.check_data(sections.method_settings(config), central.input_spec)
        if entry.shared_model:
            check_backbone(shared_arch(config.clients.shared_arch, central.input_spec),
                           central.input_spec)
    except ValueError as e:
        raise ConfigError(f"{e} (config.data.name='{config.data.name}')") from None
