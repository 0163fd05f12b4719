"""The quick start under real-world client behaviour (docs/guide/clients.md).

  python -m launch.budget --config=configs/unreliable_quickstart.py
  python -m launch.main --config=configs/unreliable_quickstart.py --workdir=runs/unreliable
  python -m launch.report runs/unreliable

Half the clients are online 90 % of rounds, half only 50 %; 10 % of the selected clients drop out
before uploading; devices come in three speed classes (step time x1, x2, x4, with 20 % per-round
jitter) and uplinks of 10 / 5 / 2 Mbit/s; a round ends after 3 simulated seconds and late clients
contribute the local steps they finished (FedNova-style partial work). Sampling is stratified by
sample count x availability class with quotas, so rarely-online and small clients keep
participating; clients that keep failing are picked less. Local epochs adapt to client size.
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
    config = quickstart.get_config()
    config.train.sampling = "stratified"
    config.train.adaptive_epochs = True   # E_i = clip(round(2 sqrt(median n / n_i)), 1, 4)
    config.system.availability = "0.9,0.5"
    config.system.dropout = 0.1
    config.system.speed_classes = "1,2,4"
    config.system.time_jitter = 0.2
    config.system.upload_mbps = "10,5,2"
    config.system.deadline_s = 3.0
    config.system.deadline_policy = "partial"
    return config
