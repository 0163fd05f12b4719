"""Text pFedES offline: a generated 4-topic corpus, three text-model cohorts.

6,000 generated documents (`fedjax_pfedes.data.text.synthetic_topic_corpus`: Zipf background
words + class topic words; not real text), vocabulary 2,000, 64 tokens; 20 clients with
Dirichlet(0.3) label skew; clients cycle over a bag-of-embeddings model, a text CNN and a small
Transformer; E_proxy is an embedding bag. For real text use configs/agnews_hetero.py.

  python -m launch.main --config=configs/text_hetero.py --workdir=runs/text_hetero
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
    config = quickstart.get_config()
    config.proxy_arch = "proxy_text"
    config.proxy_dim = 64
    config.data.name = "synthetic_text"
    config.data.text_max_length = 64
    config.data.num_clients = 20
    config.data.dirichlet_alpha = 0.3
    config.data.min_samples_per_client = 40
    config.clients.architectures = "embedbag,text_cnn,text_transformer"
    config.train.rounds = 20
    config.train.lr_local = 0.05
    return config
