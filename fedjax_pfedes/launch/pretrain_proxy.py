"""Pretrains E_proxy on the public share of a config's data, for `config.proxy_init`.

  python -m launch.pretrain_proxy --config=configs/quickstart.py \
      --config.data.public_fraction=0.1 --output=runs/proxy_mnist5k.msgpack
  python -m launch.main --config=configs/quickstart.py --config.data.public_fraction=0.1 \
      --config.proxy_init=runs/proxy_mnist5k.msgpack --workdir=runs/quickstart_pretrained

The public share (class-stratified, seeded by config.seed) is held out of the pool before the
partition, in both programs, so no client owns a sample E_proxy was pretrained on; the run
refuses a file pretrained on another share of the same dataset. E_proxy (config.proxy_arch,
config.proxy_dim) trains with a linear classifier head on cross-entropy; the head's accuracy on
the global test set (a linear probe) is printed and saved in the file's metadata.
"""

from __future__ import annotations

import json
import os

from absl import flags
from ml_collections import config_flags

from fedjax_pfedes.algorithms.pfedes import proxy_init
from fedjax_pfedes.algorithms.pfedes.pretraining import (
    PretrainSettings,
    pretrain_proxy,
    save_pretrained,
)
from fedjax_pfedes.engine.build import load_validated_pool
from fedjax_pfedes.engine.sections import method_settings
from fedjax_pfedes.errors import ConfigError, DataError, DatasetUnavailableError
from fedjax_pfedes.launch import cli
from fedjax_pfedes.launch.cli import fail, loaded_config

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.",
                                          lock_config=True)
_OUTPUT = flags.DEFINE_string("output", "runs/proxy.msgpack", "Where the E_proxy file goes "
                              "('{seed}' is replaced by config.seed: one file per seed).")
_EPOCHS = flags.DEFINE_integer("epochs", 10, "Passes over the public data.")
_LR = flags.DEFINE_float("lr", 0.05, "SGD learning rate.")
_MOMENTUM = flags.DEFINE_float("momentum", 0.9, "SGD momentum.")
_BATCH = flags.DEFINE_integer("batch_size", 64, "Batch size.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


def main(argv: list[str]) -> None:
    del argv
    config = loaded_config(_CONFIG)
    output = proxy_init.resolve(_OUTPUT.value, config.seed)
    cli.output_folder("output", os.path.dirname(os.path.abspath(output)),
                      f"the folder of --output={_OUTPUT.value}")
    try:
        settings = PretrainSettings(_EPOCHS.value, _LR.value, _MOMENTUM.value, _BATCH.value)
        view = method_settings(config, "pfedes")
        params, report = pretrain_proxy(view, settings, *load_validated_pool(config),
                                        show_progress=_PROGRESS.value)
        save_pretrained(output, view, params, report)
    except (ConfigError, DatasetUnavailableError, DataError) as e:
        fail(str(e))
    except OSError as e:
        fail(f"--output={_OUTPUT.value}: {e.strerror}")
    shown = {k: v for k, v in report.items() if k != "loss_per_epoch"}
    print(json.dumps(shown, indent=1))
    print(f"wrote {output}; use it with --config.proxy_init={_OUTPUT.value} "
          f"--config.data.public_fraction={config.data.public_fraction}")


def console() -> None:
    """`python -m launch.pretrain_proxy` from a checkout; `fedjax-pfedes-pretrain-proxy`
    installed."""
    cli.run(main, required=("config",))


if __name__ == "__main__":
    console()
