"""The algorithm registry: every federated method declares itself here, once, in its own module.

An entry says what the rest of the simulator needs to know before and after building the method:
its config name, how the server combines uploads (`aggregation`, which tells the upload pipeline
what it may do), its capabilities (buffered asynchronous rounds, sample-level DP-SGD, BatchNorm
backbones) and `build`, which turns the experiment config plus the dataset's facts into an
`Algorithm`. `engine.loop` and `engine.validate` read only this registry; there are no name
tables elsewhere. Adding a method = one module under `fedjax_pfedes/algorithms/` that calls
`register(...)` at import, its config fields, a test and a row in the README's methods table.

Every module of this package is imported by `entries()` (pkgutil discovery), so a new module
needs no import list to be edited.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import pkgutil
from collections.abc import Callable

import ml_collections

from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.base import Algorithm, with_fresh_local_optimizer
from fedjax_pfedes.data.spec import InputSpec

AGGREGATIONS = ("shared", "per_cohort", "custom", "none")


# Local-training fields a method's config section may set to override `config.train` (numbers:
# -1 = inherit). E.g. `config.scaffold.local_momentum = 0.0`: SCAFFOLD's control variates assume
# plain local SGD, and it diverges with the quick start's momentum 0.9 (docs/baselines.md);
# `config.pfedes_paper.batch_size = 512`: the published pFedES runs' batch.
OPTIMIZER_OVERRIDES = ("lr_local", "local_momentum", "reset_local_optimizer", "batch_size")


def local_optimizer(config: ml_collections.ConfigDict) -> dict:
    """The local optimizer `config.algorithm` trains with: `config.train`'s lr_local,
    local_momentum and reset_local_optimizer, each overridden by the method's own config section
    where that section sets it (floats: -1 = inherit). `reset_local_optimizer` is reported False
    for methods without a private optimizer state (they start every round fresh anyway)."""
    section = config.get(config.algorithm) or {}
    out = {}
    for field in OPTIMIZER_OVERRIDES:
        value = section.get(field, -1)
        out[field] = config.train[field] if value is None or value == -1 else value
    out["reset_local_optimizer"] = bool(out["reset_local_optimizer"]
                                        and get(config.algorithm).private_optimizer)
    return out


def check_optimizer_overrides(config: ml_collections.ConfigDict) -> None:
    """ValueError naming the field for a bad override in the method's section."""
    section = config.get(config.algorithm) or {}
    name = f"config.{config.algorithm}"
    lr = section.get("lr_local", -1)
    if lr != -1 and not lr > 0:
        raise ValueError(f"{name}.lr_local must be > 0 (or -1 = config.train.lr_local), got {lr}")
    m = section.get("local_momentum", -1)
    if m != -1 and not 0 <= m < 1:
        raise ValueError(f"{name}.local_momentum must be in [0, 1) (or -1 = "
                         f"config.train.local_momentum), got {m}")
    b = section.get("batch_size", -1)
    if b != -1 and not (isinstance(b, int) and b >= 1):
        raise ValueError(f"{name}.batch_size must be an integer >= 1 (or -1 = "
                         f"config.train.batch_size), got {b}")


@dataclasses.dataclass(frozen=True)
class BuildInputs:
    """What `build` gets: the experiment config and the facts of the partitioned dataset.

    Attributes:
      config: the experiment config (`fedjax_pfedes/config/defaults.py` documents every field).
      num_classes: labels of the dataset.
      input_spec: modality, shape and normalization statistics of the inputs.
      local_epochs: the most local epochs any client runs (fewer are masked per client).
      clients_per_arch: how many clients use each architecture.
    """

    config: ml_collections.ConfigDict
    num_classes: int
    input_spec: InputSpec
    local_epochs: int
    clients_per_arch: collections.Counter

    def local_training(self) -> dict:
        """The local-training settings every method's config dataclass takes (the local
        optimizer from `local_optimizer`: `config.train`, or the method's own section)."""
        opt = local_optimizer(self.config)
        return dict(num_classes=self.num_classes, input_spec=self.input_spec,
                    lr_local=opt["lr_local"], local_momentum=opt["local_momentum"],
                    local_epochs=self.local_epochs, batch_size=opt["batch_size"],
                    unroll_local_steps=self.config.execution.unroll_local_steps,
                    drop_partial_batch=self.config.train.drop_partial_batch,
                    augment=self.config.train.augment)

    def dp_sgd(self) -> local_training.DPSGDConfig | None:
        """Sample-level DP-SGD settings (`config.dp_sgd`), or None when it is off."""
        d = self.config.dp_sgd
        return local_training.DPSGDConfig(d.clip_norm, d.noise_multiplier) if d.enabled else None


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry:
    """One registered method.

    Attributes:
      name: `config.algorithm`.
      build: BuildInputs -> Algorithm.
      aggregation: 'shared' (one tree for every cohort, weighted mean over all participants),
        'per_cohort' (one model per architecture cohort), 'custom' (other server math:
        prototypes, header training; robust aggregation, DP and secure aggregation are refused)
        or 'none' (nothing is uploaded). Must equal the built `Algorithm.aggregation`.
      asynchronous: runs under buffered asynchronous aggregation (FedBuff): its upload is a
        model measured from the broadcast, so a stale update can be re-based.
      dp_sgd: has sample-level DP-SGD built into its local step.
      batch_norm: accepts backbones with BatchNorm layers (running statistics kept local).
      modalities: the input modalities it runs on ('image', 'text', 'tabular').
      shared_model: every client also trains one small shared model of architecture
        `config.clients.shared_arch` (checked against the dataset's modality).
      schedule_depends_on_rounds: its schedule reads `config.train.rounds` (so a resumed run may
        not change the total).
      private_optimizer: its clients keep a private model whose local-optimizer state
        (`ClientState.opt_state`) lives across rounds; `config.train.reset_local_optimizer`
        resets it at the start of each round. Methods without it start every round's local
        optimizer fresh (the FedAvg family: the local model restarts from the global one).
      proxy_init: can start its shared E_proxy from a saved one (`config.proxy_init`).
      check: config -> None, raising ValueError naming the field, for the method's own config
        section (run by `engine.validate` before anything is built).
      summary: one line for listings, with the paper.
    """

    name: str
    build: Callable[[BuildInputs], Algorithm]
    aggregation: str = "shared"
    asynchronous: bool = False
    dp_sgd: bool = False
    batch_norm: bool = False
    modalities: tuple[str, ...] = ("image", "text", "tabular")
    shared_model: bool = False
    schedule_depends_on_rounds: bool = False
    private_optimizer: bool = False
    proxy_init: bool = False
    check: Callable[[ml_collections.ConfigDict], None] | None = None
    summary: str = ""

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"algorithm '{self.name}': aggregation must be one of "
                             f"{AGGREGATIONS}, got '{self.aggregation}'")


_ENTRIES: dict[str, AlgorithmEntry] = {}
_DISCOVERED = False


def register(entry: AlgorithmEntry) -> AlgorithmEntry:
    """Makes a method usable by name in `config.algorithm`.

    The shipped methods call it when their module is imported (every module of
    `fedjax_pfedes/algorithms/` is discovered); a researcher's method calls it from its own code
    before the run starts.

    Args:
      entry: the method's name, `build` (BuildInputs -> Algorithm), capabilities and config
        check.

    Returns:
      `entry`. A name may be taken once: registering another entry under a taken name raises
      ValueError.
    """
    if entry.name in _ENTRIES and _ENTRIES[entry.name] != entry:
        raise ValueError(f"algorithm '{entry.name}' is registered twice")
    _ENTRIES[entry.name] = entry
    return entry


def _discover() -> None:
    package = importlib.import_module("fedjax_pfedes.algorithms")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"fedjax_pfedes.algorithms.{module.name}")


def entries() -> dict[str, AlgorithmEntry]:
    """Every registered method by name (imports every module of the package once)."""
    global _DISCOVERED
    if not _DISCOVERED:
        _discover()
        _DISCOVERED = True
    return dict(_ENTRIES)


def names() -> tuple[str, ...]:
    return tuple(entries())


def get(name: str) -> AlgorithmEntry:
    """The entry of `config.algorithm` (ValueError naming the field and the known names)."""
    known = entries()
    if name not in known:
        raise ValueError(f"config.algorithm: unknown algorithm '{name}'; known: {list(known)}")
    return known[name]


def build(config: ml_collections.ConfigDict, num_classes: int, input_spec: InputSpec,
          local_epochs: int, clients_per_arch: collections.Counter) -> Algorithm:
    """The configured method, built; checks it declares the aggregation its entry promised."""
    entry = get(config.algorithm)
    algorithm = entry.build(BuildInputs(config, num_classes, input_spec, local_epochs,
                                        clients_per_arch))
    if local_optimizer(config)["reset_local_optimizer"]:
        programs = algorithm.cohort_program
        algorithm = dataclasses.replace(
            algorithm, cohort_program=lambda arch: with_fresh_local_optimizer(programs(arch)))
    if algorithm.aggregation != entry.aggregation or algorithm.name != entry.name:
        raise AssertionError(f"algorithm '{entry.name}' built as '{algorithm.name}' with "
                             f"aggregation '{algorithm.aggregation}', registered with "
                             f"'{entry.aggregation}'")
    return algorithm
