"""The quick start with every upload protection on: pFedES + top-k sparsification with error
feedback + client-level DP (DP-FedAvg, RDP accounting) + secure aggregation with drop-outs.

  python -m launch.main --config=configs/private_quickstart.py --workdir=runs/private_quickstart

Only E_proxy's update leaves a client (private backbones, heads and projections never do); it is
top-k sparsified (10%, error feedback), clipped to L2 <= 0.05 (pFedES's proxy updates are
~0.015-0.03 on this population, runs/quickstart/metrics.jsonl), noised so that the 20 rounds spend
epsilon = 8 at delta = 1e-5 (client level, replace-one neighbours), and summed under secure
aggregation where 10% of the senders drop before unmasking. With 20 clients the DP noise is
large next to the signal: client-level DP is made for populations of thousands
(docs/guide/upload_pipeline.md).
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
    config = quickstart.get_config()
    config.upload.topk_fraction = 0.1
    config.upload.weighting = "uniform"   # DP: every clipped update counts once
    config.dp.enabled = True
    config.dp.clip_norm = 0.05
    config.dp.target_epsilon = 8.0        # sigma calibrated for 20 rounds of 10 of 20 clients
    config.dp.delta = 1e-5
    config.secagg.enabled = True
    config.secagg.dropout_after_upload = 0.1
    return config
