"""Text pFedES on AG News (tensorflow-datasets 'ag_news_subset', 120,000 train / 7,600 test news
items, 4 classes): title + description, 10,000-word vocabulary, 64 tokens; 100 clients with
Dirichlet(0.3) label skew; three text-model cohorts. AG News must be prepared first
(`tfds build ag_news_subset --file_format=array_record`; the run says so if it is not).

  python -m launch.main --config=configs/agnews_hetero.py --workdir=runs/agnews_hetero
"""

import ml_collections

from configs import text_hetero


def get_config() -> ml_collections.ConfigDict:
    config = text_hetero.get_config()
    config.data.name = "ag_news"
    config.data.text_vocab_size = 10000
    config.data.num_clients = 100
    config.data.min_samples_per_client = 100
    config.train.client_fraction = 0.1
    config.train.rounds = 50
    config.eval.every = 10
    config.eval.global_test_samples = 2000
    return config
