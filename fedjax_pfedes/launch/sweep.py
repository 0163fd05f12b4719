"""Sweeps one float hyper-parameter, all members trained together in one compiled program.

  python -m launch.sweep --config=configs/quickstart.py --sweep.lam=0.1,0.5,1.0,2.0
  python -m launch.sweep --config=configs/quickstart.py --sweep.train.lr_local=0.01,0.05

`--sweep.FIELD=v1,v2,...` names any float config field the client update reads (lam,
train.lr_local, proxy_lr_ratio, server_momentum, …). Every member is an ordinary run in
<workdir>/FIELD=VALUE (metrics.jsonl, summary.json, …) whose numbers equal
`launch.main --config.FIELD=VALUE` up to float reassociation; their local training runs as one
program vmapped over the members (`fedjax_pfedes.studies.vectorized_sweep`). Writes
<workdir>/sweep.md (table) and
sweep.png (final accuracy against the value; accuracy curves). Fields that change shapes or
control flow (proxy_dim, architectures, …) are refused with one line naming them.
"""

from __future__ import annotations

import os
import sys

from absl import flags
from ml_collections import config_flags

from fedjax_pfedes.errors import ConfigError, DataError, DatasetUnavailableError, StorageError
from fedjax_pfedes.io.workdir import RunLockedError
from fedjax_pfedes.launch import cli
from fedjax_pfedes.launch.cli import fail, loaded_config
from fedjax_pfedes.studies import experiments, vectorized_sweep

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/sweep", "One folder per member goes here.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show the first member's progress bar.")
_MEMBER_AXIS = flags.DEFINE_enum("member_axis", "vmap", ["vmap", "map"],
                                 "How members share the compiled client update: 'vmap' batches "
                                 "them, 'map' runs them one after another in the program "
                                 "(docs/performance.md compares them).")

_SWEPT: dict[str, list[float]] = {}


def parse_flags(argv: list[str]) -> list[str]:
    rest, swept = cli.split_sweep_flags(argv)
    _SWEPT.update(swept)
    return cli.parse_flags(rest)


def main(argv: list[str]) -> None:
    del argv
    if len(_SWEPT) != 1:
        fail("give exactly one --sweep.FIELD=v1,v2,... (e.g. --sweep.lam=0.1,0.5,1.0,2.0), got "
             f"{len(_SWEPT)}")
    config = loaded_config(_CONFIG)
    cli.output_folder("workdir", _WORKDIR.value)
    (field, values), = _SWEPT.items()
    try:
        records = vectorized_sweep.run_sweep(config, field, values, _WORKDIR.value, _PROGRESS.value,
                                  _MEMBER_AXIS.value)
    except (ConfigError, DatasetUnavailableError, DataError, RunLockedError,
            StorageError) as e:
        fail(str(e))
    results = {name: [r] for name, r in records.items()}
    title = (f"{config.algorithm} on {config.data.name}, {config.data.num_clients} clients, "
             f"sweep over {field}")
    table = experiments.markdown_table(results).replace("| method |", f"| {field} |", 1)
    path = os.path.join(_WORKDIR.value, "sweep.md")
    with open(path, "w") as f:
        f.write(f"{title}; accuracy at the last round, one compiled program for all members.\n\n"
                f"{table}\n")
    experiments.accuracy_curves(results, os.path.join(_WORKDIR.value, "sweep.png"), title)
    print(table)
    print(f"\nwrote {path}, sweep.png and one folder per member in {_WORKDIR.value}",
          file=sys.stderr)


def console() -> None:
    """`python -m launch.sweep` from a checkout; `fedjax-pfedes-sweep` installed."""
    cli.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    console()
