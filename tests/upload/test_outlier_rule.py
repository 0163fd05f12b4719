"""The default norm-outlier rule leaves honest heterogeneity alone and still stops a wild client
(U23 of docs/threat_model.md)."""

import json

import pytest
from fl_helpers import tiny_config

from fedjax_pfedes.engine.loop import run_experiment


@pytest.mark.slow
def test_U23_quantity_skew_sigma_2_rejects_no_honest_client_and_still_the_attacker(tmp_path):
    """FedAvg on mnist5k, 20 clients of LogNormal(0, 2) sizes (40 to 834 samples), 20 rounds:
    raw update norms of one round differ ~20x and the raw 10x-median rule rejected the largest
    honest clients 9 times here; judged per local sample, none is, while a 1e4 attacker is
    rejected in every round it takes part."""
    config = tiny_config(rounds=20, num_clients=20)
    config.algorithm = "fedavg"
    config.data.name = "mnist5k"
    config.data.partition = "quantity_skew"
    config.data.quantity_sigma = 2.0
    config.data.min_samples_per_client = 40
    config.train.client_fraction = 0.5
    config.eval.every = 20
    config.attack.clients = "3"
    config.attack.kind = "constant"
    config.attack.value = 1e4
    run_experiment(config, str(tmp_path), show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "clients.jsonl")]
    sizes = {r["client"]: r["samples"] for r in rows}
    assert max(sizes.values()) / min(sizes.values()) > 10  # the skew the test is about
    rejected = [r for r in rows if not r["accepted"]]
    assert rejected and {r["client"] for r in rejected} == {3}
    assert len(rejected) == sum(r["client"] == 3 for r in rows)
