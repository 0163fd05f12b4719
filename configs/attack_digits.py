"""A wild client against each upload protection (docs/threat_model.md, "What an attacker who
skips client code can do"): FedAvg on sklearn's digits (shipped offline), 10 clients, 5 per
round, uniform weights (so DP and the plain runs aggregate alike), 20 rounds. The attack
fields are off here; the study's variants switch them on:

  python -m launch.compare --config=configs/attack_digits.py --seeds=5 \\
    --workdir=runs/attack_digits --variant=honest: '--variant=dp_honest:dp.enabled=True' \\
    --variant='defaults:attack.kind=constant;attack.clients=3,' \\
    --variant='dp:attack.kind=constant;attack.clients=3,;dp.enabled=True' \\
    --variant='secagg:attack.kind=constant;attack.clients=3,;secagg.enabled=True' \\
    --variant='secagg_dp:attack.kind=constant;attack.clients=3,;secagg.enabled=True;'\\
'dp.enabled=True' \\
    --paired_with=defaults=honest,secagg=honest,dp=dp_honest,secagg_dp=dp_honest
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
    config = quickstart.get_config()
    config.algorithm = "fedavg"
    config.data.name = "digits"
    config.data.num_clients = 10
    config.data.min_samples_per_client = 30
    config.clients.architectures = "mlp"
    config.proxy_arch = "proxy_mlp"
    config.train.rounds = 20
    config.train.lr_local = 0.05
    config.upload.weighting = "uniform"
    config.dp.clip_norm = 1.0
    config.dp.noise_multiplier = 0.5   # the noise std on the sum, 0.5 C, is 0.1 C on the mean
    config.attack.value = 1e4
    config.checkpoint.every = 0
    return config
