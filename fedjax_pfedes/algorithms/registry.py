"""The algorithm registry: every federated method declares itself here, once, in its own module.

An entry says what the rest of the simulator needs to know before and after building the method:
its config name, how the server combines uploads (`aggregation`, which tells the upload pipeline
what it may do), its capabilities (buffered asynchronous rounds, sample-level DP-SGD, BatchNorm
backbones) and `build`, which turns the method's settings plus the dataset's facts into an
`Algorithm`. `engine.loop` and `engine.validate` read only this registry; there are no name
tables elsewhere. Adding a method = one module under `fedjax_pfedes/algorithms/` that calls
`register(...)` at import with its config fields (`fields`, which join the default config), a
test and a row in the README's methods table. `build` and `check` see the method's view of the
config (`BuildInputs.settings`: its own fields and those it declared in `reads`), never the
whole ConfigDict.

Every module of this package is imported by `entries()` (pkgutil discovery), so a new module
needs no import list to be edited.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from fedjax_pfedes.algorithms import local_training
from fedjax_pfedes.algorithms.base import Algorithm, with_fresh_local_optimizer
from fedjax_pfedes.config import fields
from fedjax_pfedes.config.defaults import core_config
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.errors import ConfigError

AGGREGATIONS = ("shared", "per_cohort", "custom", "none")


# Local-training fields a method's config section may set to override `config.train` (numbers:
# -1 = inherit). E.g. `config.scaffold.local_momentum = 0.0`: SCAFFOLD's control variates assume
# plain local SGD, and it diverges with the quick start's momentum 0.9 (docs/baselines_history.md);
# `config.pfedes_paper.batch_size = 512`: the published pFedES runs' batch.
OPTIMIZER_OVERRIDES = ("lr_local", "local_momentum", "reset_local_optimizer", "batch_size")


_OVERRIDE_RANGES = {
    "lr_local": fields.Range(lambda v: v == -1 or v > 0,
                             "> 0 (or -1 = config.train.lr_local)"),
    "local_momentum": fields.Range(lambda v: v == -1 or 0 <= v < 1,
                                   "in [0, 1) (or -1 = config.train.local_momentum)"),
    "batch_size": fields.Range(
        lambda v: v == -1 or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
        "an integer >= 1 (or -1 = config.train.batch_size)"),
    "reset_local_optimizer": None,
}


def check_optimizer_overrides(name: str, section: Mapping[str, Any]) -> None:
    """Raises ValueError naming the field for a bad local-optimizer override (the same ranges
    a method's `local_override` fields declare; -1 = inherit `config.train`'s).

    Args:
      name: the method (`config.algorithm`), whose section `section` is.
      section: the method's config section (its fields by name).
    """
    for field, rule in _OVERRIDE_RANGES.items():
        value = section.get(field, -1)
        if rule is not None and value != -1 and not rule.test(value):
            raise ConfigError(f"config.{name}.{field} must be {rule.wanted}, got {value}")


def local_override(name: str, default: Any, help: str) -> Any:  # noqa: A002
    """A method section's field overriding `config.train.<name>` (one of
    `OPTIMIZER_OVERRIDES`; numbers: -1 = inherit), declared with its range.

    Args:
      name: the `config.train` field it overrides.
      default: the method's default.
      help: why the method sets it.

    Returns:
      A `config.fields.param`.
    """
    return fields.param(default, f"overrides config.train.{name}: {help}", _OVERRIDE_RANGES[name])


@dataclasses.dataclass(frozen=True)
class BuildInputs:
    """What `build` gets: the method's own config values and the facts of the dataset.

    Attributes:
      settings: the method's view of the config (`engine.sections.method_settings`): the fields
        its entry owns (`AlgorithmEntry.fields`) and those it declared it reads
        (`AlgorithmEntry.reads`), read-only and nothing else (an undeclared field is a
        KeyError/AttributeError naming it).
      local: the local-training settings every method's config dataclass takes (`num_classes`,
        `input_spec`, `lr_local`, `local_momentum`, `local_epochs`, `batch_size`,
        `unroll_local_steps`, `drop_partial_batch`, `augment`), the optimizer's fields already
        resolved between `config.train` and the method's section.
      dp_sgd_settings: sample-level DP-SGD (`config.dp_sgd`), or None when it is off.
      num_classes: labels of the dataset.
      input_spec: modality, shape and normalization statistics of the inputs.
      local_epochs: the most local epochs any client runs (fewer are masked per client).
      clients_per_arch: how many clients use each architecture.
      section: the method's own config section (`AlgorithmEntry.section`), built from the
        config with `**` and checked; None for a method without one.
    """

    settings: ml_collections.FrozenConfigDict
    local: Mapping[str, Any]
    dp_sgd_settings: local_training.DPSGDConfig | None
    num_classes: int
    input_spec: InputSpec
    local_epochs: int
    clients_per_arch: collections.Counter
    section: fields.Section | None = None

    def local_training(self) -> dict:
        """The local-training keyword arguments of every method's config dataclass."""
        return dict(self.local)

    def own(self) -> dict:
        """The method's own section as keyword arguments ({} without one): a method's config
        dataclass that derives from its section is built with `**inputs.own()`."""
        if self.section is None:
            return {}
        # its local-optimizer overrides are resolved into `local` (`local_training`)
        return {f.name: getattr(self.section, f.name) for f in dataclasses.fields(self.section)
                if f.name not in OPTIMIZER_OVERRIDES}

    def dp_sgd(self) -> local_training.DPSGDConfig | None:
        """Sample-level DP-SGD settings (`config.dp_sgd`), or None when it is off."""
        return self.dp_sgd_settings


# The norm rule's model-ratio of a method that does not set its own
# (`AlgorithmEntry.norm_model_ratio`): only an upload larger than a tenth of the model it updates
# can be rejected. Late in training most updates shrink to a floor, and a client still learning
# lies tens of robust deviations above it: at convergence on the quick start the z/hard-factor
# rule alone rejected honest FedAvg uploads, all below 0.06 of the model, while the boosted
# updates of docs/threat_model.md were at least 1.05 of FedAvg's model (measured there with
# `python -m benchmarks.norm_rule report --set=converged` and `detect`). A method uploading
# statistics rather than a model update (an all-zero template) is judged as if the test were off.
DEFAULT_NORM_MODEL_RATIO = 0.1


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry:
    """One registered method.

    Attributes:
      name: `config.algorithm`.
      build: BuildInputs -> Algorithm.
      aggregation: 'shared' (one tree for every cohort, weighted mean over all participants),
        'per_cohort' (one model per architecture cohort), 'custom' (other server math:
        prototypes, header training; robust aggregation, DP and secure aggregation are refused)
        or 'none' (nothing is uploaded). Declared here only: `build` sets the Algorithm's.
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
      check: settings -> None, raising ValueError naming the field, for the method's own
        fields (run by `engine.validate` before anything is built, on the same view `build`
        gets as `BuildInputs.settings`).
      check_data: (settings, InputSpec) -> None, raising ValueError naming the field, for what
        only the dataset decides (e.g. an extractor of the data's modality); run by
        `engine.validate.check_against_data` once the data is loaded, before building.
      summary: one line for listings, with the paper.
      section: the method's config section: a frozen dataclass deriving from
        `config.fields.Section` whose `SECTION` is the method's name ('fedkd':
        `config.fedkd.energy_start`) or '' (pFedES's top-level fields, `config.lam`), every
        field made with `config.fields.param` (default, help, range). Its fields join the
        default config (`engine.schema.default_config`), `build` gets it built and checked
        (`BuildInputs.section`), `launch.methods --fields` lists it; two methods may declare
        one path only with one default. None: the method has no fields of its own.
      reads: the other config paths its `build` and `check` read ('proxy_dim',
        'clients.shared_arch', 'train.rounds', a section such as 'system'), besides `fields`.
      norm_model_ratio: the norm rule's `config.upload.norm_outlier_model_ratio` for this
        method when the config leaves it at -1: only uploads larger than this x the norm of the
        model they update are judged (0 = all). Default `DEFAULT_NORM_MODEL_RATIO`; a method
        whose honest updates are much smaller than its model sets less (pFedES: 0, its proxy's
        updates are ~0.006 of it, so a boosted x100 one is only 0.03-0.3), one whose honest
        updates can be a large part of its model more (FedMRL: 0.5; the published pFedES's
        small proxy: 1).
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
    check: Callable[[ml_collections.FrozenConfigDict], None] | None = None
    check_data: Callable[[ml_collections.FrozenConfigDict, InputSpec], None] | None = None
    summary: str = ""
    section: type[fields.Section] | None = None
    reads: tuple[str, ...] = ()
    norm_model_ratio: float = DEFAULT_NORM_MODEL_RATIO

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"AlgorithmEntry: name must be a Python identifier (it is "
                             f"config.algorithm and a config section), got {self.name!r}")
        where = f"AlgorithmEntry('{self.name}')"
        if not callable(self.build):
            raise ValueError(f"{where}: build must be a function of BuildInputs returning an "
                             f"Algorithm, got {type(self.build).__name__}")
        for hook in ("check", "check_data"):
            value = getattr(self, hook)
            if value is not None and not callable(value):
                raise ValueError(f"{where}: {hook} must be a function or None, got "
                                 f"{type(value).__name__}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"algorithm '{self.name}': aggregation must be one of "
                             f"{AGGREGATIONS}, got '{self.aggregation}'")
        if (isinstance(self.modalities, str) or not self.modalities
                or not set(self.modalities) <= {"image", "text", "tabular"}):
            raise ValueError(f"{where}: modalities must be a non-empty tuple of 'image', "
                             f"'text', 'tabular', got {self.modalities!r}")
        if self.section is not None:
            if not (isinstance(self.section, type) and issubclass(self.section, fields.Section)
                    and dataclasses.is_dataclass(self.section)):
                raise ValueError(f"{where}: section must be a dataclass deriving from "
                                 f"config.fields.Section, got {self.section!r}")
            if self.section.SECTION not in (self.name, ""):
                raise ValueError(f"{where}: its section's SECTION must be '{self.name}' (or '' "
                                 f"for top-level fields), got '{self.section.SECTION}'")
            bare = fields.undeclared(self.section)
            if bare:
                raise ValueError(f"{where}: field '{bare[0]}' of {self.section.__name__} is not "
                                 "declared with config.fields.param (default, help, range)")
        if not (isinstance(self.norm_model_ratio, int | float) and self.norm_model_ratio >= 0):
            raise ValueError(f"{where}: norm_model_ratio must be a number >= 0, got "
                             f"{self.norm_model_ratio!r}")
        if isinstance(self.reads, str) or not all(isinstance(p, str) for p in self.reads):
            raise ValueError(f"{where}: reads must be a tuple of config paths, got "
                             f"{self.reads!r}")


    @property
    def fields(self) -> dict[str, Any]:
        """The config fields the method owns, {dotted path: default} (from `section`)."""
        if self.section is None:
            return {}
        return {fields.config_path(self.section, name)[len("config."):]: default
                for name, default in fields.defaults_of(self.section).items()}

    def read_section(self, config: ml_collections.ConfigDict) -> fields.Section | None:
        """The method's section built from `config` (ConfigError naming a field out of range).

        Local-optimizer overrides the section does not declare (`OPTIMIZER_OVERRIDES`) are
        `engine.sections.local_optimizer`'s, not the section's."""
        if self.section is None:
            return None
        names = [f.name for f in dataclasses.fields(self.section)]
        if self.section.SECTION:
            node = config.get(self.section.SECTION) or {}
            values = {k: v for k, v in dict(node).items()
                      if k in names or k not in OPTIMIZER_OVERRIDES}
        else:
            values = {k: config[k] for k in names if k in config}
        return fields.build(self.section, values)


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
    if not isinstance(entry, AlgorithmEntry):
        raise ConfigError(f"register_algorithm: expected an AlgorithmEntry, got "
                        f"{type(entry).__name__}")
    if not _BUILT_IN_LOADING:
        entries()  # the built-ins first, so a name or field is judged against all of them
    if entry.name in _ENTRIES and _ENTRIES[entry.name] != entry:
        raise ValueError(f"algorithm '{entry.name}' is registered twice"
                         + ("" if _BUILT_IN_LOADING else " (a built-in method has that name; "
                            "choose another)" if _is_built_in(entry.name) else ""))
    _check_fields(entry)
    _ENTRIES[entry.name] = entry
    return entry


def _is_built_in(name: str) -> bool:
    module = getattr(_ENTRIES[name].build, "__module__", "") or ""
    return module.startswith("fedjax_pfedes.")


def _check_fields(entry: AlgorithmEntry) -> None:
    """Refuses fields that collide with the core config's (or sit inside/over one of its
    fields) or with another method's declaration of the same path at another default, naming
    both owners."""
    core = core_paths()
    for path, default in entry.fields.items():
        prefixes = {".".join(path.split(".")[:i]) for i in range(1, path.count(".") + 1)}
        clash = (path if path in core["leaves"] else
                 next((p for p in prefixes if p in core["leaves"]), None))
        if clash is not None or path in core["sections"]:
            raise ValueError(f"AlgorithmEntry('{entry.name}'): field 'config.{path}' collides "
                             f"with the core config's 'config.{clash or path}'; put the "
                             f"method's fields in its own section ('{entry.name}.x')")
        for other in _ENTRIES.values():
            if other.name == entry.name:
                continue
            if path in other.fields and other.fields[path] != default:
                raise ValueError(f"AlgorithmEntry('{entry.name}'): field 'config.{path}' is "
                                 f"declared by '{other.name}' too, with default "
                                 f"{other.fields[path]!r} (here {default!r})")
            inside = next((p for p in other.fields
                           if p in prefixes or p.startswith(path + ".")), None)
            if inside is not None:
                raise ValueError(f"AlgorithmEntry('{entry.name}'): field 'config.{path}' "
                                 f"collides with the field 'config.{inside}' of "
                                 f"'{other.name}'")


@functools.cache
def core_paths() -> dict[str, frozenset[str]]:
    """The core config's leaf paths and section names ('train.rounds'; 'train')."""
    leaves, sections = set(), set()

    def walk(node, prefix=""):
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, ml_collections.ConfigDict):
                sections.add(path)
                walk(value, path + ".")
            else:
                leaves.add(path)
    walk(core_config())
    return {"leaves": frozenset(leaves), "sections": frozenset(sections)}


_BUILT_IN_LOADING = False


def _discover() -> None:
    global _BUILT_IN_LOADING
    package = importlib.import_module("fedjax_pfedes.algorithms")
    _BUILT_IN_LOADING = True
    try:
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"fedjax_pfedes.algorithms.{module.name}")
    finally:
        _BUILT_IN_LOADING = False


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
        raise ConfigError(f"config.algorithm: unknown algorithm '{name}'; known: {list(known)}")
    return known[name]


def build(name: str, inputs: BuildInputs, reset_local_optimizer: bool) -> Algorithm:
    """The method `name`, built; checks it declares the aggregation its entry promised.

    Args:
      name: a registered method (`config.algorithm`).
      inputs: its settings and the dataset's facts (`engine.sections.build_inputs`).
      reset_local_optimizer: restart the private local optimizer's state every round.

    Returns:
      The `Algorithm`.
    """
    entry = get(name)
    algorithm = entry.build(inputs)
    if not isinstance(algorithm, Algorithm):
        raise ConfigError(f"algorithm '{name}': its AlgorithmEntry.build must return an "
                        f"Algorithm, returned {type(algorithm).__name__}")
    if algorithm.name not in ("", entry.name) or algorithm.aggregation not in (
            "", entry.aggregation):
        raise AssertionError(f"algorithm '{entry.name}' built as '{algorithm.name}' with "
                             f"aggregation '{algorithm.aggregation}', registered with "
                             f"'{entry.aggregation}': leave both to its AlgorithmEntry")
    algorithm = dataclasses.replace(algorithm, name=entry.name, aggregation=entry.aggregation)
    if reset_local_optimizer:
        programs = algorithm.cohort_program
        algorithm = dataclasses.replace(
            algorithm, cohort_program=lambda arch: with_fresh_local_optimizer(programs(arch)))
    return algorithm


def declared_fields() -> dict[str, Any]:
    """Every registered method's own config fields with their defaults (dotted paths).

    Returns:
      {path: default}; ValueError when two methods declare one path with different defaults.
    """
    out: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for entry in entries().values():
        for path, default in entry.fields.items():
            if path in out and out[path] != default:
                raise ConfigError(f"config.{path}: declared by '{owner[path]}' with default "
                                 f"{out[path]!r} and by '{entry.name}' with {default!r}")
            out[path], owner[path] = default, entry.name
    return out
