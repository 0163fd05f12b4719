"""fedjax_pfedes: a JAX/Flax simulator for model-heterogeneous personalized federated learning.

The flagship algorithm is pFedES (Yi et al., "pFedES: Generalized Proxy Feature Extractor Sharing
for Model Heterogeneous Personalized Federated Learning", AAAI 2025), in
`fedjax_pfedes.algorithms.pfedes`; 16 other methods sit beside it in `fedjax_pfedes.algorithms`.

The public API:

  config = fedjax_pfedes.default_config()         # every field, at its default (the quick start)
  config.algorithm = "pfedes"
  summary = fedjax_pfedes.run(config, "runs/mine")

and, to bring your own model, data or method:

  fedjax_pfedes.register_architecture("mynet", MyFlaxModule(), modalities=("image",))
  fedjax_pfedes.register_dataset("mydata", lambda options: fedjax_pfedes.from_arrays(
      "mydata", x_train, y_train, x_test, y_test, options=options))
  @dataclasses.dataclass(frozen=True)
  class MySection(fedjax_pfedes.Section):   # its config fields, each declared once
      SECTION = "mymethod"
      weight: float = fedjax_pfedes.param(0.5, "the weight of my term", fedjax_pfedes.at_least(0))
  fedjax_pfedes.register_algorithm(fedjax_pfedes.AlgorithmEntry(
      "mymethod", build=..., section=MySection))  # build gets BuildInputs.section built
  config = fedjax_pfedes.default_config()  # after registering: has config.mymethod.weight
  fedjax_pfedes.register_stage(MyStage)                  # an UploadStage subclass
  fedjax_pfedes.run(config, "runs/mine", callbacks=[MyCallback()])   # per-round hooks

notebooks/own_model_and_data.ipynb runs pFedES on a Flax module and arrays defined in the
notebook.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import ml_collections

from fedjax_pfedes.algorithms.base import Algorithm, CohortProgram
from fedjax_pfedes.algorithms.registry import AlgorithmEntry, BuildInputs
from fedjax_pfedes.algorithms.registry import register as register_algorithm
from fedjax_pfedes.config.fields import Range, Section, above, at_least, between, one_of, param
from fedjax_pfedes.data.arrays import from_arrays
from fedjax_pfedes.data.catalog import register_dataset
from fedjax_pfedes.data.sources import CentralDataset, LoadOptions
from fedjax_pfedes.data.spec import InputSpec
from fedjax_pfedes.engine.callbacks import Callback, RoundEnd, RunInfo
from fedjax_pfedes.engine.loop import run_experiment
from fedjax_pfedes.engine.schema import default_config
from fedjax_pfedes.errors import (
    ConfigError,
    DataError,
    DatasetUnavailableError,
    DivergedError,
    NothingTrainedError,
    RunInterrupted,
)
from fedjax_pfedes.models.backbones import register_architecture
from fedjax_pfedes.upload.stages import UploadStage, register_stage

__version__ = "0.1.0"

__all__ = [
    "Algorithm",
    "AlgorithmEntry",
    "BuildInputs",
    "Callback",
    "CentralDataset",
    "CohortProgram",
    "ConfigError",
    "DataError",
    "DatasetUnavailableError",
    "DivergedError",
    "InputSpec",
    "LoadOptions",
    "NothingTrainedError",
    "RunInterrupted",
    "Range",
    "RoundEnd",
    "RunInfo",
    "Section",
    "above",
    "at_least",
    "between",
    "one_of",
    "param",
    "UploadStage",
    "default_config",
    "from_arrays",
    "register_algorithm",
    "register_architecture",
    "register_dataset",
    "register_stage",
    "run",
]


def run(config: ml_collections.ConfigDict, workdir: str, *, progress: bool = True,
        callbacks: Sequence[Callback] = ()) -> dict:
    """Runs one federated experiment.

    Args:
      config: an experiment config (`default_config()` and its overrides, or a file of
        `configs/`); checked up front, a bad field raises `ConfigError` naming it.
      workdir: where metrics.jsonl (one record per round), clients.jsonl, checkpoints and
        summary.json go. A workdir holding a checkpoint of the same config resumes from it.
      progress: show a progress bar over rounds.
      callbacks: `Callback`s called after every round, in order, after the round's evaluation
        and before its record is written (what they add to `end.record` lands in
        metrics.jsonl; `end.stop = True` ends the run early). See `fedjax_pfedes.engine.callbacks`.

    Returns:
      The run's summary (as summary.json): `final` holds the last evaluation (personalized and
      global accuracy per client, per architecture and on average), plus privacy, timing and
      upload figures.
    """
    _check_run_arguments(config, workdir, callbacks)
    return run_experiment(config, os.fspath(workdir), show_progress=progress,
                          callbacks=list(callbacks))


_CALLBACK_HOOKS = ("on_run_start", "on_round_end", "on_run_end", "close")


def _check_run_arguments(config, workdir, callbacks) -> None:
    """`run`'s arguments, checked where they are handed over (ConfigError naming the argument,
    what it expects and what it got)."""
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(f"run: config must be an ml_collections.ConfigDict (e.g. "
                          f"fedjax_pfedes.default_config()), got {type(config).__name__}")
    if not isinstance(workdir, str | os.PathLike) or not os.fspath(workdir):
        raise ConfigError(f"run: workdir must be a non-empty path, got {workdir!r}")
    if isinstance(callbacks, Callback) or not isinstance(callbacks, Sequence | tuple | list):
        raise ConfigError(f"run: callbacks must be a list of Callback objects, got "
                          f"{type(callbacks).__name__}")
    for i, cb in enumerate(callbacks):
        missing = [h for h in _CALLBACK_HOOKS if not callable(getattr(cb, h, None))]
        if missing:
            raise ConfigError(f"run: callbacks[{i}] must be a fedjax_pfedes.Callback (it lacks "
                              f"{', '.join(missing)}), got {type(cb).__name__}")
