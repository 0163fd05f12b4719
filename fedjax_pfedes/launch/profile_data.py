"""Profiles a config's partition before anyone trains on it .

  python -m launch.profile_data --config=configs/quickstart.py --workdir=runs/profile_quickstart
  python -m launch.profile_data --config=configs/quickstart.py --config.data.dirichlet_alpha=0.05

Loads and partitions the data exactly as `launch.main` would (same seed), prints a summary table
(per-client sizes, KL divergence from the global label distribution, classes covered, coefficient
of variation of sizes) and writes <workdir>/data_profile.json, label_heatmap.png (clients x
classes) and client_sizes.png. `launch.main` writes the same three files into its workdir.
"""

from __future__ import annotations

import sys

from absl import flags
from ml_collections import config_flags

from fedjax_pfedes.engine.build import build_federated_data, write_data_profile
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError, DatasetUnavailableError
from fedjax_pfedes.launch import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/profile", "Where the profile files go.")


def main(argv: list[str]) -> None:
    del argv
    config = cli.loaded_config(_CONFIG)
    cli.output_folder("workdir", _WORKDIR.value)
    try:
        validate_config(config)
        data = build_federated_data(config)
    except (ConfigError, DatasetUnavailableError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    profile = write_data_profile(data, config.data.partition, _WORKDIR.value)
    print(profile.table())
    print(f"\nwrote {_WORKDIR.value}/data_profile.json, label_heatmap.png, client_sizes.png")


def console() -> None:
    """`python -m launch.profile_data` from a checkout; `fedjax-pfedes-profile-data` installed."""
    cli.run(main, required=("config",))


if __name__ == "__main__":
    console()
