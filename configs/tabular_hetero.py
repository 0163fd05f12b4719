"""Tabular pFedES: sklearn's breast-cancer table (real, shipped offline), three MLP cohorts.

569 patients x 30 features, 2 classes; 20% held out as the global test set, the rest split over
10 clients with Dirichlet(0.5) label skew. Features are standardized with the training pool's
statistics inside every model and E_proxy (a 1-hidden-layer MLP).

  python -m launch.main --config=configs/tabular_hetero.py --workdir=runs/tabular_hetero
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
    config = quickstart.get_config()
    config.proxy_arch = "proxy_mlp"
    config.proxy_dim = 32
    config.data.name = "breast_cancer"
    config.data.num_clients = 10
    config.data.dirichlet_alpha = 0.5
    config.data.min_samples_per_client = 15
    config.clients.architectures = "mlp,mlp_small,mlp_deep"
    config.train.rounds = 20
    config.train.batch_size = 16
    config.train.lr_local = 0.02
    return config
