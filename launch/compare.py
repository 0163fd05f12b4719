"""Compares federated methods under identical data, clients and sampling seeds.

  python -m launch.compare --config=configs/quickstart.py \
      --algorithms=pfedes,standalone,fedavg,fedprox --seeds=3 --workdir=runs/compare

Runs every method for each seed (config.seed, +1, ...), then writes <workdir>/comparison.md
(mean personalized accuracy ± std over seeds, global accuracy, upload parameters per client per
round, wall time), comparison.json and accuracy_curves.png.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from fedjax_pfedes import experiments
from fedjax_pfedes.algorithms import registry as algorithm_registry
from fedjax_pfedes.builders import load_options
from fedjax_pfedes.config_validation import ConfigError, check_against_data, validate_config
from fedjax_pfedes.data.catalog import load_dataset
from fedjax_pfedes.data.sources import DatasetUnavailableError
from launch import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_ALGORITHMS = flags.DEFINE_list("algorithms", ["pfedes", "standalone", "fedavg"],
                                "Methods to compare (config.algorithm names).")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per method (config.seed, config.seed+1, ...).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/compare", "Where runs and the table go.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show progress bars.")
_REUSE = flags.DEFINE_bool("reuse", True, "Reuse finished runs in the workdir made with the same "
                           "config (resume an interrupted comparison).")


def main(argv: list[str]) -> None:
    del argv
    config = _CONFIG.value
    try:
        known = algorithm_registry.names()
        unknown = [a for a in _ALGORITHMS.value if a not in known]
        if unknown:
            raise ConfigError(f"--algorithms: unknown {unknown}; known: {list(known)}")
        if _SEEDS.value < 1:
            raise ConfigError(f"--seeds must be >= 1, got {_SEEDS.value}")
        central = load_dataset(config.data.name, load_options(config))
        for name in _ALGORITHMS.value:  # every method checked before the first run starts
            config.algorithm = name
            validate_config(config)
            check_against_data(config, central)
        header = (f"{config.data.name}, {config.data.num_clients} clients "
                  f"({config.clients.architectures}), partition {config.data.partition}, "
                  f"{config.train.rounds} rounds, {_SEEDS.value} seed(s); accuracy at the last "
                  "round.")

        def write(results):  # after every seed, so an interrupted comparison leaves a table
            done = {k: v for k, v in results.items() if v}
            seeds_done = min(len(v) for v in done.values())
            table = experiments.markdown_table(done)
            note = "" if seeds_done == _SEEDS.value else (
                f" (partial: {seeds_done} of {_SEEDS.value} seeds so far)")
            with open(os.path.join(_WORKDIR.value, "comparison.md"), "w") as f:
                f.write(header + note + "\n\n" + table + "\n")
            with open(os.path.join(_WORKDIR.value, "comparison.json"), "w") as f:
                json.dump(done, f, indent=1)
            title = header.split(";")[0].replace(f"{_SEEDS.value} seed(s)",
                                                 f"{seeds_done} of {_SEEDS.value} seed(s)")
            experiments.accuracy_curves(done, os.path.join(_WORKDIR.value, "accuracy_curves.png"),
                                        title)
            return table

        results = experiments.run_grid(config, {a: {"algorithm": a} for a in _ALGORITHMS.value},
                                       _SEEDS.value, _WORKDIR.value, _PROGRESS.value,
                                       reuse=_REUSE.value, on_seed_done=write)
    except (ConfigError, DatasetUnavailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(header + "\n\n" + write(results))
    print(f"\nwrote {_WORKDIR.value}/comparison.md, comparison.json, accuracy_curves.png")


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    app.run(main, flags_parser=cli.parse_flags)
