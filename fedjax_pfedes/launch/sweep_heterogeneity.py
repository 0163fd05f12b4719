"""Findings F1/F2 of docs/design.md as an experiment: pFedES vs FedAvg (run per cohort) vs
Standalone as the share of clients whose architecture differs from the majority grows.

  python -m launch.sweep_heterogeneity --config=configs/quickstart.py \
      --ratios=0,0.2,0.4,0.6,0.8 --algorithms=pfedes,fedavg,standalone --seeds=1 \
      --workdir=runs/heterogeneity

For each ratio r, round(r * N) clients take the `--others` architectures in turn and the rest the
`--majority` one; every method sees the same data, clients and sampling seeds. Writes
<workdir>/heterogeneity.md (one row per ratio, mean personalized accuracy per method, and pFedES
minus FedAvg) and heterogeneity.json.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from absl import flags
from ml_collections import config_flags

from fedjax_pfedes import markdown
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError, DatasetUnavailableError
from fedjax_pfedes.launch import cli, jobs_flag
from fedjax_pfedes.launch.cli import fail, loaded_config
from fedjax_pfedes.studies import experiments

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_RATIOS = flags.DEFINE_list("ratios", ["0", "0.2", "0.4", "0.6", "0.8"],
                            "Heterogeneity ratios (share of clients off the majority model).")
_ALGORITHMS = flags.DEFINE_list("algorithms", ["pfedes", "fedavg", "standalone"], "Methods.")
_MAJORITY = flags.DEFINE_string("majority", "convnet3", "The majority architecture.")
_OTHERS = flags.DEFINE_list("others", ["convnet5", "vit", "mlp", "cnn_small"],
                            "Architectures of the minority (ratio 0.8 needs 4: none may outnumber "
                            "the majority).")
_SEEDS = flags.DEFINE_integer("seeds", 1, "Seeds per cell.", lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", "runs/heterogeneity", "Where runs and tables go.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show progress bars.")


def main(argv: list[str]) -> None:
    del argv
    config = loaded_config(_CONFIG)
    n = config.data.num_clients
    variants = {}
    try:
        ratios = [float(r) for r in _RATIOS.value]
    except ValueError:
        fail(f"--ratios: '{','.join(_RATIOS.value)}' is not a comma-separated list of numbers")
    cli.output_folder("workdir", _WORKDIR.value)
    try:
        for ratio in ratios:
            archs = experiments.heterogeneous_architectures(n, ratio, _MAJORITY.value,
                                                            _OTHERS.value)
            for name in _ALGORITHMS.value:
                variants[f"r{ratio:g}/{name}"] = {"algorithm": name,
                                                  "clients.architectures": archs}
                config.algorithm, config.clients.architectures = name, archs
                validate_config(config)
        with jobs_flag.run_pool(_PROGRESS.value) as pool:
            results = experiments.run_grid(config, variants, _SEEDS.value, _WORKDIR.value,
                                           _PROGRESS.value, pool=pool)
    except (ConfigError, DatasetUnavailableError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    methods = _ALGORITHMS.value
    both = {"pfedes", "fedavg"} <= set(methods)
    rows = []
    for ratio in ratios:
        acc = {m: np.mean([r["final"]["personalized_accuracy_mean"]
                           for r in results[f"r{ratio:g}/{m}"]]) for m in methods}
        archs = variants[f"r{ratio:g}/{methods[0]}"]["clients.architectures"]
        rows.append([f"{ratio:g}", archs, *(f"{acc[m]:.4f}" for m in methods),
                     *([f"{100 * (acc['pfedes'] - acc['fedavg']):+.1f} pp"] if both else [])])
    lines = [markdown.table(["heterogeneity ratio", "architectures",
                             *(f"{m} personalized acc" for m in methods),
                             *(["pfedes − fedavg"] if both else [])], rows)]
    header = (f"{config.data.name}, {n} clients, partition {config.data.partition}, "
              f"{config.train.rounds} rounds, {_SEEDS.value} seed(s); mean personalized accuracy "
              "over all clients at the last round.")
    table = "\n".join(lines)
    with open(os.path.join(_WORKDIR.value, "heterogeneity.md"), "w") as f:
        f.write(header + "\n\n" + table + "\n")
    with open(os.path.join(_WORKDIR.value, "heterogeneity.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(header + "\n\n" + table)


def console() -> None:
    """`python -m launch.sweep_heterogeneity` from a checkout;
    `fedjax-pfedes-sweep-heterogeneity` installed."""
    cli.run(main, required=("config",))


if __name__ == "__main__":
    console()
