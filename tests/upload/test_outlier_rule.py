"""The default norm-outlier rule leaves honest heterogeneity alone and still stops a wild client
(U23 of docs/threat_model.md)."""

import json

import numpy as np
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


def test_the_rules_decision_by_hand():
    """Median of the valid norms (the mean of the two middle ones for an even count), flags
    above factor x median, nothing with fewer than 3 valid norms."""
    from fedjax_pfedes.upload.validation import norm_outliers

    flags = norm_outliers(np.array([1, 2, 3, 4, 100], np.float32), np.ones(5, bool), 10.0)
    np.testing.assert_array_equal(flags, [False, False, False, False, True])  # median 3
    flags = norm_outliers(np.array([1, 2, 3, 4, 35, 36], np.float32), np.ones(6, bool), 10.0)
    np.testing.assert_array_equal(flags, [False] * 5 + [True])  # median 3.5: 35 is not above
    valid = np.array([True, True, False, True, True])
    flags = norm_outliers(np.array([1, 2, 1e9, 3, 31], np.float32), valid, 10.0)
    np.testing.assert_array_equal(flags, [False, False, False, False, True])  # median 2.5
    np.testing.assert_array_equal(
        norm_outliers(np.array([1, 1e9], np.float32), np.ones(2, bool), 10.0), [False, False])
    np.testing.assert_array_equal(norm_outliers(np.zeros(3, np.float32), np.zeros(3, bool),
                                                10.0), [False] * 3)
