"""pFedES on federated EMNIST with its natural split: one client per writer (LEAF / TFF).

Reads TFF's fed_emnist_train.h5 / fed_emnist_test.h5 (3,383 writers, 62 classes) from
config.data.data_dir; 200 writers chosen at random (seeded), each split 8:2 into local train/test;
10% of clients per round; the three image cohorts of the quick start.

  python -m launch.main --config=configs/femnist_natural.py --config.data.data_dir=/path/to/h5s
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
    config = quickstart.get_config()
    config.data.name = "femnist"
    config.data.partition = "natural"
    config.data.num_clients = 200
    config.train.client_fraction = 0.1
    config.train.rounds = 100
    config.eval.every = 10
    config.eval.global_test_samples = 2000
    return config
